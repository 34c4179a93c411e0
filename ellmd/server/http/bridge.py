"""The runtime as the OpenAI, Responses and Anthropic APIs reach it.

A handler renders the conversation with the chat template and tokenizes it (in a worker thread:
both take a while on long prompts; a long text is encoded with the GIL released, so the event loop
goes on), then submits one `completion` op holding the whole prompt. The runtime finds the KV to
reuse: that of the session named by a `session_id` body field or an `X-Session-Id` header (created
when new), else that of the resident session whose tokens the prompt extends furthest. So a plain
client resending its growing conversation prefills only the new turn. The session's id comes back
in the `X-Session-Id` header (of a streamed reply too: the runtime names the session before the
first token). Ops go through the engine queue's admission (429 with Retry-After when it is full);
a generation the daemon's shutdown interrupts ends with finish_reason "cancelled".
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from ellmd.runtime.errors import RuntimeError_
from ellmd.runtime.session import unscoped_id
from ellmd.server.http.errors import ApiError, queue_full
from ellmd.server.http.fields import STRING, field
from ellmd.server.http.sse import EventStream
from ellmd.server.limits import Admission, Limits, QueueFull


def model_name(path: Path) -> str:
    """The model's id in the API: its directory name, or its file name without .gguf."""
    return path.stem if path.suffix == ".gguf" else path.name


def session_arg(request: web.Request, body: dict) -> dict:
    """The session the request binds to: a `session_id` field, else an `X-Session-Id` header; and
    with API keys, the owner whose sessions it may reach."""
    session_id = field(body, "session_id", STRING) or request.headers.get("X-Session-Id")
    owner = {"owner": request["owner"]} if "owner" in request else {}
    return {"session_id": session_id, **owner} if session_id else owner


def known_as(result: dict, owner: str | None) -> dict:
    """An op's result with its session named as the caller's key knows it (runtime.session.unscoped_id)."""
    if owner is None or not isinstance(result, dict) or "session_id" not in result:
        return result
    return {**result, "session_id": unscoped_id(result["session_id"], owner)}


class Bridge:
    """The runtime as the APIs see it: the model they serve, and ops run through the engine queue."""

    def __init__(self, runtime, limits: Limits, admission: Admission):
        self.runtime, self.limits, self.admission = runtime, limits, admission
        engine = runtime.engine
        self.tokenizer, self.template = engine.tokenizer, engine.chat_template
        self.context = engine.kv.sequence_length
        self.model = model_name(engine.model_path)
        self.fingerprint = f"ellm-{runtime.fingerprint['model']}"
        stops = set(engine.spec.eos_token_id) | (self.tokenizer.eos_token_ids if self.tokenizer else set())
        # added tokens other than end-of-sequence ones, for the grammar of strict tools
        self.added_tokens = {token.content: i for i, token in self.tokenizer.backend.get_added_tokens_decoder().items()
                             if i not in stops} if self.tokenizer else {}
        self.closing = False

    async def generate(self, args: dict, on_text=None, on_session=None, op: str = "completion") -> dict:
        """Run one generating op (`completion`, or `session.continue`); `on_text(piece)` is awaited
        for each piece of text as it comes, `on_session(session_id)` called once the runtime has
        chosen the session (before any text)."""
        if self.closing:
            raise ApiError(503, "the daemon is shutting down", "server_error")
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()

        def emit(event, data):  # on the engine thread
            if event in ("token", "session"):
                loop.call_soon_threadsafe(pieces.put_nowait, (event, data))

        try:
            job = self.admission.submit(op, {**args, "stream": on_text is not None}, emit)
        except QueueFull as e:
            raise queue_full(e) from None
        # The future resolves after the last token event was emitted: the end marker queues behind it.
        job.future.add_done_callback(lambda _: loop.call_soon_threadsafe(pieces.put_nowait, None))
        try:
            while (piece := await pieces.get()) is not None:
                event, data = piece
                if event == "token":
                    await on_text(data["text"])
                elif on_session:
                    on_session(unscoped_id(data["session_id"], args.get("owner")))
        finally:
            if not job.future.done():  # the client went away: stop at the next token
                job.cancelled.set()
        try:
            return known_as(job.future.result(), args.get("owner"))
        except RuntimeError_ as e:
            raise ApiError.from_runtime(e) from None

    async def stream(self, stream: EventStream, args: dict, on_text, op: str = "completion") -> dict | None:
        """generate() for a streamed reply; None when it ended early (error sent as an event, or client gone)."""
        try:
            return await self.generate(args, on_text, stream.bind_session, op)
        except ApiError as e:
            if stream.response is None:
                raise  # nothing sent yet: a plain error reply
            await stream.fail(e)
        except ConnectionError:
            pass
        return None

    async def call(self, op: str, args: dict):
        """Run one op that does not generate; its result (a runtime error as an ApiError)."""
        try:
            job = self.admission.submit(op, args)
        except QueueFull as e:
            raise queue_full(e) from None
        try:  # shield: a client that disconnects must not cancel the engine thread's future under it
            return known_as(await asyncio.shield(asyncio.wrap_future(job.future)), args.get("owner"))
        except RuntimeError_ as e:
            raise ApiError.from_runtime(e) from None

    async def in_thread(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(None, function, *args)

    def render_chat(self, messages: list[dict], tools, forced: str, extra: dict) -> list[int]:
        text = self.template.render(messages, tools=tools, add_generation_prompt=True, **extra)
        return self.tokenizer.encode(text + forced)
