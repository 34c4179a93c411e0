"""A session's metadata as the store keeps it: declared once, checked on every write and import."""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np

from ellmd.errors import BadRequest
from ellmd.runtime.schemas import Count, JsonMap, Owner, SessionId, Token, describe, json_safe


class Turn(msgspec.Struct, forbid_unknown_fields=True):
    index: Count
    kind: Annotated[str, msgspec.Meta(pattern=r"^(message|text|tokens|generation|skill|rag)$")]
    start: Count
    end: Count
    messages: Count
    time: float
    role: str | None = None
    name: str | None = None
    note: JsonMap | None = None  # session.point's note, as stores before notes were kept apart hold it


class StoredMeta(msgspec.Struct, forbid_unknown_fields=True):
    """A session's metadata as the store keeps it (Session.STORED_FIELDS plus counts)."""

    session_id: SessionId
    fingerprint: dict[str, str]
    tokens: Count
    chunks: Count
    title: str = ""
    tags: list[str] = []
    created: float = 0.0
    updated: float = 0.0
    pending: list[Token] = []
    turns: list[Turn] = []
    messages: list[JsonMap] = []
    tools: list[JsonMap] | None = None
    skills: list[str] = []
    owner: Owner | None = None
    usage: dict[str, Annotated[int, msgspec.Meta(ge=0)]] = {}


def check_meta(meta, token_ids=None, vocab_size: int | None = None) -> dict:
    """Validate stored metadata (and, when given, its token ids against the vocabulary); returns it
    as a plain map. Raises BadRequest naming the session and the field."""
    name = meta.get("session_id", "?") if isinstance(meta, dict) else "?"
    try:
        parsed = msgspec.convert(meta, StoredMeta)
    except msgspec.ValidationError as e:
        raise BadRequest(f"session {name!r} has bad metadata: {describe(e)}") from None
    for field_name in ("messages", "tools"):
        if getattr(parsed, field_name) is not None:
            json_safe(getattr(parsed, field_name), f"session {name!r}: {field_name}")
    total = parsed.tokens + len(parsed.pending)
    for turn in parsed.turns:
        if not turn.start <= turn.end <= total or turn.messages > len(parsed.messages):
            raise BadRequest(f"session {name!r} has bad metadata: turn {turn.index} spans [{turn.start}, "
                               f"{turn.end}) outside its {total} tokens")
    if vocab_size is not None:
        for label, ids in (("tokens", token_ids), ("pending", parsed.pending)):
            ids = np.asarray([] if ids is None else ids)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise BadRequest(f"session {name!r} has {label} outside the vocabulary [0, {vocab_size})")
    return msgspec.to_builtins(parsed)
