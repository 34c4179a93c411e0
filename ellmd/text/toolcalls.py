"""Tool calls out of generated text, in OpenAI's shape.

Each parser returns `(content, tool_calls)`: the text outside the calls (stripped when there are
calls, untouched otherwise) and a list of
`{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}`. A call that does
not parse stays in the content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import re
import uuid

# Hermes (Qwen2.5/Qwen3): <tool_call>{"name": ..., "arguments": {...}}</tool_call>. The closing
# tag may be missing when generation stopped on the end token right after the JSON.
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)

# Qwen3-Coder: <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call>
_CODER = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*(?:</tool_call>|\Z)", re.DOTALL)
# A parameter ends at its closing tag, or (models sometimes drop it) at the next parameter.
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def _call(name: str, arguments: dict) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _cut(text: str, spans: list[tuple[int, int]]) -> str:
    # Without calls the text is the model's answer, untouched; around calls, whitespace is layout.
    if not spans:
        return text
    pieces, start = [], 0
    for a, b in spans:
        pieces.append(text[start:a])
        start = b
    pieces.append(text[start:])
    return "".join(pieces).strip()


def parse_hermes(text: str, tools: list[dict] | None = None) -> tuple[str, list[dict]]:
    """Parse `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

    `tools` is unused (JSON arguments carry their types); it keeps the parsers' signatures alike.
    """
    calls, spans = [], []
    for match in _HERMES.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        arguments = body.get("arguments", body.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                continue
        if not isinstance(arguments, dict):
            continue
        calls.append(_call(body["name"], arguments))
        spans.append(match.span())
    return _cut(text, spans), calls


def _parameter_types(tools: list[dict] | None, name: str) -> dict:
    for tool in tools or ():
        function = tool.get("function", tool)
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            return {k: v.get("type") for k, v in properties.items() if isinstance(v, dict)}
    return {}


def _coder_value(raw: str, declared_type):
    # The template writes "\n" + value + "\n" around each value.
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    if declared_type == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def parse_qwen3_coder(text: str, tools: list[dict] | None = None) -> tuple[str, list[dict]]:
    """Parse Qwen3-Coder's XML calls; values are JSON-decoded when they parse, else kept as text.

    With `tools` (OpenAI schemas), parameters declared as strings are always kept as text.
    """
    calls, spans = [], []
    for match in _CODER.finditer(text):
        name, body = match.group(1).strip(), match.group(2)
        types = _parameter_types(tools, name)
        arguments = {}
        for parameter in _PARAMETER.finditer(body):
            key = parameter.group(1).strip()
            arguments[key] = _coder_value(parameter.group(2), types.get(key))
        if not arguments and body.strip():
            continue  # text inside <function=...> that is not parameters: not a call we understand
        calls.append(_call(name, arguments))
        spans.append(match.span())
    return _cut(text, spans), calls


PARSERS = {"hermes": parse_hermes, "qwen3_coder": parse_qwen3_coder}


def detect_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches the model: "qwen3_coder", "hermes" or None."""
    if not chat_template:
        return None
    if "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    if "<tool_call>" in chat_template:
        return "hermes"
    return None


def parse_tool_calls(text: str, fmt: str | None, tools: list[dict] | None = None) -> tuple[str, list[dict]]:
    """Parse with the parser for `fmt` (a key of PARSERS); no format means no tool calls."""
    if fmt is None:
        return text, []
    return PARSERS[fmt](text, tools)
