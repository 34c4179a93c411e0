"""The record that declares an op (Op), and the guards handlers share."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ellmd.errors import CODES
from ellmd.runtime import schemas
from ellmd.runtime.errors import busy
from ellmd.runtime.session import Session

AREAS = ("sessions", "generation", "context", "admin")
RUNS = ("engine", "read", "write", "connection")
UPLOAD_FIELDS = ("upload", "more")  # what a piece of an upload carries beside the argument (PROTOCOL.md)

# Replies: their fields as PROTOCOL.md writes them ("name?": only in some replies)
SESSION_INFO = ("session_id", "title", "tags", "created", "updated", "tokens", "resident", "busy", "turns",
                "skills", "fingerprint", "owner", "turn_count", "usage")
GENERATION = ("session_id", "text", "token_ids", "finish_reason", "tool_calls", "usage", "content?", "logprobs?")
APPENDED = ("tokens_appended", "tokens", "usage")
INDEX = ("name", "path", "retriever", "files", "chunks", "updated")

# Errors an op may answer besides those of any op (bad_request, cancelled, internal; busy when a
# limit is reached): PROTOCOL.md's Errors by op.
NAMED = ("not_found", "leased", "fingerprint", "store")  # finding the session it names (in the store)
TURN = (*NAMED, "busy", "capacity")  # appending to it


@dataclass(frozen=True)
class Op:
    """One op of PROTOCOL.md, declared once.

    runs: where its handler runs. "engine": on the engine thread, `handler(rt, request, **args)`;
    "read" or "write": aside, on that thread beside the engine thread (it never touches the engine
    or the sessions), same signature; "connection": by the socket server, `handler(link, **args)`
    with the connection it came on (ops/admin.py says what a link offers).
    idle: its session must not be running another request (else `busy`; the handler checks it
    with `idle`). upload: the argument that may come in pieces (collected by the socket server);
    download: the result's field that goes back in pieces (`chunk` events, the reply holding its
    length as `bytes` instead). finish: `finish(result, tokenizer)`, what a server applies to the
    result before replying, on a thread of its own (slow work kept off the engine thread and off
    the server's loop). reply: the reply's fields, as the client gets them. errors: the codes it may
    answer besides those of any op (`busy` exactly when `idle`).
    """

    name: str
    schema: type[schemas.Args]
    handler: Callable
    area: str
    runs: str = "engine"
    idle: bool = False
    reply: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()
    upload: str | None = None
    download: str | None = None
    finish: Callable | None = None

    def __post_init__(self):
        if self.area not in AREAS or self.runs not in RUNS:
            raise ValueError(f"op {self.name}: area {self.area!r} or runs {self.runs!r} is not one of {AREAS}, {RUNS}")
        if not set(self.errors) <= set(CODES):
            raise ValueError(f"op {self.name}: {set(self.errors) - set(CODES)} are not error codes of CODES")

    @property
    def aside(self) -> str | None:
        """The thread beside the engine thread it runs on ("read", "write"), or None."""
        return self.runs if self.runs in ("read", "write") else None

    def arguments(self, args, vocab_size: int) -> dict:
        """The handler's keyword arguments for a request's args, or BadRequest (schemas.validate)."""
        return schemas.validate(self.name, self.schema, args, vocab_size)


# ---- guards ---------------------------------------------------------------------------------
# (token ids are checked against the vocabulary at validation, schemas.check_vocabulary)


def idle(session: Session) -> Session:
    """The session, unless a request is running on it (a generation, or a prefill in progress)."""
    if session.busy:
        raise busy(session.session_id)
    return session


def timed(began: float) -> float:
    return round((time.perf_counter() - began) * 1000, 2)
