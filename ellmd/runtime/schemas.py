"""The validation layer: every op's arguments against a declared schema, before anything runs.

Each op of PROTOCOL.md has a msgspec Struct here (its declaration in ops/ names it); `validate`
converts a request's args into it (types, ranges, required and unknown fields), then checks what a
type cannot say: token ids within the vocabulary, JSON-safe maps (string keys, finite numbers, bounded depth) and rules between
fields. What passes comes back as keyword arguments for the op's handler, with absent (None)
arguments left out, so nothing past this layer sees a wrong type. A failure is one `bad_request`
line naming the field and the rule.

The stored metadata of a session (`StoredMeta`) is declared beside the store (store/meta.py), from
the same field types.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Union

import msgspec

from ellmd.errors import BadRequest

SESSION_ID_PATTERN = r"^[A-Za-z0-9_.-]{1,64}(@[0-9a-f]{16})?$"  # an API key's sessions are kept as ID@SCOPE
INDEX_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # a folder name: no leading dot
OWNER_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
MIN_TEMPERATURE = 1e-2  # below it, logits / temperature overflows float32 for ordinary logits
MAX_JSON_DEPTH = 32
CONSTRAINTS = ("json_schema", "regex", "grammar")  # the Sampling fields that constrain the text
MAX_NOTE_BYTES = 1 << 20  # session.point's note, as msgpack (a stored response: its output and echoed fields)
MAX_DRAFT_TOKENS = 32  # speculative decoding: the longest draft a request may ask for

SessionId = Annotated[str, msgspec.Meta(pattern=SESSION_ID_PATTERN)]
IndexName = Annotated[str, msgspec.Meta(pattern=INDEX_NAME_PATTERN)]
Owner = Annotated[str, msgspec.Meta(pattern=OWNER_PATTERN)]
Text = Annotated[str, msgspec.Meta(max_length=1 << 24)]
Short = Annotated[str, msgspec.Meta(max_length=1024)]
Role = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]
Token = Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]  # the vocabulary bound is checked after
JsonMap = dict[str, Any]  # nested values are checked by json_safe
Path = Annotated[str, msgspec.Meta(min_length=1, max_length=4096, pattern=r"^[^\x00]+$")]  # no NUL: the OS refuses it


class Args(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of every op's arguments."""


class Owned(Args, kw_only=True):
    """Arguments of ops that create or name a session: `owner` is set by the HTTP layer (a
    fingerprint of the caller's API key); a session stored with another owner is not found."""

    owner: Owner | None = None


class Sampling(Owned, kw_only=True):
    """Sampling arguments (PROTOCOL.md, Sampling arguments); ranges as OpenAI's where it has one."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 31)] | None = None  # a generation has a token
    temperature: Annotated[float, msgspec.Meta(ge=0, le=100)] | None = None
    top_k: Count | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(ge=0.01, le=100)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    logit_bias: Annotated[dict[Union[int, str], Annotated[float, msgspec.Meta(ge=-100, le=100)]],
                          msgspec.Meta(max_length=4096)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] | None = None
    stop: Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=256)]],
                    msgspec.Meta(max_length=16)] | None = None
    stop_token_ids: Annotated[list[Token], msgspec.Meta(max_length=256)] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    # constrained decoding (at most one; compiled at submit, see Runtime.submit)
    json_schema: JsonMap | None = None
    regex: Annotated[str, msgspec.Meta(min_length=1, max_length=1 << 16)] | None = None
    grammar: Annotated[str, msgspec.Meta(min_length=1, max_length=1 << 20)] | None = None
    speculative: bool | None = None
    draft_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_DRAFT_TOKENS)] | None = None

    def __post_init__(self):
        constraints = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(constraints) > 1:
            raise ValueError(f"take one constraint, not {' and '.join(constraints)}")
        if constraints and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a constraint (it ends the text itself)")
        if self.temperature is not None and 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE} - at `$.temperature`")
        if self.logit_bias is not None:
            bias = {}
            for key, value in self.logit_bias.items():
                if isinstance(key, str) and not (key.isascii() and key.isdigit() and len(key) < 11):
                    raise ValueError(f"logit_bias keys must be token ids, not {key[:20]!r} - at `$.logit_bias`")
                bias[int(key)] = value
            self.logit_bias = bias


class SessionOpen(Owned, kw_only=True):
    title: Short | None = None
    tags: Annotated[list[Annotated[str, msgspec.Meta(max_length=128)]], msgspec.Meta(max_length=64)] | None = None
    system: Text | None = None
    tools: Annotated[list[JsonMap], msgspec.Meta(max_length=256)] | None = None


class Named(Owned, kw_only=True):
    """Ops whose only argument is the session they name."""

    session_id: SessionId


class SessionAppend(Named, kw_only=True):
    message: JsonMap | None = None
    text: Text | None = None
    tokens: list[Token] | None = None

    def __post_init__(self):
        if sum(x is not None for x in (self.message, self.text, self.tokens)) != 1:
            raise ValueError("session.append takes exactly one of message, text, tokens")


class SessionGenerate(Sampling, kw_only=True):
    session_id: SessionId


class SessionChat(Sampling, kw_only=True):
    session_id: SessionId
    content: Text | None = None
    message: JsonMap | None = None

    def __post_init__(self):
        if (self.content is None) == (self.message is None):
            raise ValueError("session.chat takes content (a user message) or message")
        super().__post_init__()


class SessionFork(Named, kw_only=True):
    title: Short | None = None


class SessionRewind(Named, kw_only=True):
    turn: Count | None = None
    tokens: Count | None = None

    def __post_init__(self):
        if (self.turn is None) == (self.tokens is None):
            raise ValueError("session.rewind takes turn or tokens")


class Completion(Sampling, kw_only=True):
    tokens: Annotated[list[Token], msgspec.Meta(min_length=1)]
    session_id: SessionId | None = None
    messages: list[JsonMap] | None = None
    tools: Annotated[list[JsonMap], msgspec.Meta(max_length=256)] | None = None
    name: Short | None = None  # of the generation's turn: a point session.continue can continue from
    tag: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] | None = None


class SessionContinue(Sampling, kw_only=True):
    session_id: SessionId
    after: Short
    messages: Annotated[list[JsonMap], msgspec.Meta(min_length=1)]
    tools: Annotated[list[JsonMap], msgspec.Meta(max_length=256)] | None = None
    forced: Annotated[str, msgspec.Meta(max_length=4096)] | None = None
    name: Short | None = None

    def __post_init__(self):
        if not all(isinstance(m.get("role"), str) for m in self.messages):
            raise ValueError("every message needs a string role - at `$.messages`")
        super().__post_init__()


class SessionPoint(Named, kw_only=True):
    name: Short  # of a generation turn
    note: JsonMap | None = None
    forget: bool | None = None

    def __post_init__(self):
        if self.note is not None and self.forget:
            raise ValueError("session.point takes note or forget, not both")
        if self.note is not None and len(msgspec.msgpack.encode(self.note)) > MAX_NOTE_BYTES:
            raise ValueError(f"a note is at most {MAX_NOTE_BYTES >> 10} KiB - at `$.note`")


class SessionGrant(Named, kw_only=True):
    key: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] | None = None  # None: the operator's alone


class SkillLoad(Named, kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    file: Path | None = None
    role: Role | None = None
    force: bool | None = None


class RagIndex(Args, kw_only=True):
    path: Path
    name: IndexName | None = None
    retriever: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] | None = None


class RagRemove(Args, kw_only=True):
    name: IndexName


class Document(Args, kw_only=True):
    text: Text
    source: Short | None = None


class RagInject(Named, kw_only=True):
    documents: Annotated[list[Union[Text, Document]], msgspec.Meta(max_length=1024)] | None = None
    query: Annotated[str, msgspec.Meta(min_length=1, max_length=1 << 16)] | None = None
    k: Annotated[int, msgspec.Meta(ge=1, le=100)] | None = None
    index: IndexName | None = None
    role: Role | None = None

    def __post_init__(self):
        if (self.documents is None) == (self.query is None):
            raise ValueError("rag.inject takes documents or a query")


class SessionImport(Owned, kw_only=True):
    data: bytes


class NoArgs(Args, kw_only=True):
    pass


class Hello(Args, kw_only=True):
    protocol: int  # another version than the daemon's is refused with protocol_version
    client: Short | None = None  # the client's name and version, for the log


class Cancel(Args, kw_only=True):
    request_id: int  # an earlier request of the same connection


# Fields holding maps or lists of maps whose nested values must be JSON (the store keeps them).
# `json_schema` must be too; it is checked on the compile thread (a schema may be megabytes).
JSON_FIELDS = ("message", "messages", "tools", "note")


def validate(op: str, schema: type[Args], args, vocab_size: int) -> dict:
    """The handler's keyword arguments for a request of `op` (its arguments declared by `schema`),
    or BadRequest naming the field and rule."""
    if not isinstance(args, dict):
        raise BadRequest(f"{op}: args must be a map")
    try:
        parsed = msgspec.convert(args, schema)
    except msgspec.ValidationError as e:
        raise BadRequest(f"{op}: {describe(e)}") from None
    where = unstorable(args)
    if where is not None:
        raise BadRequest(f"{op}: {where}: {UNSTORABLE}")
    values = {f: getattr(parsed, f) for f in parsed.__struct_fields__}
    for name in JSON_FIELDS:
        if values.get(name) is not None:
            json_safe(values[name], f"{op}: {name}")
    if isinstance(values.get("message"), dict) and not isinstance(values["message"].get("role"), str):
        raise BadRequest(f"{op}: message needs a string role")
    for name in ("tokens", "stop_token_ids"):
        check_vocabulary(op, name, values.get(name), vocab_size)
    if values.get("logit_bias"):
        check_vocabulary(op, "logit_bias", list(values["logit_bias"]), vocab_size)
    if values.get("documents") is not None:
        values["documents"] = [d if isinstance(d, str) else msgspec.structs.asdict(d) for d in values["documents"]]
    return {k: v for k, v in values.items() if v is not None}


def check_vocabulary(op: str, name: str, tokens, vocab_size: int) -> None:
    if isinstance(tokens, list) and tokens and max(tokens) >= vocab_size:
        raise BadRequest(f"{op}: {name}: token ids must be in [0, {vocab_size})")


UNSTORABLE = "text with a lone surrogate (U+D800-U+DFFF) cannot be stored: it is not UTF-8"


def unstorable(value) -> str | None:
    """The path ("messages[0].content", "metadata (a key)") of the first string or key of a
    request that UTF-8 cannot encode (a lone surrogate, which JSON's \\ud800 escape can carry),
    or None. The store keeps text as UTF-8: what it cannot encode is refused at the boundary."""
    try:
        msgspec.msgpack.encode(value)  # fast, and fails on exactly such text
        return None
    except UnicodeEncodeError:
        pass
    except (TypeError, ValueError):  # not encodable for another reason: the schemas say so
        return None
    stack = [(value, "$")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str) and not is_utf8(item):
            return path.removeprefix("$.")
        if isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and not is_utf8(key):
                    return f"{path.removeprefix('$.')} (a key)"
                stack.append((child, f"{path}.{key}"))
        elif isinstance(item, (list, tuple)):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    return None


def is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def json_safe(value, path: str, depth: int = 0) -> None:
    """Refuse what JSON (and so the store and the chat template) cannot hold: non-string keys,
    non-finite numbers, binary, too deep a nesting."""
    if depth > MAX_JSON_DEPTH:
        raise BadRequest(f"{path}: nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise BadRequest(f"{path}: map keys must be strings, not {type(key).__name__}")
            json_safe(item, f"{path}.{key}", depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            json_safe(item, f"{path}[{index}]", depth + 1)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise BadRequest(f"{path}: numbers must be finite")
    elif isinstance(value, int) and not isinstance(value, bool):
        if not -(1 << 63) <= value < (1 << 64):
            raise BadRequest(f"{path}: integer out of range")
    elif not isinstance(value, (str, bool, type(None))):
        raise BadRequest(f"{path}: {type(value).__name__} is not a JSON value")


def describe(error: msgspec.ValidationError) -> str:
    """msgspec's message as `field: rule` ("top_k: Expected `int`, got `float`")."""
    rule, _, where = str(error).partition(" - at `")
    if not where:
        return rule
    where = where.rstrip("`")
    if where.startswith("key` in `"):
        where = where.removeprefix("key` in `") + " (a key)"
    where = where.removeprefix("$.").removeprefix("$") or "args"
    if rule.startswith("Expected `str` matching regex '"):  # say the pattern plainly
        return f"{where} must match {rule.split(chr(39))[1].strip('^$')}"
    return f"{where}: {rule}"
