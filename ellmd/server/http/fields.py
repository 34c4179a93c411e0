"""Reading a request: its JSON body, typed fields, and the parts the three APIs share (sampling
arguments, text content, a flat output format).

A body holding text UTF-8 cannot encode (a lone surrogate) is a 400 naming the field: the store
could never hold it.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from ellmd.runtime.schemas import UNSTORABLE, unstorable
from ellmd.server.http.errors import ApiError

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


def token_count(body: dict, name: str) -> int | None:
    """A field counting tokens to generate: at least 1 when given (as OpenAI: no completion of no tokens)."""
    count = field(body, name, INT)
    if count is not None and count < 1:
        raise ApiError(400, f"{name} must be >= 1, not {count}", param=name)
    return count


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
    max_tokens = token_count(body, name)
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
