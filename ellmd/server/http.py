"""The OpenAI-compatible HTTP API (aiohttp), served beside the Unix socket by `ellmd start --http`.

Endpoints: `GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions` (streamed as
server-sent events with `stream: true`), `GET /health`, `GET /metrics` (Prometheus text, see
ellmd.server.metrics); OpenAI's Responses API (ellmd.server.responses) and Anthropic's Messages API
(ellmd.server.anthropic) are built on this module's helpers.

A handler renders the conversation with the chat template and tokenizes it (in a worker thread:
both take a while on long prompts; a long text is encoded with the GIL released, so the event loop
goes on), then submits one `completion` op holding the whole prompt. The
runtime finds the KV to reuse: that of the session named by a `session_id` body field or an
`X-Session-Id` header (created when new), else that of the resident session whose tokens the
prompt extends furthest. So a plain OpenAI client resending its growing conversation prefills only
the new turn, and `usage.prompt_tokens_details.cached_tokens` counts the rest. The session's id
comes back in a `session_id` field and in the `X-Session-Id` header (of a streamed reply too: the
runtime names the session before the first token).

Tool calls: `tools` are rendered into the prompt and calls parsed from the reply in the model's own
format (Hermes JSON or Qwen3-Coder XML). `tool_choice` "none" renders without tools and parses
nothing; "required" or a named function appends the opening of a call to the prompt, so that the
model can only complete it. Streaming holds text back from a call's opening marker on, so markup
never reaches `content`; the calls follow in one `tool_calls` delta.

Structured output: `response_format` (json_object, json_schema), tools marked `strict` (a grammar of
the model's call format with each tool's schema, ellmd.text.tool_grammar) and vLLM's `guided_json`,
`guided_regex`, `guided_grammar` and `guided_choice` become the runtime's `json_schema` or
`grammar` argument, compiled on the runtime's compile thread within its limits (a bad one, or one
beyond a limit, is a 400). One per request. A body holding text UTF-8 cannot encode (a lone
surrogate) is a 400 naming the field: the store could never hold it.

Where ellm differs from OpenAI it answers 400 rather than differ silently: `n` and `best_of` must
be 1; `echo` and `suffix` are not supported; nor are content parts other than text. Defaults
are OpenAI's (temperature 1, max_tokens up to the end of the context); vLLM's extra sampling
fields `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids` and `ignore_eos` are accepted, and
`speculative` (bool) and vLLM's `num_speculative_tokens` (the longest draft; 0: none) for drafts;
unknown fields are ignored. A generation the daemon's shutdown interrupts ends with finish_reason
"cancelled".

Security: with API keys set (`--api-key`, ELLMD_API_KEY, `api_key_file`) every endpoint but
/health wants `Authorization: Bearer <key>`, and a session is reachable only with the key that
created it or was granted it (the runtime is given a fingerprint of the key as the session's owner,
and keeps the ids a key names in that key's scope: results name them back as the key knows them,
see known_as); an admin key reaches every session, as the Unix socket does, and alone reads
/metrics. Listening beyond loopback needs a key. On a loopback address the Host header must name
this machine and an Origin, if any, too, so that a web page (DNS rebinding, a cross-site form)
cannot drive the API. Bodies are JSON with a JSON content type. Limits: connections (one more gets
503 with Retry-After and is closed; with keys, per key once authenticated, see CountedSite), body
size, read timeout, and the engine queue (429 with Retry-After when full).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import itertools
import json
import logging
import socket
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from ellmd.errors import CODES, EllmError
from ellmd.runtime.errors import ProtocolError
from ellmd.runtime.schemas import UNSTORABLE, unstorable
from ellmd.runtime.session import unscoped_id
from ellmd.server.limits import Admission, Limits, QueueFull
from ellmd.server.metrics import Metrics
from ellmd.text import TemplateError, parse_tool_calls
from ellmd.text.tool_grammar import is_strict, tool_call_grammar

log = logging.getLogger("ellmd.http")

DEFAULT_HOST = "127.0.0.1"
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
RETRY_AFTER_S = 1  # what a 429 (the engine queue is full) or a 503 (no connection free) asks the client to wait
REFUSAL_LINGER_S = 2.0  # a refused connection is answered once its request head is in, closed by then at the latest

# Both tool-call formats open a call with this marker.
TOOL_CALL_MARKER = "<tool_call>"
NAMED_CALL_OPENINGS = {
    "hermes": lambda name: f'{TOOL_CALL_MARKER}\n{{"name": {json.dumps(name)}, "arguments": ',
    "qwen3_coder": lambda name: f"{TOOL_CALL_MARKER}\n<function={name}>\n",
}

# HTTP status -> Anthropic error type (the Messages API's error bodies); others are "api_error"
ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                    415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_PATHS = "/v1/messages"  # the routes whose errors take Anthropic's shape

# JSON types a request field may have, and how an error message names them
INT = ((int,), "an integer")
NUMBER = ((int, float), "a number")
STRING = ((str,), "a string")
BOOL = ((bool,), "a boolean")
ARRAY = ((list,), "an array")
OBJECT = ((dict,), "an object")

SAMPLING_FIELDS = {
    "temperature": NUMBER, "top_p": NUMBER, "top_k": INT, "min_p": NUMBER, "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER, "repetition_penalty": NUMBER, "seed": INT, "stop_token_ids": ARRAY,
    "ignore_eos": BOOL, "speculative": BOOL,
}
RENAMED_SAMPLING_FIELDS = {"num_speculative_tokens": ("draft_tokens", INT)}  # vLLM's name -> the runtime's

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")  # vLLM's, for constraints


class ApiError(Exception):
    """An error reply in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None, code=None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code
        self.headers = headers or {}

    @classmethod
    def from_runtime(cls, error: ProtocolError) -> ApiError:
        answer = CODES[error.code]  # the one table of error codes, with their HTTP status
        return cls(answer.status, str(error), answer.type, code=answer.api_code)

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """The error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
        kind = ANTHROPIC_ERRORS.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": str(self)}}

    def response(self, anthropic: bool = False) -> web.Response:
        body = self.anthropic_body() if anthropic else self.body()
        return web.json_response(body, status=self.status, headers=self.headers)


def queue_full(error: QueueFull) -> ApiError:
    return ApiError(429, str(error), "rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_keys: list) -> None:
    """Refuse to listen beyond this machine without an API key."""
    if not is_loopback(host) and not api_keys:
        raise EllmError(f"--http {host}: listening beyond loopback needs an API key "
                        "(--api-key, ELLMD_API_KEY or api_key_file)")


def host_name(value: str) -> str:
    """The host of a Host header ("name:port", "[::1]:port")."""
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def listen_address(value: str) -> tuple[str, int]:
    """(host, port) from "HOST:PORT", ":PORT" or "PORT" (host 127.0.0.1), checked to be free to listen on."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or DEFAULT_HOST
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise EllmError(f"--http {value!r}: expected HOST:PORT, :PORT or PORT, with a port from 1 to 65535")
    try:  # fail before loading the model, not after
        family, _, _, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp listens
            probe.bind(address)
    except OSError as e:
        raise EllmError(f"--http {host}:{port}: {e.strerror or e}") from None
    return host, int(port)


def model_name(path: Path) -> str:
    """The model's id in the API: its directory name, or its file name without .gguf."""
    return path.stem if path.suffix == ".gguf" else path.name


def field(body: dict, name: str, kind, default=None):
    """body[name], checked against a JSON type; absent or null gives `default`."""
    value = body.get(name)
    if value is None:
        return default
    types, described = kind
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ApiError(400, f"{name} must be {described}", param=name)
    return value


async def read_json(request: web.Request, timeout: float) -> dict:
    kind = request.content_type
    if kind != "application/json" and not kind.endswith("+json"):
        raise ApiError(415, f"the request body must be JSON, sent as Content-Type: application/json (not {kind})")
    try:
        data = await asyncio.wait_for(request.read(), timeout)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s (http_read_timeout_s)") from None
    try:
        body = json.loads(data)
    except ValueError as e:  # not JSON, or not UTF-8
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    where = unstorable(body)
    if where is not None:
        raise ApiError(400, f"{where}: {UNSTORABLE}", param=where)
    return body


def require_one(body: dict, *names: str) -> None:
    for name in names:
        if field(body, name, INT, 1) != 1:
            raise ApiError(400, f"{name} must be 1: ellm generates one choice per request", param=name)


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


def sampling_args(body: dict, room: int) -> dict:
    """The runtime's sampling arguments from an OpenAI request; `room`: tokens left in the context."""
    args = {"temperature": 1.0}  # OpenAI's default, where the runtime's is greedy
    for name, kind in SAMPLING_FIELDS.items():
        if (value := field(body, name, kind)) is not None:
            args[name] = value
    for name, (arg, kind) in RENAMED_SAMPLING_FIELDS.items():
        if (value := field(body, name, kind)) is not None:
            args[arg] = value
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = field(body, name, INT)
    if max_tokens is not None and max_tokens < 1:  # as OpenAI: no completion of no tokens
        raise ApiError(400, f"{name} must be >= 1, not {max_tokens}", param=name)
    args["max_tokens"] = max(room, 1) if max_tokens is None else max_tokens  # no room: a capacity error
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ApiError(400, "stop must be a string or an array of strings", param="stop")
        args["stop"] = stop
    bias = field(body, "logit_bias", OBJECT)
    if bias:
        try:
            args["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            raise ApiError(400, "logit_bias must map token ids to numbers", param="logit_bias") from None
    return args


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


def content_text(content, where: str, kinds=("text",)) -> str:
    """A string, or the text of an array of text parts (of the `type`s in kinds), joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or an array of content parts", param=where)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(400, f"{where}[{i}]: only text parts are supported, not {kind!r}", param=where)
        texts.append(part["text"])
    return "\n".join(texts)


def chat_tools(body: dict, fmt: str | None) -> tuple[list | None, str, str]:
    """The tools to render and parse (None: no tool calls), the text forcing a call, and the choice
    ("auto", "required" or the forced function's name)."""
    tools = field(body, "tools", ARRAY)
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}',
                           param=f"tools[{i}]")
    choice = body.get("tool_choice") or "auto"
    if choice == "none" or (choice == "auto" and not tools):
        return None, "", "auto"
    if not tools:
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    if choice == "auto":
        return tools, "", "auto"
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if choice != "required" and not isinstance(name, str):
        raise ApiError(400, 'tool_choice must be "none", "auto", "required" or '
                            '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    if fmt is None:
        raise ApiError(400, "tool_choice: this model's chat template has no tool-call format to force",
                       param="tool_choice")
    if choice == "required":
        return tools, TOOL_CALL_MARKER + "\n", "required"
    if name not in {tool["function"]["name"] for tool in tools}:
        raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return tools, NAMED_CALL_OPENINGS[fmt](name), name


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


def format_args(spec, param: str) -> dict:
    """The runtime's constraint from a flat output format, `{"type": "text" | "json_object" |
    "json_schema", "schema": {...}}` (the Responses API's `text.format`, Anthropic's `output_config.format`)."""
    kind = spec.get("type", "text") if isinstance(spec, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind == "json_schema" and isinstance(spec.get("schema"), dict):
        return {"json_schema": spec["schema"]}
    raise ApiError(400, f'{param} must be {{"type": "text"}}, {{"type": "json_object"}} or '
                        f'{{"type": "json_schema", "schema": {{...}}}}', param=param)


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


def constraint_args(body: dict, tools: list | None, choice: str, fmt: str | None, added: dict) -> dict:
    """A chat's constraint: response_format, a guided_* field, or the grammar of strict tools."""
    schema = response_format_schema(body)
    found = [args for args in (guided_args(body), {} if schema is None else {"json_schema": schema}) if args]
    if tools and any(is_strict(tool) for tool in tools):
        if fmt is None:
            raise ApiError(400, "strict tools: this model's chat template has no tool-call format", param="tools")
        found.append({"grammar": tool_call_grammar(fmt, tools, choice, added)})
    if len(found) > 1:
        raise ApiError(400, "take one constraint: response_format, a guided_* field or strict tools")
    return found[0] if found else {}


def reply_parts(text: str, tools: list | None, forced: str, fmt: str | None) -> tuple[str, list]:
    """(content, tool_calls) of generated text, after the opening the prompt forced (see chat_tools)."""
    if not tools:
        return text, []
    return parse_tool_calls(forced + text, fmt, tools)


def openai_usage(usage: dict) -> dict:
    prompt, completion = usage["prompt_tokens"], usage["generated_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": usage["reused_tokens"]}}


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (and is shorter than it)."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:n])), 0)


class Holdback:
    """Streamed content with tool-call markup held back: from the opening marker on, and a partial
    marker at the end of the text, until the next piece shows whether it opens a call."""

    def __init__(self, marker: str | None, forced: str = ""):
        self.marker, self.held, self.sent = marker, forced, ""

    def push(self, text: str) -> str:
        """The text that can be sent as content now."""
        self.held += text
        cut = len(self.held)
        if self.marker:
            at = self.held.find(self.marker)
            cut = at if at >= 0 else cut - partial_marker(self.held, self.marker)
        out, self.held = self.held[:cut], self.held[cut:]
        self.sent += out
        return out

    def rest(self, content: str) -> str:
        """What the final content adds to the content sent: text after the calls, or a call that did not parse."""
        return content[len(self.sent):] if content.startswith(self.sent) else ""


class EventStream:
    """A server-sent event response, opened by its first event (so that an error before it is a plain reply)."""

    done: str | None = "[DONE]"  # the data of the last event (None: the stream just ends)

    def __init__(self, request: web.Request, first: dict | None = None):
        self.request, self.first = request, first
        self.headers: dict = {}
        self.response: web.StreamResponse | None = None

    def bind_session(self, session_id: str) -> None:
        """Name the session in the X-Session-Id header (the runtime says it before the first token)."""
        self.headers["X-Session-Id"] = session_id

    async def open(self) -> None:
        if self.response is None:
            self.response = web.StreamResponse(headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache", **self.headers})
            await self.response.prepare(self.request)
            if self.first is not None:
                await self.send(self.first)

    async def send(self, data: dict | str, event: str | None = None) -> None:
        await self.open()
        payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
        named = f"event: {event}\n" if event else ""
        await self.response.write(f"{named}data: {payload}\n\n".encode())

    async def fail(self, error: ApiError) -> None:
        """An error once the stream is open: one last event."""
        await self.send(error.body())
        await self.finish()

    async def finish(self) -> web.StreamResponse:
        if self.done is not None:
            await self.send(self.done)
        await self.response.write_eof()
        return self.response


class NamedEventStream(EventStream):
    """Server-sent events named by their type (the Responses and Messages APIs): opened by start
    events, no [DONE], an error as an `error` event. Their blocks (output items, content blocks)
    are counted by `index`; a text block is opened by its first piece and closed later."""

    done = None

    def __init__(self, request: web.Request):
        super().__init__(request)
        self.index = 0  # of the next block
        self.text_open = False

    async def open(self) -> None:
        if self.response is None:
            await super().open()
            await self.started()

    async def started(self) -> None:
        """Send the events that open the stream."""

    def payload(self, kind: str, data: dict) -> dict:
        """The data of an event of this type."""
        return {"type": kind, **data}

    async def event(self, kind: str, data: dict) -> None:
        await self.open()  # the start events come first
        await self.send(self.payload(kind, data), kind)

    async def content(self, text: str) -> None:
        """Text that may go out as content (empty: none yet, but the stream opens)."""
        if text:
            await self.text(text)
        else:
            await self.open()

    async def text(self, text: str) -> None:
        """A piece of the text block (opened by its first piece)."""
        if not self.text_open:
            await self.text_started()
            self.text_open = True
        await self.text_delta(text)

    async def text_started(self) -> None:
        """Send the events that open the text block."""

    async def text_delta(self, text: str) -> None:
        """Send a piece of the text block."""

    async def end_block(self, *events: tuple[str, dict]) -> None:
        """Send a block's last events; the next block takes the next index."""
        for kind, data in events:
            await self.event(kind, data)
        self.index, self.text_open = self.index + 1, False

    def error_data(self, error: ApiError) -> dict:
        """The data of the `error` event."""
        return {"error": error.body()["error"]}

    async def fail(self, error: ApiError) -> None:
        await self.event("error", self.error_data(error))
        await self.finish()


class CountedSite(web.BaseSite):
    """A TCP site that bounds its connections (a connection beyond a bound is refused: 503, see Refusal).

    Without API keys, at most `limit` connections at once. With keys, a connection counts against
    its key once a request on it authenticates (Guard calls `authenticated`): at most `limit` per
    key, so a key's idle keep-alive connections lock out that key alone. Until then it is one of at
    most `unauthenticated` connections, closed after `auth_timeout` s; one more closes the oldest
    of them (a client that sends its request at once is never the oldest for long). A connection
    counts from connection_made to connection_lost, which asyncio calls once for every transport
    however it ends (a client that vanishes too), so a place is never lost.
    """

    def __init__(self, runner: web.AppRunner, host: str, port: int, limits: Limits, keyed: bool = False):
        super().__init__(runner)
        self.runner, self.host, self.port, self.keyed = runner, host, port, keyed
        self.limit, self.auth_timeout = limits.http_max_connections, limits.http_auth_timeout_s
        self.unauthenticated = limits.http_max_unauthenticated
        self.open: dict[str | None, int] = {}  # key name (None: not authenticated yet) -> connections
        self.waiting: dict = {}  # transport -> Gate of the connections not authenticated yet, oldest first
        self.gates: dict = {}  # transport -> Gate of every counted connection

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Gate(self), self.host, self.port, reuse_address=True)

    def admit(self, gate: Gate) -> str | None:
        """Count a new connection; the reason it is refused, else None."""
        if not self.keyed:
            if self.open.get(None, 0) >= self.limit:
                return (f"the daemon already serves {self.open[None]} HTTP connections (http_max_connections); "
                        "retry later")
        elif len(self.waiting) >= self.unauthenticated:
            oldest = next(iter(self.waiting.values()))
            oldest.transport.close()  # its connection_lost uncounts it
            self.forget(oldest)
        self.count(gate, None)
        if self.keyed:
            self.waiting[gate.transport] = gate
            gate.timer = asyncio.get_running_loop().call_later(self.auth_timeout, gate.transport.close)
        return None

    def authenticated(self, transport, key: str) -> None:
        """A request on this connection came with the key named `key`: the connection counts against
        that key from now on; ApiError 503 when the key holds `limit` already (the connection stays
        unauthenticated: closed after auth_timeout)."""
        gate = self.gates.get(transport)
        if gate is None or gate.key == key:
            return
        if self.open.get(key, 0) >= self.limit:
            raise ApiError(503, f"this API key already holds {self.open[key]} HTTP connections "
                                "(http_max_connections); close one or retry later", "server_error",
                           code="too_many_connections", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.uncount(gate)
        self.count(gate, key)

    def count(self, gate: Gate, key: str | None) -> None:
        gate.key, gate.counted = key, True
        self.open[key] = self.open.get(key, 0) + 1
        self.gates[gate.transport] = gate

    def uncount(self, gate: Gate) -> None:
        """Stop counting a connection (it closed, or changes key)."""
        if gate.counted:
            self.open[gate.key] -= 1
            gate.counted = False
            self.gates.pop(gate.transport, None)
        self.forget(gate)

    def forget(self, gate: Gate) -> None:
        """A connection is no longer waiting to authenticate."""
        if self.waiting.pop(gate.transport, None) is not None and gate.timer is not None:
            gate.timer.cancel()


class Gate(asyncio.Protocol):
    """One accepted connection: aiohttp's handler while the site has room, else a Refusal."""

    def __init__(self, site: CountedSite):
        self.site, self.counted, self.key, self.timer = site, False, None, None
        self.inner: asyncio.Protocol | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        refused = self.site.admit(self)
        self.inner = Refusal(refused) if refused else self.site.runner.server()
        self.inner.connection_made(transport)

    def connection_lost(self, exc) -> None:
        self.site.uncount(self)
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class Refusal(asyncio.Protocol):
    """A connection beyond http_max_connections: 503 with Retry-After, once the request's head has
    arrived (a reply before it could be lost to the reset of closing with unread input), then closed."""

    def __init__(self, message: str):
        body = json.dumps(ApiError(503, message, "server_error", code="too_many_connections").body()).encode()
        self.reply = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\nRetry-After: {RETRY_AFTER_S}\r\nConnection: close\r\n\r\n"
                      ).encode() + body
        self.head = b""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, self.close)

    def data_received(self, data: bytes) -> None:
        if self.reply:  # after the reply, what comes is read and dropped until the client closes
            self.head += data
            if b"\r\n\r\n" in self.head or len(self.head) > 16384:
                self.answer()

    def answer(self) -> None:
        self.transport.write(self.reply)
        self.reply = b""
        if self.transport.can_write_eof():
            self.transport.write_eof()

    def close(self) -> None:
        if self.reply:
            self.answer()
        self.transport.close()

    def eof_received(self) -> None:
        self.close()

    def connection_lost(self, exc) -> None:
        self.timer.cancel()


class Guard:
    """The checks every request passes before its handler: Host and Origin on a loopback address
    (a web page must not reach the API), and the API key when keys are set. A key's requests carry
    its owner (`request["owner"]`: they reach its sessions only); an admin key's carry none (they
    reach every session, as the Unix socket does) and set `request["admin"]`."""

    def __init__(self, host: str, api_keys: list, on_key=None):
        self.local = is_loopback(host)
        self.names = LOCAL_NAMES | {host}
        self.keys = [(key.secret.encode(), key) for key in api_keys]
        self.on_key = on_key  # on_key(request, key): the connection's request authenticated (CountedSite)

    @web.middleware
    async def check(self, request: web.Request, handler):
        if self.local:
            if host_name(request.headers.get("Host", "")) not in self.names:
                raise ApiError(403, "the Host header must name this machine (localhost, 127.0.0.1 or [::1])")
            origin = request.headers.get("Origin")
            if origin is not None and urlsplit(origin).hostname not in self.names:
                raise ApiError(403, f"requests from the web page at {origin} are refused")
        if self.keys and request.path != "/health":
            key = self.key(request.headers.get("Authorization", ""), request.headers.get("x-api-key"))
            if self.on_key is not None:
                self.on_key(request, key)
            if key.admin:
                request["admin"] = True
            else:
                request["owner"] = key.owner
        return await handler(request)

    def key(self, authorization: str, api_key: str | None = None):
        """The key sent as `Authorization: Bearer KEY`, or as `x-api-key: KEY` (Anthropic's clients)."""
        scheme, _, key = authorization.partition(" ")
        given = key.strip().encode() if scheme.lower() == "bearer" else (api_key or "").strip().encode()
        for known, api_key in self.keys:
            if given and hmac.compare_digest(given, known):
                return api_key
        raise ApiError(401, "a valid API key is needed: Authorization: Bearer <key>", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Every failure as an OpenAI error body (Anthropic's under /v1/messages); user errors never log a traceback."""
    anthropic = request.path.startswith(ANTHROPIC_PATHS)
    try:
        return await handler(request)
    except ApiError as e:
        return e.response(anthropic)
    except TemplateError as e:  # the template refused the conversation (say, roles out of order)
        return ApiError(400, str(e)).response(anthropic)
    except web.HTTPException as e:  # no such route, wrong method, body too large
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return ApiError(e.status, f"{request.method} {request.path}: {e.reason}", kind).response(anthropic)
    except Exception as e:
        log.exception("%s %s failed", request.method, request.path)
        return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error").response(anthropic)


class Chat:
    """One chat completion's reply, whole or streamed: tool calls parsed, markup held back."""

    def __init__(self, server: HttpServer, head: dict, tools: list | None, forced: str, top: int | None):
        self.server, self.head, self.tools, self.forced, self.top = server, head, tools, forced, top

    def parse(self, text: str) -> tuple[str, list]:
        return reply_parts(text, self.tools, self.forced, self.server.runtime.tool_format)

    def logprobs(self, result: dict) -> dict | None:
        return self.server.chat_logprobs(result["logprobs"], self.top) if self.top is not None else None

    async def reply(self, args: dict) -> web.Response:
        result = await self.server.generate(args)
        content, calls = self.parse(result["text"])
        message = {"role": "assistant", "content": (content or None) if calls else content}
        if calls:
            message["tool_calls"] = calls
        choice = {"index": 0, "message": message, "logprobs": self.logprobs(result),
                  "finish_reason": "tool_calls" if calls else result["finish_reason"]}
        return web.json_response(
            {**self.head, "choices": [choice], "usage": openai_usage(result["usage"]),
             "session_id": result["session_id"]},
            headers={"X-Session-Id": result["session_id"]})

    def chunk(self, delta: dict, finish=None, logprobs=None) -> dict:
        return {**self.head, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    async def stream(self, request: web.Request, args: dict, include_usage: bool) -> web.StreamResponse:
        stream = EventStream(request, self.chunk({"role": "assistant", "content": ""}))
        holdback = Holdback(TOOL_CALL_MARKER if self.tools else None, self.forced)

        async def on_text(text: str) -> None:
            content = holdback.push(text)
            if content:
                await stream.send(self.chunk({"content": content}))
            else:
                await stream.open()  # the role chunk, even while a tool call is held back

        result = await self.server.stream(stream, args, on_text)
        if result is None:
            return stream.response
        content, calls = self.parse(result["text"])
        if rest := holdback.rest(content):
            await stream.send(self.chunk({"content": rest}))
        if calls:
            await stream.send(self.chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}))
        finish = "tool_calls" if calls else result["finish_reason"]
        await stream.send({**self.chunk({}, finish, self.logprobs(result)), "session_id": result["session_id"]})
        if include_usage:
            await stream.send({**self.chunk({}), "choices": [], "usage": openai_usage(result["usage"]),
                               "session_id": result["session_id"]})
        return await stream.finish()


class HttpServer:
    """The OpenAI-compatible API of a Runtime, on host:port."""

    def __init__(self, runtime, host: str, port: int, limits: Limits = Limits(), admission: Admission | None = None,
                 api_keys=()):
        self.runtime, self.host, self.port, self.limits = runtime, host, port, limits
        self.admission = admission or Admission(runtime, limits.max_queue)
        engine = runtime.engine
        self.tokenizer, self.template = engine.tokenizer, engine.chat_template
        self.context = engine.kv.sequence_length
        self.model = model_name(engine.model_path)
        self.fingerprint = f"ellm-{runtime.fingerprint['model']}"
        stops = set(engine.spec.eos_token_id) | (self.tokenizer.eos_token_ids if self.tokenizer else set())
        # added tokens other than end-of-sequence ones, for the grammar of strict tools
        self.added_tokens = {token.content: i for i, token in self.tokenizer.backend.get_added_tokens_decoder().items()
                             if i not in stops} if self.tokenizer else {}
        self.metrics = Metrics(runtime)
        self.closing = False
        self.site: CountedSite | None = None
        self.keyed = bool(api_keys)
        guard = Guard(host, list(api_keys), on_key=self.authenticated)
        app = web.Application(middlewares=[openai_errors, guard.check],
                              client_max_size=limits.http_max_body)
        app.add_routes([
            web.get("/v1/models", self.models),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics_text),
        ])
        from ellmd.server import anthropic, responses  # they build on this module's helpers

        app.add_routes([*responses.routes(self), *anthropic.routes(self)])
        # A client that disconnects cancels its handler, which cancels its generation.
        # keepalive_timeout also closes a connection that never completes its request headers.
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=10,
                                    keepalive_timeout=limits.http_read_timeout_s)

    async def start(self) -> None:
        await self.runner.setup()
        try:
            self.site = CountedSite(self.runner, self.host, self.port, self.limits, self.keyed)
            await self.site.start()
        except OSError as e:
            await self.runner.cleanup()
            raise EllmError(f"--http {self.host}:{self.port}: {e.strerror or e}") from None

    def authenticated(self, request: web.Request, key) -> None:
        """A request came with a valid key: its connection counts against that key (CountedSite)."""
        if self.site is not None and request.transport is not None:
            self.site.authenticated(request.transport, key.name)

    async def close(self) -> None:
        """Stop listening; requests in flight finish (the runtime ends their generations on shutdown)."""
        self.closing = True
        await self.runner.cleanup()

    # ---- plumbing ---------------------------------------------------------------------------

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
        except ProtocolError as e:
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
        except ProtocolError as e:
            raise ApiError.from_runtime(e) from None

    async def in_thread(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(None, function, *args)

    def head(self, body: dict, kind: str, prefix: str) -> dict:
        """The fields every response object (or chunk) of a request starts with."""
        model = body.get("model") if isinstance(body.get("model"), str) else self.model
        return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()),
                "model": model, "system_fingerprint": self.fingerprint}

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    # ---- endpoints --------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": int(self.runtime.started), "owned_by": "ellm",
            "max_model_len": self.context}]})

    async def metrics_text(self, request: web.Request) -> web.Response:
        if "owner" in request:  # the counters of every tenant: for the operator
            raise ApiError(403, "/metrics needs an admin key (NAME KEY admin in api_key_file)", "permission_error")
        stats = await self.call("stats", {})
        return web.Response(body=self.metrics.render(stats), headers={"Content-Type": self.metrics.content_type})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request, self.limits.http_read_timeout_s)
        if self.template is None:
            raise ApiError(400, "this model has no chat template: use /v1/completions")
        require_one(body, "n")
        messages = chat_messages(body)
        tools, forced, choice = chat_tools(body, self.runtime.tool_format)
        constraint = constraint_args(body, tools, choice, self.runtime.tool_format, self.added_tokens)
        extra = field(body, "chat_template_kwargs", OBJECT, {})
        if extra.keys() & {"messages", "tools", "add_generation_prompt"}:
            raise ApiError(400, "chat_template_kwargs cannot set messages, tools or add_generation_prompt",
                           param="chat_template_kwargs")
        tokens = await self.in_thread(self.render_chat, messages, tools, forced, extra)
        args = {"tokens": tokens, "messages": messages, "tools": tools, **constraint,
                **sampling_args(body, self.context - len(tokens)), **session_arg(request, body)}
        top = field(body, "top_logprobs", INT, 0) if field(body, "logprobs", BOOL) else None
        if top is not None:
            args["logprobs"] = max(top, 1)  # the runtime reports the chosen token among its top n
        chat = Chat(self, self.head(body, "chat.completion", "chatcmpl"), tools, forced, top)
        if field(body, "stream", BOOL):
            include_usage = (field(body, "stream_options", OBJECT) or {}).get("include_usage")
            return await chat.stream(request, args, include_usage)
        return await chat.reply(args)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request, self.limits.http_read_timeout_s)
        require_one(body, "n", "best_of")
        for name in ("echo", "suffix"):
            if body.get(name):
                raise ApiError(400, f"{name} is not supported", param=name)
        tokens = await self.prompt_tokens(body.get("prompt"))
        args = {"tokens": tokens, **guided_args(body), **sampling_args(body, self.context - len(tokens)),
                **session_arg(request, body)}
        top = field(body, "logprobs", INT)
        if top is not None:
            args["logprobs"] = max(top, 1)
        head = self.head(body, "text_completion", "cmpl")

        def choice(text: str, finish=None, result=None) -> dict:
            logprobs = self.completion_logprobs(result["logprobs"], top) if result and top is not None else None
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

        if not field(body, "stream", BOOL):
            result = await self.generate(args)
            return web.json_response(
                {**head, "choices": [choice(result["text"], result["finish_reason"], result)],
                 "usage": openai_usage(result["usage"]), "session_id": result["session_id"]},
                headers={"X-Session-Id": result["session_id"]})

        stream = EventStream(request)

        async def on_text(text: str) -> None:
            await stream.send({**head, "choices": [choice(text)]})

        result = await self.stream(stream, args, on_text)
        if result is None:
            return stream.response
        await stream.send({**head, "choices": [choice("", result["finish_reason"], result)],
                           "session_id": result["session_id"]})
        if (field(body, "stream_options", OBJECT) or {}).get("include_usage"):
            await stream.send({**head, "choices": [], "usage": openai_usage(result["usage"]),
                               "session_id": result["session_id"]})
        return await stream.finish()

    # ---- prompts and log-probabilities ------------------------------------------------------

    def render_chat(self, messages: list[dict], tools, forced: str, extra: dict) -> list[int]:
        text = self.template.render(messages, tools=tools, add_generation_prompt=True, **extra)
        return self.tokenizer.encode(text + forced)

    async def prompt_tokens(self, prompt) -> list[int]:
        """A completion prompt: a string, token ids, or an array holding one of them (no batches)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            tokens = await self.in_thread(lambda: self.tokenizer.encode(prompt, add_special_tokens=True))
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            tokens = prompt
        else:
            raise ApiError(400, "prompt must be a string or an array of token ids (one prompt per request)",
                           param="prompt")
        if not tokens:
            raise ApiError(400, "prompt is empty", param="prompt")
        return tokens

    def chat_logprobs(self, entries: list[dict], top: int) -> dict:
        def item(token: int, logprob: float) -> dict:
            return {"token": self.token_text(token), "logprob": logprob,
                    "bytes": list(self.tokenizer.token_bytes(token))}

        return {"content": [{**item(e["token"], e["logprob"]), "top_logprobs": [item(*t) for t in e["top"][:top]]}
                            for e in entries]}

    def completion_logprobs(self, entries: list[dict], top: int) -> dict:
        tokens = [self.token_text(e["token"]) for e in entries]
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{self.token_text(t): lp for t, lp in e["top"][:top]} for e in entries],
                "text_offset": list(itertools.accumulate((len(t) for t in tokens), initial=0))[:-1]}
