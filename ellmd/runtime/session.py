"""A session: an append-only token sequence bound to a KV slot, with its turn log.

tokens   ids whose KV is in the slot (or in the store): the truth of what the model saw
pending  ids decided but not yet prefilled: the end of the last assistant turn, which joins
         the next prefill so that a finished turn costs no extra forward pass
turns    [{index, kind, role, name, start, end, messages, time}]: kind is message, text, tokens,
         generation, skill or rag; [start, end) spans tokens + pending; `messages` is how many
         chat messages preceded the turn (so rewinding restores the conversation too)
messages the chat messages as the template rendered them, for rendering the next fragment
state    what runs on it: idle, prefilling (its text tokenized, or its tokens run through the
         model), generating, or writing (its turn is acknowledged once its snapshot is on disk);
         set by the engine loop alone (runtime.py)
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import uuid

import numpy as np

IDLE, PREFILLING, GENERATING, WRITING = "idle", "prefilling", "generating", "writing"


@dataclasses.dataclass
class Session:
    session_id: str
    fingerprint: dict
    title: str = ""
    tags: list[str] = dataclasses.field(default_factory=list)
    created: float = dataclasses.field(default_factory=time.time)
    updated: float = dataclasses.field(default_factory=time.time)
    tokens: list[int] = dataclasses.field(default_factory=list)
    pending: list[int] = dataclasses.field(default_factory=list)
    turns: list[dict] = dataclasses.field(default_factory=list)
    messages: list[dict] = dataclasses.field(default_factory=list)
    tools: list[dict] | None = None
    skills: list[str] = dataclasses.field(default_factory=list)
    owner: str | None = None  # the API key (its fingerprint) that may name it over HTTP; None: the operator's alone
    usage: dict[str, int] = dataclasses.field(default_factory=dict)  # tokens of its life, by counter (tally)
    # runtime state, never stored
    slot: int | None = None
    stored_tokens: int = 0  # KV on disk is valid for tokens[:stored_tokens]
    dirty: bool = True  # metadata changed since the last snapshot
    state: str = IDLE  # IDLE, PREFILLING, GENERATING or WRITING
    last_used: float = dataclasses.field(default_factory=time.monotonic)

    STORED_FIELDS = ("session_id", "fingerprint", "title", "tags", "created", "updated", "pending", "turns",
                     "messages", "tools", "skills", "owner", "usage")

    @classmethod
    def new(cls, fingerprint: dict, title: str = "", tags=None, tools=None, owner=None) -> "Session":
        return cls(session_id=scoped_id(uuid.uuid4().hex[:12], owner), fingerprint=fingerprint, title=title or "",
                   tags=list(tags or []), tools=tools, owner=owner)

    @classmethod
    def from_stored(cls, meta: dict, tokens: list[int]) -> "Session":
        session = cls(**{k: meta[k] for k in cls.STORED_FIELDS if k in meta})
        session.tokens = tokens
        session.stored_tokens = len(tokens)
        session.dirty = False
        return session

    def stored_meta(self) -> dict:
        return {k: getattr(self, k) for k in self.STORED_FIELDS}

    @property
    def busy(self) -> bool:
        """A request is running on it: other requests wait for it, or are refused `busy`."""
        return self.state != IDLE

    @property
    def length(self) -> int:
        """Tokens of the session, pending ones included (tokens is None until a stored session loads)."""
        held = self.stored_tokens if self.tokens is None else len(self.tokens)
        return held + len(self.pending)

    def add_turn(self, kind: str, start: int, role: str | None = None, name: str | None = None,
                 messages: int | None = None) -> dict:
        turn = {"index": len(self.turns), "kind": kind, "role": role, "name": name, "start": start,
                "end": self.length, "messages": len(self.messages) if messages is None else messages,
                "time": time.time()}
        self.turns.append(turn)
        self.touch()
        return turn

    def touch(self) -> None:
        self.updated = time.time()
        self.last_used = time.monotonic()
        self.dirty = True

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (pending included) and the turns that fit in them."""
        keep = [t for t in self.turns if t["end"] <= length]
        messages = self.turns[len(keep)]["messages"] if len(keep) < len(self.turns) else len(self.messages)
        if length >= len(self.tokens):  # pending tokens stay pending: their KV is not in the slot
            self.pending = self.pending[:length - len(self.tokens)]
        else:
            self.tokens, self.pending = self.tokens[:length], []
        self.turns = keep
        self.messages = self.messages[:messages]
        self.skills = [t["name"] for t in keep if t["kind"] == "skill"]
        self.stored_tokens = min(self.stored_tokens, len(self.tokens))
        self.touch()

    def info(self, resident: bool, with_turns: bool = True) -> dict:
        info = {
            "session_id": self.session_id, "title": self.title, "tags": self.tags, "created": self.created,
            "updated": self.updated, "tokens": self.length, "resident": resident, "skills": self.skills,
            "fingerprint": self.fingerprint, "busy": self.busy, "owner": self.owner, "turn_count": len(self.turns),
            "usage": self.usage,
        }
        if with_turns:
            info["turns"] = [{k: t[k] for k in ("index", "kind", "role", "name", "start", "end", "time")}
                             for t in self.turns]
        return info


def tally(counters: dict, session: Session, **amounts: int) -> None:
    """Count tokens (prefilled, reused, shared, generated, drafted, accepted) in the daemon's
    counters and in the session's own usage."""
    for name, amount in amounts.items():
        if amount:  # a session's usage holds only what counted (PROTOCOL.md)
            counters[name] += amount
            session.usage[name] = session.usage.get(name, 0) + amount


SCOPE = "@"  # joins the id a key names a session by and the key's scope (see scoped_id)


def scope(owner: str) -> str:
    """An owner's scope: 16 hex digits of a hash of it."""
    return hashlib.blake2b(owner.encode(), digest_size=8).hexdigest()


def scoped_id(session_id: str, owner: str | None) -> str:
    """The id under which a session an owner names `session_id` is kept: ids are per owner, so that
    no key can take, or learn of, a session another key (or the operator) named alike. The
    operator's sessions (owner None) keep their ids as they are."""
    return session_id if owner is None else f"{session_id}{SCOPE}{scope(owner)}"


def unscoped_id(session_id: str, owner: str | None) -> str:
    """The id an owner knows one of its sessions by (scoped_id undone)."""
    return session_id if owner is None else session_id.removesuffix(SCOPE + scope(owner))


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0])
