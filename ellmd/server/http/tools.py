"""Tool calls in the model's own format (Hermes JSON or Qwen3-Coder XML), for all three APIs.

`tools` are rendered into the prompt and calls parsed from the reply. `tool_choice` "none" renders
without tools and parses nothing; "required" or a named function appends the opening of a call to
the prompt, so that the model can only complete it. Streaming holds text back from a call's opening
marker on (Holdback), so markup never reaches the content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ellmd.server.http.errors import ApiError
from ellmd.server.http.fields import ARRAY, field
from ellmd.text import parse_tool_calls

# Both tool-call formats open a call with this marker.
TOOL_CALL_MARKER = "<tool_call>"
NAMED_CALL_OPENINGS = {
    "hermes": lambda name: f'{TOOL_CALL_MARKER}\n{{"name": {json.dumps(name)}, "arguments": ',
    "qwen3_coder": lambda name: f"{TOOL_CALL_MARKER}\n<function={name}>\n",
}


@dataclass(frozen=True)
class ToolUse:
    """A request's tools as the prompt renders them and the reply is parsed."""

    tools: list | None = None  # in the chat completions' shape; None: no tool calls
    forced: str = ""  # the opening of a call the prompt ends with ("required" or a named function)
    choice: str = "auto"  # "auto", "required" or the forced function's name
    fmt: str | None = None  # the model's tool-call format

    def parse(self, text: str) -> tuple[str, list]:
        """(content, tool_calls) of generated text, after the opening the prompt forced."""
        if not self.tools:
            return text, []
        return parse_tool_calls(self.forced + text, self.fmt, self.tools)

    def holdback(self) -> Holdback:
        return Holdback(TOOL_CALL_MARKER if self.tools else None, self.forced)


def chat_tools(body: dict, fmt: str | None) -> ToolUse:
    """The tools of a body in the chat completions' shape (the other APIs convert theirs to it)."""
    tools = field(body, "tools", ARRAY)
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}',
                           param=f"tools[{i}]")
    choice = body.get("tool_choice") or "auto"
    if choice == "none" or (choice == "auto" and not tools):
        return ToolUse(fmt=fmt)
    if not tools:
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    if choice == "auto":
        return ToolUse(tools, fmt=fmt)
    return forced_call(tools, choice, fmt)


def forced_call(tools: list, choice, fmt: str | None) -> ToolUse:
    """A tool_choice of "required" or a named function: the prompt ends with the opening of a call."""
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if choice != "required" and not isinstance(name, str):
        raise ApiError(400, 'tool_choice must be "none", "auto", "required" or '
                            '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    if fmt is None:
        raise ApiError(400, "tool_choice: this model's chat template has no tool-call format to force",
                       param="tool_choice")
    if choice == "required":
        return ToolUse(tools, TOOL_CALL_MARKER + "\n", "required", fmt)
    if name not in {tool["function"]["name"] for tool in tools}:
        raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return ToolUse(tools, NAMED_CALL_OPENINGS[fmt](name), name, fmt)


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
