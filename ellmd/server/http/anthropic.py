"""The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens` (the
anthropic SDK, Claude Code).

A request becomes chat messages (`system` first, `tool_use` blocks as the assistant's tool calls,
`tool_result` blocks as tool messages), rendered and run as a chat completion is: one `completion`
op, which reuses the KV of the resident session the prompt extends. Usage counts as Anthropic
counts: `cache_read_input_tokens` the reused prompt tokens, `input_tokens` the rest.

A streamed reply is Anthropic's events: message_start, then per content block content_block_start,
content_block_delta (text_delta, or input_json_delta for a tool_use block) and content_block_stop,
then message_delta (stop_reason, usage) and message_stop. Tool calls are parsed from the model's
own format; the markup never reaches a text block. Errors take Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`, see error_body), also mid-stream (an
`error` event). A final assistant message is a prefill: the reply continues it.

Not supported, with a clear 400: image and document blocks, server tools (web search, code
execution: tools without an input_schema).
"""

from __future__ import annotations

import json
import uuid

from aiohttp import web

from ellmd.server.http.bridge import Bridge, session_arg, session_reply
from ellmd.server.http.errors import ApiError
from ellmd.server.http.fields import ARRAY, BOOL, OBJECT, content_text, field, format_args, sampling_args
from ellmd.server.http.sse import NamedEventStream
from ellmd.server.http.tools import ToolUse, chat_tools

# tool_choice type -> the chat completions' tool_choice
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
STOP_REASONS = {"length": "max_tokens"}  # else end_turn (or tool_use, stop_sequence: see stop_reason)
# HTTP status -> Anthropic error type; others are invalid_request_error below 500, else api_error
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error"}


def error_body(error: ApiError) -> dict:
    """An error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": str(error)}}


def assistant_message(content, where: str) -> dict:
    """An assistant turn: its text blocks, and its tool_use blocks as tool calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, calls = [], []
    for i, block in enumerate(content if isinstance(content, list) else [None]):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and isinstance(block.get("name"), str) and isinstance(block.get("input"), dict):
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        elif kind not in ("thinking", "redacted_thinking"):  # the model's own reasoning: not rendered back
            raise ApiError(400, f"{where}.content[{i}]: expected a text or tool_use block")
    message = {"role": "assistant", "content": "\n".join(texts)}
    return {**message, "tool_calls": calls} if calls else message


def user_messages(content, where: str) -> list[dict]:
    """A user turn: its tool_result blocks as tool messages, then its text as a user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or an array of content blocks")
    results, texts = [], []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            output = content_text(block.get("content") or "", f"{where}.content[{i}].content")
            output = f"Error: {output}" if block.get("is_error") else output
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": output})
        elif kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        else:
            raise ApiError(400, f"{where}.content[{i}]: only text, tool_use and tool_result blocks are supported, "
                                f"not {kind!r}")
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def chat_messages(body: dict) -> list[dict]:
    """The conversation as chat messages: `system`, then each turn's."""
    system = body.get("system")
    result = [{"role": "system", "content": content_text(system, "system")}] if system else []
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: must be a non-empty array")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            result += user_messages(message.get("content"), where)
        elif role == "assistant":
            result.append(assistant_message(message.get("content"), where))
        else:
            raise ApiError(400, f'{where}.role: must be "user" or "assistant"')
    return result


def chat_tool_args(body: dict) -> dict:
    """`tools` and `tool_choice` in the chat completions' shape (for tools.chat_tools)."""
    tools = []
    for i, tool in enumerate(field(body, "tools", ARRAY) or ()):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or \
                not isinstance(tool.get("input_schema"), dict):
            raise ApiError(400, f"tools[{i}]: only client tools are supported: "
                                '{"name": ..., "description": ..., "input_schema": {...}}')
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    choice = field(body, "tool_choice", OBJECT) or {"type": "auto"}
    if choice.get("type") == "tool" and isinstance(choice.get("name"), str):
        chat_choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice.get("type") in TOOL_CHOICES:
        chat_choice = TOOL_CHOICES[choice["type"]]
    else:
        raise ApiError(400, 'tool_choice: expected {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}')
    return {"tools": tools or None, "tool_choice": chat_choice}


def usage(usage: dict) -> dict:
    reused = usage["reused_tokens"]
    return {"input_tokens": usage["prompt_tokens"] - reused, "output_tokens": usage["generated_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": reused}


class MessagesApi:
    """The handlers of /v1/messages, over a Bridge."""

    def __init__(self, bridge: Bridge):
        self.bridge = bridge

    async def prompt(self, body: dict) -> tuple[list[int], list[dict], ToolUse]:
        """The prompt's tokens, the conversation the session keeps, and its tools."""
        bridge = self.bridge
        bridge.check_template()
        messages = chat_messages(body)
        prefill = ""
        if messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
            prefill = messages.pop()["content"]  # the reply continues it
        use = chat_tools(chat_tool_args(body), bridge.tool_format)
        return await bridge.render_chat(messages, use.tools, prefill + use.forced), messages, use

    async def count_tokens(self, request: web.Request) -> web.Response:
        body = await self.bridge.body(request)
        tokens, *_ = await self.prompt(body)
        return web.json_response({"input_tokens": len(tokens)})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        bridge = self.bridge
        body = await bridge.body(request)
        if body.get("max_tokens") is None:
            raise ApiError(400, "max_tokens: Field required")
        constraint = format_args((field(body, "output_config", OBJECT) or {}).get("format") or {},
                                 "output_config.format")
        stops = body.get("stop_sequences")
        if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
            raise ApiError(400, "stop_sequences: must be an array of strings")
        tokens, messages, use = await self.prompt(body)
        sampling = {name: body.get(name) for name in ("temperature", "top_p", "top_k", "max_tokens")}
        args = {"tokens": tokens, "messages": messages, "tools": use.tools,
                **sampling_args({**sampling, "stop": stops}, bridge.context - len(tokens)),
                **session_arg(request, body), **constraint}
        reply = Reply(bridge, bridge.model_of(body), use, stops or [])
        if field(body, "stream", BOOL):
            return await reply.stream(request, args, len(tokens))
        return await reply.whole(args)


class Reply:
    """One message's reply, whole or as Anthropic's events."""

    def __init__(self, bridge: Bridge, model: str, use: ToolUse, stops: list[str]):
        self.bridge, self.model, self.use, self.stops = bridge, model, use, stops
        self.id = f"msg_{uuid.uuid4().hex[:24]}"

    def parse(self, result: dict) -> tuple[list[dict], str, str | None]:
        """The content blocks, stop_reason and stop_sequence of a finished generation."""
        content, calls = self.use.parse(result["text"])
        blocks = [{"type": "text", "text": content}] if content or not calls else []
        blocks += [{"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                    "name": call["function"]["name"], "input": json.loads(call["function"]["arguments"])}
                   for call in calls]
        reason, sequence = self.stop_reason(result)
        return blocks, "tool_use" if calls else reason, sequence

    def stop_reason(self, result: dict) -> tuple[str, str | None]:
        """end_turn, max_tokens or stop_sequence (with the sequence that matched)."""
        if result["finish_reason"] != "stop" or not self.stops:
            return STOP_REASONS.get(result["finish_reason"], "end_turn"), None
        tokenizer = self.bridge.tokenizer
        after = tokenizer.decode(result["token_ids"], skip_special_tokens=True)[len(result["text"]):]
        sequence = next((s for s in self.stops if after.startswith(s)), None)
        return ("stop_sequence", sequence) if sequence is not None else ("end_turn", None)

    def message(self, content: list, reason: str | None, sequence: str | None, usage_: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage_}

    async def whole(self, args: dict) -> web.Response:
        result = await self.bridge.generate(args)
        blocks, reason, sequence = self.parse(result)
        return session_reply(self.message(blocks, reason, sequence, usage(result["usage"])), result["session_id"])

    async def stream(self, request: web.Request, args: dict, prompt_tokens: int) -> web.StreamResponse:
        start = {"type": "message_start", "message": self.message([], None, None, {
            "input_tokens": prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0})}
        stream = MessageStream(request, start, self.use.holdback())
        result = await self.bridge.stream(stream, args)
        if result is None:
            return stream.response
        blocks, reason, sequence = self.parse(result)
        text = blocks[0]["text"] if blocks and blocks[0]["type"] == "text" else ""
        await stream.rest(text)
        await stream.close_block()
        for block in blocks:
            if block["type"] == "tool_use":
                await stream.block({**block, "input": {}}, {"type": "input_json_delta",
                                                            "partial_json": json.dumps(block["input"])})
        await stream.event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                             "usage": usage(result["usage"])})
        await stream.event("message_stop", {})
        return await stream.finish()


class MessageStream(NamedEventStream):
    """Anthropic's server-sent events, opened by message_start."""

    def __init__(self, request: web.Request, start: dict, holdback):
        super().__init__(request, holdback)
        self.start = start

    async def started(self) -> None:
        await self.send(self.start, "message_start")

    async def text_started(self) -> None:
        await self.event("content_block_start", {"index": self.index, "content_block": {"type": "text", "text": ""}})

    async def text_delta(self, text: str) -> None:
        await self.event("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": text}})

    async def close_block(self) -> None:
        if self.text_open:
            await self.end_block(("content_block_stop", {"index": self.index}))

    async def block(self, start: dict, delta: dict) -> None:
        """A whole content block: its start, one delta, its stop."""
        await self.end_block(("content_block_start", {"index": self.index, "content_block": start}),
                             ("content_block_delta", {"index": self.index, "delta": delta}),
                             ("content_block_stop", {"index": self.index}))

    def error_data(self, error: ApiError) -> dict:
        return {"error": error_body(error)["error"]}
