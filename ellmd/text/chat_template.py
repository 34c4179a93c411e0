"""Chat templates: Hugging Face's Jinja semantics, and rendering one fragment of a conversation.

A session never re-renders its history (its KV cache is the truth), so appending messages means
rendering only the text they add: the rendering with them minus the rendering without them.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import cached_property

import jinja2
import jinja2.ext
import msgspec
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ellmd.errors import BadRequest

logger = logging.getLogger(__name__)

# A message body no template rewrites (no whitespace to trim, no markup to escape).
_PROBE = "ELLM-PROBE-7f3a"


class TemplateError(BadRequest):
    """A chat template failed to compile or render, or cannot render a conversation as fragments
    (a request's messages it refuses: `bad_request`)."""


class _GenerationTag(jinja2.ext.Extension):
    # transformers' `{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    # rendering only needs the body.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes; transformers replaces it with plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


# The longest rendering a template may produce (characters); ChatTemplate.max_chars, max_render_kb.
DEFAULT_MAX_CHARS = 4 << 20


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, where `"x" * n` cannot allocate more than a rendering may hold (a template is
    foreign code: a GGUF file carries its own)."""

    intercepted_binops = frozenset(["*"])

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and len(seq) * count > DEFAULT_MAX_CHARS:
                    raise jinja2.exceptions.SecurityError(f"a repetition of {len(seq) * count} items is too long")
        return super().call_binop(context, operator, left, right)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()

# Names a message's reasoning may come under; templates read `reasoning_content` (gpt-oss: `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _one_line(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())


def _prepare(message: dict) -> dict:
    """A message as transformers hands it to a template, plus JSON-string tool arguments decoded.

    Keys whose value is None are dropped (OpenAI clients send `content: null`), reasoning is aliased
    under every name templates read, and `arguments` sent as a JSON string (the OpenAI wire format)
    become a mapping, since templates iterate over them (as vLLM and llama.cpp do).
    """
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    if message.get("tool_calls"):
        message["tool_calls"] = [_decode_arguments(call) for call in message["tool_calls"]]
    return message


def _decode_arguments(call: dict) -> dict:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _after_rewritten_history(before: str, after: str, at: int) -> str | None:
    # `after` is the history as rewritten, then the new text. The rewritten history still ends the way
    # `before` ends: find the longest tail of `before[at:]` that occurs in `after[at:]`; the new text
    # starts right after its first occurrence. A tail occurring implies its own tails occur, so the
    # shortest tail start `q` that occurs is found by bisection.
    lo, hi = at, len(before)
    while lo < hi:
        mid = (lo + hi) // 2
        if after.find(before[mid:], at) >= 0:
            hi = mid
        else:
            lo = mid + 1
    if lo == len(before):
        return None
    end = after.find(before[lo:], at) + len(before) - lo
    return after[end:]


def _key(messages: list[dict], tools, extra: dict) -> bytes | None:
    """What a rendering depends on, as bytes (None: not encodable, so never reused)."""
    try:
        return msgspec.msgpack.encode((messages, tools, extra))
    except (TypeError, ValueError, msgspec.EncodeError):  # ValueError: a lone surrogate, say
        return None


class ChatTemplate:
    """A compiled chat template with the model's BOS/EOS tokens bound."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        self.source = source
        tokens = {"bos_token": bos_token, "eos_token": eos_token}
        self.special_tokens = {k: v for k, v in tokens.items() if v is not None}
        self.max_chars = DEFAULT_MAX_CHARS  # a longer rendering is refused (a loop run wild)
        # The last conversation rendered without a generation prompt, (key, text): the history of the
        # next fragment, so that appending renders the conversation once, not twice.
        self._last: tuple[bytes | None, str] = (None, "")
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from None

    @classmethod
    def from_tokenizer(cls, tokenizer) -> ChatTemplate:
        """The template a `Tokenizer` carries, with its BOS/EOS tokens."""
        if not tokenizer.chat_template:
            raise TemplateError("the tokenizer has no chat template")
        return cls(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        **extra,
    ) -> str:
        """Render a whole conversation, as transformers' `apply_chat_template(..., tokenize=False)`.

        `extra` becomes template variables (e.g. `enable_thinking=False`, `documents=[...]`).
        """
        variables = {
            **self.special_tokens,
            "documents": None,
            **extra,
            "messages": [_prepare(m) for m in messages],
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        pieces, size = [], 0
        try:
            for piece in self._template.generate(**variables):
                size += len(piece)
                if size > self.max_chars:
                    break
                pieces.append(piece)
        except Exception as e:  # the template is foreign code: any failure is reported the same way
            raise TemplateError(f"chat template failed: {_one_line(e)}") from None
        if size > self.max_chars:
            raise TemplateError(f"the chat template's rendering is over {self.max_chars} characters (max_render_kb)")
        return "".join(pieces)

    def render_fragment(
        self,
        history: list[dict],
        new_messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        allow_rewrite: bool = False,
        **extra,
    ) -> str:
        """The text `new_messages` add after `history` (plus the generation prompt if asked).

        `tools` and `extra` must be the ones the history was rendered with. When the template
        renders the history differently once the new messages follow it (Qwen3 drops the reasoning
        of earlier turns), this raises TemplateError, unless `allow_rewrite`: then the text after
        the rewritten history is returned, to be appended to the history the model actually saw.
        """
        before = self._history(history, tools, extra) if history else ""
        after = self.render([*history, *new_messages], tools, add_generation_prompt, **extra)
        if not add_generation_prompt:
            self._last = (_key([*history, *new_messages], tools, extra), after)
        if after.startswith(before):
            return after[len(before):]
        at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), len(after))
        where = (
            f"when {len(new_messages)} message(s) follow {len(history)}: renderings diverge at character "
            f"{at} ({before[at:at + 40]!r} became {after[at:at + 40]!r})"
        )
        if not allow_rewrite:
            raise TemplateError(f"the chat template rewrites the conversation {where}")
        fragment = _after_rewritten_history(before, after, at)
        contents = [m.get("content") for m in new_messages]
        if fragment is None or any(isinstance(c, str) and c.strip() not in fragment for c in contents):
            raise TemplateError(f"cannot find where new messages start: the chat template rewrites {where}")
        logger.info("chat template rewrote the history %s; the session keeps what the model saw", where)
        return fragment

    def _history(self, history: list[dict], tools, extra: dict) -> str:
        """The rendering of `history` (no generation prompt): the last fragment's, when it was that."""
        key, text = self._last  # one tuple: read whole, whichever thread rendered it
        wanted = _key(history, tools, extra)
        return text if wanted is not None and key == wanted else self.render(history, tools, False, **extra)

    @cached_property
    def assistant_end(self) -> str:
        """The text the template writes after an assistant message's content, e.g. "<|im_end|>\\n"."""
        rendered = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}])
        if rendered.count(_PROBE) != 1:
            raise TemplateError("cannot find where the chat template ends an assistant turn")
        return rendered.split(_PROBE, 1)[1]

    def end_of_turn(self, generated: str) -> str:
        """What to append after generated text so the assistant turn ends as the template ends it.

        When the generated text already ends with the end token (say "<|im_end|>" decoded with
        special tokens), only what follows it (the newline) is returned.
        """
        end = self.assistant_end
        token = end.rstrip()
        if token and generated.endswith(token):
            return end[len(token):]
        return end
