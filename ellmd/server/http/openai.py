"""The OpenAI API: `GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions`
(streamed as server-sent events with `stream: true`).

`usage.prompt_tokens_details.cached_tokens` counts the prompt tokens whose KV was reused; the
session's id comes back in a `session_id` field too. Tool calls (see tools) follow in one
`tool_calls` delta when streamed.

Structured output: `response_format` (json_object, json_schema), tools marked `strict` (a grammar of
the model's call format with each tool's schema, ellmd.text.tool_grammar) and vLLM's `guided_json`,
`guided_regex`, `guided_grammar` and `guided_choice` become the runtime's `json_schema` or
`grammar` argument, compiled on the runtime's compile thread within its limits (a bad one, or one
beyond a limit, is a 400). One per request.

Where ellm differs from OpenAI it answers 400 rather than differ silently: `n` and `best_of` must
be 1; `echo` and `suffix` are not supported; nor are content parts other than text. Defaults
are OpenAI's (temperature 1, max_tokens up to the end of the context); vLLM's extra sampling
fields `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids` and `ignore_eos` are accepted, and
`speculative` (bool) and vLLM's `num_speculative_tokens` (the longest draft; 0: none) for drafts;
unknown fields are ignored.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid

from aiohttp import web

from ellmd.server.http.bridge import Bridge, session_arg, session_reply
from ellmd.server.http.errors import ApiError
from ellmd.server.http.fields import ARRAY, BOOL, INT, OBJECT, STRING, content_text, field, require_one, sampling_args
from ellmd.server.http.sse import EventStream
from ellmd.server.http.tools import ToolUse, chat_tools
from ellmd.text.tool_grammar import is_strict, tool_call_grammar

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")  # vLLM's, for constraints


def chat_messages(body: dict) -> list[dict]:
    """The conversation, checked, with text content parts joined and `developer` read as `system`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty array", param="messages")
    result = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"{where} must be an object with a string role", param=where)
        content = message.get("content")
        if isinstance(content, list):
            content = content_text(content, f"{where}.content")
        elif content is not None and not isinstance(content, str):
            raise ApiError(400, f"{where}.content must be a string or an array of content parts", param=where)
        role = "system" if message["role"] == "developer" else message["role"]  # templates know only system
        result.append({**message, "role": role, "content": content})
    return result


def response_format_schema(body: dict) -> dict | None:
    """The JSON Schema a chat's `response_format` asks for (None: plain text)."""
    spec = field(body, "response_format", OBJECT)
    kind = (spec or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise ApiError(400, "response_format.type must be text, json_object or json_schema", param="response_format")
    inner = spec.get("json_schema")
    schema = inner.get("schema", {"type": "object"}) if isinstance(inner, dict) else None
    if not isinstance(schema, dict):
        raise ApiError(400, 'response_format must be {"type": "json_schema", "json_schema": {"name": ..., '
                            '"schema": {...}}}', param="response_format")
    return schema


def guided_args(body: dict) -> dict:
    """The runtime's constraint from vLLM's extension fields: guided_json (a schema, or its text),
    guided_regex, guided_grammar (Lark or GBNF) and guided_choice (one of some strings)."""
    given = [name for name in GUIDED_FIELDS if body.get(name) is not None]
    if len(given) > 1:
        raise ApiError(400, f"take one of {', '.join(GUIDED_FIELDS)}, not {' and '.join(given)}")
    found = {}
    if (schema := body.get("guided_json")) is not None:
        try:
            found["json_schema"] = json.loads(schema) if isinstance(schema, str) else schema
        except ValueError:
            raise ApiError(400, "guided_json must be a JSON Schema (an object or its JSON text)",
                           param="guided_json") from None
    for name, kind in (("guided_regex", "regex"), ("guided_grammar", "grammar")):
        if (value := field(body, name, STRING)) is not None:
            found[kind] = value
    if (choices := field(body, "guided_choice", ARRAY)) is not None:
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ApiError(400, "guided_choice must be a non-empty array of strings", param="guided_choice")
        found["grammar"] = "start: " + " | ".join(json.dumps(c) for c in choices)
    return found


def constraint_args(body: dict, use: ToolUse, added: dict) -> dict:
    """A chat's constraint: response_format, a guided_* field, or the grammar of strict tools."""
    schema = response_format_schema(body)
    found = [args for args in (guided_args(body), {} if schema is None else {"json_schema": schema}) if args]
    if use.tools and any(is_strict(tool) for tool in use.tools):
        if use.fmt is None:
            raise ApiError(400, "strict tools: this model's chat template has no tool-call format", param="tools")
        found.append({"grammar": tool_call_grammar(use.fmt, use.tools, use.choice, added)})
    if len(found) > 1:
        raise ApiError(400, "take one constraint: response_format, a guided_* field or strict tools")
    return found[0] if found else {}


def template_kwargs(body: dict) -> dict:
    """`chat_template_kwargs`: extra variables for the template, which cannot replace the conversation."""
    extra = field(body, "chat_template_kwargs", OBJECT, {})
    if extra.keys() & {"messages", "tools", "add_generation_prompt"}:
        raise ApiError(400, "chat_template_kwargs cannot set messages, tools or add_generation_prompt",
                       param="chat_template_kwargs")
    return extra


def logprobs_arg(top: int | None) -> dict:
    """The runtime reports the chosen token among its top n: at least 1."""
    return {} if top is None else {"logprobs": max(top, 1)}


def openai_usage(usage: dict) -> dict:
    prompt, completion = usage["prompt_tokens"], usage["generated_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": usage["reused_tokens"]}}


def include_usage(body: dict) -> bool:
    return bool((field(body, "stream_options", OBJECT) or {}).get("include_usage"))


def usage_chunk(head: dict, result: dict) -> dict:
    """The last chunk of a stream that asked to include usage."""
    return {**head, "choices": [], "usage": openai_usage(result["usage"]), "session_id": result["session_id"]}


def chat_logprobs(tokenizer, entries: list[dict], top: int) -> dict:
    def item(token: int, logprob: float) -> dict:
        return {"token": tokenizer.decode([token]), "logprob": logprob, "bytes": list(tokenizer.token_bytes(token))}

    return {"content": [{**item(e["token"], e["logprob"]), "top_logprobs": [item(*t) for t in e["top"][:top]]}
                        for e in entries]}


def completion_logprobs(tokenizer, entries: list[dict], top: int) -> dict:
    tokens = [tokenizer.decode([e["token"]]) for e in entries]
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in e["top"][:top]} for e in entries],
            "text_offset": list(itertools.accumulate((len(t) for t in tokens), initial=0))[:-1]}


class OpenAiApi:
    """The handlers of the OpenAI API, over a Bridge."""

    def __init__(self, bridge: Bridge):
        self.bridge = bridge

    def head(self, body: dict, kind: str, prefix: str) -> dict:
        """The fields every response object (or chunk) of a request starts with."""
        return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()),
                "model": self.bridge.model_of(body), "system_fingerprint": self.bridge.fingerprint}

    async def models(self, request: web.Request) -> web.Response:
        bridge = self.bridge
        return web.json_response({"object": "list", "data": [{
            "id": bridge.model, "object": "model", "created": int(bridge.runtime.started), "owned_by": "ellm",
            "max_model_len": bridge.context}]})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        bridge = self.bridge
        body = await bridge.body(request)
        bridge.check_template(": use /v1/completions")
        require_one(body, "n")
        messages = chat_messages(body)
        use = chat_tools(body, bridge.tool_format)
        constraint = constraint_args(body, use, bridge.added_tokens)
        tokens = await bridge.render_chat(messages, use.tools, use.forced, template_kwargs(body))
        args = {"tokens": tokens, "messages": messages, "tools": use.tools, **constraint,
                **sampling_args(body, bridge.context - len(tokens)), **session_arg(request, body)}
        top = field(body, "top_logprobs", INT, 0) if field(body, "logprobs", BOOL) else None
        args.update(logprobs_arg(top))
        chat = Chat(bridge, self.head(body, "chat.completion", "chatcmpl"), use, top)
        if field(body, "stream", BOOL):
            return await chat.stream(request, args, include_usage(body))
        return await chat.reply(args)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        bridge = self.bridge
        body = await bridge.body(request)
        require_one(body, "n", "best_of")
        for name in ("echo", "suffix"):
            if body.get(name):
                raise ApiError(400, f"{name} is not supported", param=name)
        tokens = await self.prompt_tokens(body.get("prompt"))
        args = {"tokens": tokens, **guided_args(body), **sampling_args(body, bridge.context - len(tokens)),
                **session_arg(request, body)}
        top = field(body, "logprobs", INT)
        args.update(logprobs_arg(top))
        completion = Completion(bridge, self.head(body, "text_completion", "cmpl"), top)
        if field(body, "stream", BOOL):
            return await completion.stream(request, args, include_usage(body))
        return await completion.reply(args)

    async def prompt_tokens(self, prompt) -> list[int]:
        """A completion prompt: a string, token ids, or an array holding one of them (no batches)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            tokens = await self.bridge.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            tokens = prompt
        else:
            raise ApiError(400, "prompt must be a string or an array of token ids (one prompt per request)",
                           param="prompt")
        if not tokens:
            raise ApiError(400, "prompt is empty", param="prompt")
        return tokens


class Chat:
    """One chat completion's reply, whole or streamed: tool calls parsed, markup held back."""

    def __init__(self, bridge: Bridge, head: dict, use: ToolUse, top: int | None):
        self.bridge, self.head, self.use, self.top = bridge, head, use, top

    def logprobs(self, result: dict) -> dict | None:
        return chat_logprobs(self.bridge.tokenizer, result["logprobs"], self.top) if self.top is not None else None

    async def reply(self, args: dict) -> web.Response:
        result = await self.bridge.generate(args)
        content, calls = self.use.parse(result["text"])
        message = {"role": "assistant", "content": (content or None) if calls else content}
        if calls:
            message["tool_calls"] = calls
        choice = {"index": 0, "message": message, "logprobs": self.logprobs(result),
                  "finish_reason": "tool_calls" if calls else result["finish_reason"]}
        return session_reply({**self.head, "choices": [choice], "usage": openai_usage(result["usage"]),
                              "session_id": result["session_id"]}, result["session_id"])

    def chunk(self, delta: dict, finish=None, logprobs=None) -> dict:
        return {**self.head, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    async def stream(self, request: web.Request, args: dict, with_usage: bool) -> web.StreamResponse:
        stream = EventStream(request, self.chunk({"role": "assistant", "content": ""}),
                             chunk=lambda text: self.chunk({"content": text}), holdback=self.use.holdback())
        result = await self.bridge.stream(stream, args)
        if result is None:
            return stream.response
        content, calls = self.use.parse(result["text"])
        await stream.rest(content)
        if calls:
            await stream.send(self.chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}))
        finish = "tool_calls" if calls else result["finish_reason"]
        await stream.send({**self.chunk({}, finish, self.logprobs(result)), "session_id": result["session_id"]})
        if with_usage:
            await stream.send(usage_chunk({**self.head, "object": "chat.completion.chunk"}, result))
        return await stream.finish()


class Completion:
    """One completion's reply, whole or streamed."""

    def __init__(self, bridge: Bridge, head: dict, top: int | None):
        self.bridge, self.head, self.top = bridge, head, top

    def choice(self, text: str, finish=None, result=None) -> dict:
        logprobs = None
        if result and self.top is not None:
            logprobs = completion_logprobs(self.bridge.tokenizer, result["logprobs"], self.top)
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    async def reply(self, args: dict) -> web.Response:
        result = await self.bridge.generate(args)
        return session_reply({**self.head, "choices": [self.choice(result["text"], result["finish_reason"], result)],
                              "usage": openai_usage(result["usage"]), "session_id": result["session_id"]},
                             result["session_id"])

    async def stream(self, request: web.Request, args: dict, with_usage: bool) -> web.StreamResponse:
        stream = EventStream(request, chunk=lambda text: {**self.head, "choices": [self.choice(text)]})
        result = await self.bridge.stream(stream, args)
        if result is None:
            return stream.response
        await stream.send({**self.head, "choices": [self.choice("", result["finish_reason"], result)],
                           "session_id": result["session_id"]})
        if with_usage:
            await stream.send(usage_chunk(self.head, result))
        return await stream.finish()
