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

from ellmd.runtime.errors import ProtocolError
from ellmd.runtime.session import unscoped_id
from ellmd.server.http.errors import ApiError, queue_full
from ellmd.server.http.fields import STRING, field, read_json
from ellmd.server.http.sse import EventStream
from ellmd.server.limits import Admission, Limits, QueueFull


def model_name(path: Path) -> str:
    """The model's id in the API: its directory name, or its file name without .gguf."""
    return path.stem if path.suffix == ".gguf" else path.name


def owner_arg(request: web.Request) -> dict:
    """With API keys, the owner whose sessions the request may reach (Guard sets it)."""
    return {"owner": request["owner"]} if "owner" in request else {}


def session_arg(request: web.Request, body: dict) -> dict:
    """The session the request binds to: a `session_id` field, else an `X-Session-Id` header; and
    its owner_arg."""
    session_id = field(body, "session_id", STRING) or request.headers.get("X-Session-Id")
    return {"session_id": session_id, **owner_arg(request)} if session_id else owner_arg(request)


def known_as(result: dict, owner: str | None) -> dict:
    """An op's result with its session named as the caller's key knows it (runtime.session.unscoped_id)."""
    if owner is None or not isinstance(result, dict) or "session_id" not in result:
        return result
    return {**result, "session_id": unscoped_id(result["session_id"], owner)}


def session_reply(body: dict, session_id: str) -> web.Response:
    """A whole JSON reply, naming its session in the X-Session-Id header."""
    return web.json_response(body, headers={"X-Session-Id": session_id})


class Bridge:
    """The runtime as the APIs see it: the model they serve, rendering off the event loop, and ops run
    through the engine queue's admission."""

    def __init__(self, runtime, limits: Limits, admission: Admission):
        self.runtime, self.admission = runtime, admission
        self.read_timeout = limits.http_read_timeout_s
        engine = runtime.engine
        self.tokenizer, self.template = engine.tokenizer, engine.chat_template
        self.tool_format = runtime.tool_format
        self.context = engine.kv.sequence_length
        self.model = model_name(engine.model_path)
        self.fingerprint = f"ellm-{runtime.fingerprint['model']}"
        stops = set(engine.spec.eos_token_id) | (self.tokenizer.eos_token_ids if self.tokenizer else set())
        # added tokens other than end-of-sequence ones, for the grammar of strict tools
        self.added_tokens = {token.content: i for i, token in self.tokenizer.backend.get_added_tokens_decoder().items()
                             if i not in stops} if self.tokenizer else {}
        self.closing = False

    async def body(self, request: web.Request) -> dict:
        return await read_json(request, self.read_timeout)

    def model_of(self, body: dict) -> str:
        """The model a reply names: the request's, else the one served."""
        return body["model"] if isinstance(body.get("model"), str) else self.model

    def check_template(self, hint: str = "") -> None:
        if self.template is None:
            raise ApiError(400, f"this model has no chat template{hint}")

    async def render_chat(self, messages: list[dict], tools: list | None, forced: str = "",
                          extra: dict | None = None) -> list[int]:
        """The prompt's tokens: the conversation rendered, then `forced` (the reply's opening)."""
        def render() -> list[int]:
            text = self.template.render(messages, tools=tools, add_generation_prompt=True, **(extra or {}))
            return self.tokenizer.encode(text + forced)

        return await self.in_thread(render)

    async def encode(self, text: str) -> list[int]:
        return await self.in_thread(lambda: self.tokenizer.encode(text, add_special_tokens=True))

    async def in_thread(self, function, *args):
        """function(*args) in a worker thread: rendering and tokenizing a long prompt take a while."""
        return await asyncio.get_running_loop().run_in_executor(None, function, *args)

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

        job = self.submit(op, {**args, "stream": on_text is not None}, emit)
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
        return await self.outcome(job, args)

    async def stream(self, stream: EventStream, args: dict, op: str = "completion") -> dict | None:
        """generate() into a stream (its text through stream.content); None when it ended early (error
        sent as an event, or client gone)."""
        try:
            return await self.generate(args, stream.content, stream.bind_session, op)
        except ApiError as e:
            if stream.response is None:
                raise  # nothing sent yet: a plain error reply
            await stream.fail(e)
        except ConnectionError:
            pass
        return None

    async def call(self, op: str, args: dict):
        """Run one op that does not generate; its result (a runtime error as an ApiError)."""
        return await self.outcome(self.submit(op, args), args)

    def submit(self, op: str, args: dict, emit=None):
        try:
            return self.admission.submit(op, args, emit)
        except QueueFull as e:
            raise queue_full(e) from None

    @staticmethod
    async def outcome(job, args: dict):
        """An op's result, its session named as the caller's key knows it; a runtime error as an ApiError."""
        try:  # shield: a client that disconnects must not cancel the engine thread's future under it
            result = await asyncio.shield(asyncio.wrap_future(job.future))
        except ProtocolError as e:
            raise ApiError.from_runtime(e) from None
        return known_as(result, args.get("owner"))
