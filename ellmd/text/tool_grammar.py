"""Strict tool calls: a grammar (llguidance's Lark) whose texts are the calls a model may write,
in its own format, with arguments valid for each tool's JSON Schema.

With tool_choice "auto" the reply is free text and calls; when tool_choice forced the opening of a
call into the prompt, the grammar starts after that opening. Tools marked `strict` get their
schema; the others any arguments. Newlines around the markup are optional, as models differ in
where they put them.
"""

from __future__ import annotations

import json

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A Qwen3-Coder parameter's text value and its closing tag: a lazy lexeme, which the tag ends.
TEXT_VALUE = 'text_value[lazy]: /(?s:.+)/ "</parameter>"'
ANY_OBJECT = {"type": "object"}


def is_strict(tool: dict) -> bool:
    return (tool.get("function") or {}).get("strict") is True


def lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a JSON string is a Lark string literal


def json_rule(schema: dict) -> str:
    return f"%json {json.dumps(schema)}"


def tool_call_grammar(fmt: str, tools: list[dict], choice: str = "auto", added: dict[str, int] | None = None) -> str:
    """The grammar of a reply to `tools` in format `fmt` ("hermes" or "qwen3_coder").

    `choice` is "auto" (text and calls), "required" (after a forced call marker) or the name of a
    function whose opening was forced (the grammar covers its arguments and the call's end).
    `added`: the tokenizer's added tokens (text -> id, end-of-sequence ones left out), which
    llguidance matches only as tokens, never as text: the markers among them are written as
    tokens, the others allowed in the free text.
    """
    functions = [tool["function"] for tool in tools]
    added = added or {}
    rules = hermes_rules if fmt == "hermes" else coder_rules
    lines = [*rules(functions), *reply_rules(added), "NL: /\\n/"]
    close = f"<{CLOSE[1:-1]}>" if CLOSE in added else lark_string(CLOSE)
    if choice == "auto":
        lines.insert(0, "start: reply")
    elif choice == "required":
        lines.insert(0, f"start: NL? body NL? {close} reply")
    else:
        index = next(i for i, f in enumerate(functions) if f["name"] == choice)
        rest = f'args_{index} "}}"' if fmt == "hermes" else f'params_{index} "</function>"'
        lines.insert(0, f"start: {rest} NL? {close} NL?")
    return "\n".join(lines) + "\n"


def reply_rules(added: dict[str, int]) -> list[str]:
    """`call` (a whole call, from its opening marker) and `reply` (text and calls)."""
    if OPEN in added and CLOSE in added:  # markers are tokens: text can never open a call
        others = sorted(i for t, i in added.items() if t not in (OPEN, CLOSE))
        text = "text: TEXT? (other TEXT?)*" if others else "text: TEXT?"
        lines = [f"call: {OPEN} NL? body NL? {CLOSE}", "reply: text (call text)*", text, "TEXT: /(?s:.+)/"]
        return lines + ([f"other: <[{','.join(map(str, others))}]>"] if others else [])
    # Markers spelled as text: the text before a call is a lazy lexeme that the marker ends, the
    # text after the last call one without a marker (`&`: both, `~`: not).
    return [f'call: head NL? body NL? {lark_string(CLOSE)}', "reply: call* TAIL?",
            f'head[lazy]: /(?s:.*)/ {lark_string(OPEN)}', "TAIL: /(?s:.+)/ & ~/(?s:.*<tool_call>.*)/"]


def parameters(function: dict) -> dict:
    schema = function.get("parameters") if function.get("strict") is True else None
    return schema if isinstance(schema, dict) else ANY_OBJECT


def hermes_rules(functions: list[dict]) -> list[str]:
    """<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>"""
    lines = ["body: " + " | ".join(f"body_{i}" for i in range(len(functions)))]
    for i, function in enumerate(functions):
        head = lark_string(f'{{"name": {json.dumps(function["name"])}, "arguments": ')
        lines += [f'body_{i}: {head} args_{i} "}}"', f"args_{i}: {json_rule(parameters(function))}"]
    return lines


def coder_rules(functions: list[dict]) -> list[str]:
    """<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>"""
    lines = ["body: " + " | ".join(f"function_{i}" for i in range(len(functions))),
             TEXT_VALUE, 'any_parameter: "<parameter=" /[^>\\n]+/ ">" text_value NL?']
    for i, function in enumerate(functions):
        opening = lark_string(f"<function={function['name']}>")
        lines.append(f'function_{i}: {opening} NL? params_{i} "</function>"')
        schema = parameters(function)
        properties = schema.get("properties") if schema is not ANY_OBJECT else None
        if not isinstance(properties, dict):
            lines.append(f"params_{i}: any_parameter*")
            continue
        required = set(schema.get("required") or ())
        items = []
        for j, (key, value_schema) in enumerate(properties.items()):
            rule = f"param_{i}_{j}"
            value = coder_value(value_schema if isinstance(value_schema, dict) else {})
            lines.append(f'{rule}: {lark_string(f"<parameter={key}>")} NL? {value} NL?')
            items.append(rule if key in required else f"{rule}?")
        lines.append(f"params_{i}: {' '.join(items)}" if items else f'params_{i}: ""')
    return lines


def coder_value(schema: dict) -> str:
    """A parameter's value and closing tag as Qwen3-Coder writes them: strings as plain text, the
    rest as JSON."""
    close = 'NL? "</parameter>"'
    if schema.get("type") == "string":
        if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
            return "(" + " | ".join(lark_string(v) for v in schema["enum"]) + f") {close}"
        return "text_value"
    return f"{json_rule(schema)} {close}"
