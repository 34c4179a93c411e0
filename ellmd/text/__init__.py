"""Text layer: tokenizer, chat templates, incremental detokenizer, stop strings, tool-call parsers."""

from ellmd.text.chat_template import ChatTemplate, TemplateError
from ellmd.text.detokenizer import IncrementalDetokenizer, StopMatcher
from ellmd.text.tokenizer import Tokenizer
from ellmd.text.toolcalls import detect_format, parse_tool_calls

__all__ = [
    "ChatTemplate",
    "IncrementalDetokenizer",
    "StopMatcher",
    "TemplateError",
    "Tokenizer",
    "detect_format",
    "parse_tool_calls",
]
