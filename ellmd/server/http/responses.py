"""The OpenAI Responses API: `POST /v1/responses` (the OpenAI Agents SDK, Codex-style tools), and
`GET` / `DELETE /v1/responses/{id}` of a stored response.

`input` (a string, or items: messages with input_text content, function_call and
function_call_output items) and `instructions` become chat messages, rendered as a chat
completion is; `tools` are function tools in the Responses shape (`{"type": "function", "name",
"parameters"}`), tool calls come back as function_call items.

`store` (default true) keeps the conversation in a session (tagged `responses`: a later request
whose input extends it, resent whole, goes on in it), and the response's id names the point it
reached: `resp_<turn>_<session>`, where `turn` is the name of the generation turn the reply
logged. `previous_response_id` continues from that point with the `session.continue` op: only the
new input is rendered (as a fragment after what the session holds) and prefilled, also after a
daemon restart (the session's KV comes back from the store). A point earlier than its session's
end (a conversation continued twice from one response) continues in a branch whose KV is copied,
so the later turns stay as they were. With `previous_response_id` the session keeps the
instructions it was started with (they are in its KV); new ones are ignored. `store: false` runs
the prompt as a chat completion does (reusing the KV of the resident conversation it extends) and
gives an id that cannot be continued. A stored response is kept with its turn (session.point's
note), so that GET gives it again, also after a restart; DELETE forgets the point.

Streaming sends the Responses events: response.created, response.in_progress, then per output item
response.output_item.added, (response.content_part.added, response.output_text.delta...,
response.output_text.done, response.content_part.done) or (response.function_call_arguments.delta,
response.function_call_arguments.done), response.output_item.done, and response.completed (or
response.incomplete at max_output_tokens); an error after the stream began is an `error` event.

Not supported, with a clear 400: built-in tools (web search, file search, ...), input images and
files.
"""

from __future__ import annotations

import logging
import time
import uuid

from aiohttp import web

from ellmd.server.http.bridge import Bridge, owner_arg, session_reply
from ellmd.server.http.errors import ApiError
from ellmd.server.http.fields import (ARRAY, BOOL, OBJECT, SAMPLING_FIELDS, STRING, content_text, field, format_args,
                                      sampling_args, token_count)
from ellmd.server.http.sse import NamedEventStream
from ellmd.server.http.tools import ToolUse, chat_tools

log = logging.getLogger("ellmd.http")

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
TURN_NAME = 16  # hex digits of a response's turn name
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512  # OpenAI's bounds on `metadata`
ECHOED_CHARS = 512  # the longest `user` or `model` a response gives back (and keeps)
STORED_TAG = "responses"  # of the sessions holding stored responses (never cut back, unlike anonymous ones)


def point_of(response_id: str) -> tuple[str, str] | None:
    """(session id, turn name) of a stored response's id, else None."""
    turn, sep, session_id = response_id.removeprefix("resp_").partition("_")
    if not response_id.startswith("resp_") or not sep or len(turn) != TURN_NAME or not session_id:
        return None
    return session_id, turn


def input_messages(body: dict) -> list[dict]:
    """`input` as chat messages; consecutive function_call items join one assistant message."""
    items = body.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "input must be a string or a non-empty array of items", param="input")
    messages = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ROLES:
            content = content_text(item.get("content"), f"{where}.content", TEXT_PARTS)
            messages.append({"role": ROLES[item["role"]], "content": content})
        elif kind == "function_call" and isinstance(item.get("name"), str):
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": item["name"], "arguments": str(item.get("arguments", "{}"))}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                             "content": content_text(item.get("output", ""), f"{where}.output", TEXT_PARTS)})
        elif kind != "reasoning":  # the model's reasoning as a client sends it back: not rendered
            raise ApiError(400, f"{where}: expected a message, function_call or function_call_output item",
                           param="input")
    return messages


def check_echoed(body: dict) -> None:
    """The fields a response gives back as sent (and keeps with a stored one) are bounded: `metadata`
    as OpenAI bounds it (16 pairs, keys of 64 characters, string values of 512), `user` and `model`."""
    metadata = field(body, "metadata", OBJECT) or {}
    if len(metadata) > METADATA_PAIRS:
        raise ApiError(400, f"metadata holds {len(metadata)} pairs: at most {METADATA_PAIRS}", param="metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY:
            raise ApiError(400, f"metadata keys are at most {METADATA_KEY} characters: {key[:20]!r}... holds "
                                f"{len(key)}", param="metadata")
        if not isinstance(value, str) or len(value) > METADATA_VALUE:
            raise ApiError(400, f"metadata[{key!r}] must be a string of at most {METADATA_VALUE} characters",
                           param="metadata")
    for name in ("user", "model"):
        if len(field(body, name, STRING) or "") > ECHOED_CHARS:
            raise ApiError(400, f"{name} is at most {ECHOED_CHARS} characters", param=name)


def chat_tool_args(body: dict) -> dict:
    """`tools` and `tool_choice` in the chat completions' shape (for tools.chat_tools)."""
    tools = []
    for i, tool in enumerate(field(body, "tools", ARRAY) or ()):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ApiError(400, f'tools[{i}]: only function tools are supported ({{"type": "function", "name": ...}}), '
                                f"not {kind!r}", param=f"tools[{i}]")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        tools.append({"type": "function", "function": function})
    choice = body.get("tool_choice") or "auto"
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                           param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return {"tools": tools or None, "tool_choice": choice}


def usage(usage: dict) -> dict:
    prompt, output = usage["prompt_tokens"], usage["generated_tokens"]
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": usage["reused_tokens"]},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


def continued(previous: str, messages: list[dict], use: ToolUse, sampling: dict, context: int) -> dict:
    """The `session.continue` op's arguments: the new input after a stored response's point."""
    point = point_of(previous)
    if point is None:
        raise ApiError(404, f"previous response {previous!r} not found (a response stored with store: true "
                            "names its conversation)", param="previous_response_id")
    return {"session_id": point[0], "after": point[1], "messages": messages, "tools": use.tools,
            "forced": use.forced, **sampling_args(sampling, context)}


class ResponsesApi:
    """The handler of /v1/responses, over a Bridge."""

    def __init__(self, bridge: Bridge):
        self.bridge = bridge

    async def create(self, request: web.Request) -> web.StreamResponse:
        bridge = self.bridge
        body = await bridge.body(request)
        bridge.check_template()
        check_echoed(body)
        constraint = format_args((field(body, "text", OBJECT) or {}).get("format") or {}, "text.format")
        messages = input_messages(body)
        use = chat_tools(chat_tool_args(body), bridge.tool_format)
        turn = uuid.uuid4().hex[:TURN_NAME]
        store = field(body, "store", BOOL, True)
        previous = field(body, "previous_response_id", STRING)
        sampling = {**{k: body.get(k) for k in SAMPLING_FIELDS}, "max_tokens": token_count(body, "max_output_tokens")}
        owner = owner_arg(request)
        if previous is not None:
            op, args = "session.continue", continued(previous, messages, use, sampling, bridge.context)
        else:
            op, args = "completion", await self.started(body, messages, use, sampling, store)
        args = {**args, **constraint, "name": turn, **owner}
        reply = Reply(bridge, body, turn if store else None, use, owner)
        try:
            if field(body, "stream", BOOL):
                return await reply.stream(request, op, args)
            return await reply.whole(op, args)
        except ApiError as e:
            if previous is not None and e.status == 404:
                raise ApiError(404, f"previous response {previous!r} not found: {e}",
                               param="previous_response_id") from None
            raise

    async def started(self, body: dict, messages: list[dict], use: ToolUse, sampling: dict, store: bool) -> dict:
        """The `completion` op's arguments of a conversation that continues no stored response."""
        if isinstance(body.get("instructions"), str):
            messages.insert(0, {"role": "system", "content": body["instructions"]})
        tokens = await self.bridge.render_chat(messages, use.tools, use.forced)
        args = {"tokens": tokens, "messages": messages, "tools": use.tools,
                **sampling_args(sampling, self.bridge.context - len(tokens))}
        return {**args, "tag": STORED_TAG} if store else args

    async def retrieve(self, request: web.Request) -> web.Response:
        """GET: a stored response as its POST gave it, kept with its turn (see Reply.keep)."""
        response_id = request.match_info["response_id"]
        kept = await self.point(request, response_id)
        if "note" not in kept["turn"]:  # a point whose response was not kept
            raise self.missing(response_id)
        tools = [{"type": "function", **tool["function"]} for tool in kept["tools"] or ()]
        response = {"id": response_id, "instructions": kept["system"], "tools": tools, **kept["turn"]["note"]}
        return session_reply(response, kept["session_id"])

    async def delete(self, request: web.Request) -> web.Response:
        """DELETE: forget a stored response (its point can no longer be retrieved or continued; the
        conversation, and the responses before and after it, stay)."""
        response_id = request.match_info["response_id"]
        await self.point(request, response_id, forget=True)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    @staticmethod
    def missing(response_id: str) -> ApiError:
        return ApiError(404, f"response {response_id!r} not found (a response stored with store: true is kept "
                             "until it is deleted or its conversation rewound or deleted)", param="response_id")

    async def point(self, request: web.Request, response_id: str, forget: bool = False) -> dict:
        """session.point's result for a response's id (the point forgotten with `forget`), else a 404."""
        point = point_of(response_id)
        if point is None:
            raise self.missing(response_id)
        try:
            kept = await self.bridge.call("session.point", {"session_id": point[0], "name": point[1],
                                                            **owner_arg(request),
                                                            **({"forget": True} if forget else {})})
        except ApiError as e:
            if e.status == 404:
                raise self.missing(response_id) from None
            raise
        return kept


class Reply:
    """One response, whole or as the Responses events."""

    def __init__(self, bridge: Bridge, body: dict, turn: str | None, use: ToolUse, owner: dict):
        self.bridge, self.body, self.turn, self.use, self.owner = bridge, body, turn, use, owner
        self.created = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex[:24]}"
        self.unstored_id = f"resp_{uuid.uuid4().hex[:TURN_NAME]}"

    def id(self, session_id: str) -> str:
        """The response's id: its point when stored (see point_of), else a name that continues nothing."""
        return f"resp_{self.turn}_{session_id}" if self.turn else self.unstored_id

    def response(self, response_id: str, status: str, output: list, usage_: dict | None = None,
                 incomplete: str | None = None) -> dict:
        body = self.body
        return {
            "id": response_id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": self.bridge.model_of(body),
            "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
            "store": bool(self.turn), "temperature": body.get("temperature", 1.0), "text": {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0), "truncation": "disabled", "usage": usage_,
            "metadata": body.get("metadata") or {}, "user": body.get("user"),
        }

    def output(self, result: dict) -> list[dict]:
        """The output items of a finished generation: its text as a message, its tool calls."""
        content, calls = self.use.parse(result["text"])
        items = [self.message(content, "completed")] if content or not calls else []
        return items + [self.call(call, "completed") for call in calls]

    def message(self, text: str | None, status: str) -> dict:
        parts = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": parts}

    def call(self, call: dict, status: str, arguments: str | None = None) -> dict:
        function = call["function"]
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": function["name"], "arguments": function["arguments"] if arguments is None else arguments,
                "status": status}

    def finished(self, result: dict) -> dict:
        """The response object of a finished generation."""
        status, incomplete = {"length": ("incomplete", "max_output_tokens"),
                              "cancelled": ("cancelled", None)}.get(result["finish_reason"], ("completed", None))
        return self.response(self.id(result["session_id"]), status, self.output(result), usage(result["usage"]),
                             incomplete)

    async def keep(self, final: dict, session_id: str) -> None:
        """Keep a stored response with its turn, for GET /v1/responses/{id}: all of it but its id
        (its point) and the request's instructions and tools where it gave some (the session holds
        them: its system prompt, its tools; an agent resends the same ones with every request)."""
        if not self.turn:
            return
        note = {k: v for k, v in final.items() if k != "id" and not (k in ("instructions", "tools") and v)}
        try:
            await self.bridge.call("session.point", {"session_id": session_id, "name": self.turn, "note": note,
                                                    **self.owner})
        except ApiError as e:  # the response stands; only GET will not find it
            log.warning("response %s could not be kept: %s", final["id"], e)

    async def whole(self, op: str, args: dict) -> web.Response:
        result = await self.bridge.generate(args, op=op)
        final = self.finished(result)
        await self.keep(final, result["session_id"])
        return session_reply(final, result["session_id"])

    async def stream(self, request: web.Request, op: str, args: dict) -> web.StreamResponse:
        stream = ResponseStream(request, self)
        result = await self.bridge.stream(stream, args, op)
        if result is None:
            return stream.response
        final = self.finished(result)
        items = final["output"]
        message = items[0] if items and items[0]["type"] == "message" else None
        if message is None and stream.text_open:  # text went out before the calls: it stays an item
            message = self.message(stream.streamed, "completed")
            items.insert(0, message)
        await stream.rest(message["content"][0]["text"] if message else "")
        await stream.end_message(message)
        for item in items:
            if item["type"] == "function_call":
                await stream.call(item)
        await self.keep(final, result["session_id"])
        kind = {"incomplete": "response.incomplete"}.get(final["status"], "response.completed")
        await stream.event(kind, {"response": final})
        return await stream.finish()


class ResponseStream(NamedEventStream):
    """The Responses API's server-sent events: numbered, opened by response.created and
    response.in_progress."""

    def __init__(self, request: web.Request, reply: Reply):
        super().__init__(request, reply.use.holdback())
        self.reply = reply
        self.sequence = 0
        self.streamed = ""  # the message's text sent so far

    async def started(self) -> None:
        self.response_id = self.reply.id(self.headers.get("X-Session-Id", ""))
        start = self.reply.response(self.response_id, "in_progress", [])
        await self.event("response.created", {"response": start})
        await self.event("response.in_progress", {"response": start})

    def payload(self, kind: str, data: dict) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **data}

    def at(self, item_id: str) -> dict:
        return {"item_id": item_id, "output_index": self.index}

    async def text_started(self) -> None:
        reply = self.reply
        await self.event("response.output_item.added",
                         {"output_index": self.index, "item": reply.message(None, "in_progress")})
        await self.event("response.content_part.added", {**self.at(reply.message_id), "content_index": 0,
                         "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})

    async def text_delta(self, text: str) -> None:
        self.streamed += text
        await self.event("response.output_text.delta",
                         {**self.at(self.reply.message_id), "content_index": 0, "delta": text, "logprobs": []})

    async def end_message(self, message: dict | None) -> None:
        if not self.text_open:
            return
        part, at = message["content"][0], {**self.at(self.reply.message_id), "content_index": 0}
        await self.end_block(("response.output_text.done", {**at, "text": part["text"], "logprobs": []}),
                             ("response.content_part.done", {**at, "part": part}),
                             ("response.output_item.done", {"output_index": self.index, "item": message}))

    async def call(self, item: dict) -> None:
        """A whole function_call item: added, its arguments in one delta, done."""
        at = self.at(item["id"])
        await self.end_block(
            ("response.output_item.added", {"output_index": self.index,
                                            "item": {**item, "arguments": "", "status": "in_progress"}}),
            ("response.function_call_arguments.delta", {**at, "delta": item["arguments"]}),
            ("response.function_call_arguments.done", {**at, "name": item["name"], "arguments": item["arguments"]}),
            ("response.output_item.done", {"output_index": self.index, "item": item}))

    def error_data(self, error: ApiError) -> dict:
        return {"code": error.code or error.type, "message": str(error), "param": error.param}
