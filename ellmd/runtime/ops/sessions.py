"""Ops on sessions as a whole: open, append, fork, rewind, snapshot, resume, close, release, delete,
grant, info, list, export, import.

A handler is `handler(rt, request, **args)` with the arguments its schema let through. It returns
the reply's result. A handler that prefills, or waits for a write to the store, returns steps
instead (steps.py): a job record (turns.Encode, turns.Prefill, turns.Acknowledge, writer.StoreWrite)
for the engine loop to run and the function that takes its outcome on (see Runtime._run).
"""

from __future__ import annotations

import copy
import time

from ellmd.runtime import schemas as s
from ellmd.runtime.errors import ProtocolError
from ellmd.runtime.ops.base import APPENDED, NAMED, SESSION_INFO, TURN, Op, idle, timed
from ellmd.runtime.residency import visible
from ellmd.runtime.session import Session
from ellmd.runtime.steps import Then, after, guarded, wait
from ellmd.runtime.turns import Acknowledge, with_text


def session_open(rt, request, title=None, tags=None, system=None, tools=None):
    session = Session.new(rt.fingerprint, title or "", tags, tools, owner=request.owner)
    session.tokens = []

    def first_turn():  # may wait for a slot (SlotsBusy): register the session only after
        if system is not None:
            return rt.turns.append_message(request, session, {"role": "system", "content": system})
        return wait(Acknowledge(session))

    def ghost(error):  # no ghost: a session that failed to open holds no slot
        rt.residency.release(session)
        raise error

    def opened(_):
        rt.residency.adopt(session)
        return session.info(resident=session.slot is not None)
    return after(guarded(first_turn, ghost), opened)


def session_append(rt, request, session_id, message=None, text=None, tokens=None):
    session = rt.residency.session(session_id, request.owner)
    if message is not None:
        return rt.turns.append_message(request, session, message)
    if text is not None:
        return rt.turns.append_text(request, session, text)
    return rt.turns.append(request, session, "tokens", tokens)


def session_fork(rt, request, session_id, title=None):
    source = idle(rt.residency.session(session_id, request.owner))

    def copied(_):
        fork = Session.new(rt.fingerprint, title or f"fork of {source.title or source.session_id}",
                           source.tags, source.tools, owner=source.owner)
        for name in ("pending", "turns", "messages", "skills"):
            setattr(fork, name, copy.deepcopy(getattr(source, name)))
        return after(rt.acknowledged(rt.residency.fork(source, fork)), lambda _: fork.info(resident=False))
    # the copy takes the source as stored
    return after(rt.stored(source) if source.slot is not None else None, copied)


def session_rewind(rt, request, session_id, turn=None, tokens=None):
    session = idle(rt.residency.session(session_id, request.owner))
    if turn is not None:
        if not turn < len(session.turns):
            raise ProtocolError("not_found", f"session {session_id} has no turn {turn!r}")
        length = session.turns[turn]["start"]
    else:
        if not tokens <= session.length:
            raise ProtocolError("bad_request", f"tokens must be in [0, {session.length}]")
        length = tokens
    slot = rt.residency.resident(session)
    session.truncate(length)
    rt.engine.rewind(slot, len(session.tokens))
    return Then(Acknowledge(session), lambda _: session.info(resident=True))


def session_snapshot(rt, request, session_id):
    session = rt.residency.session(session_id, request.owner)
    began = time.perf_counter()
    session.dirty = True  # an explicit snapshot always rewrites the metadata
    return after(rt.stored(session), lambda stored: {**stored, "ms": timed(began)})  # on disk, whatever the ack policy


def session_resume(rt, request, session_id):
    session = rt.residency.session(session_id, request.owner)
    began = time.perf_counter()
    rt.residency.resident(session)
    return {"session_id": session_id, "tokens": session.length, "ms": timed(began)}


def session_close(rt, request, session_id):
    session = idle(rt.residency.session(session_id, request.owner))
    snapshotted = session.slot is not None
    # stored before its slot goes, as for an eviction
    return after(after(rt.stored(session) if snapshotted else None, lambda _: forget(rt, session)),
                 lambda _: {"session_id": session_id, "snapshotted": snapshotted})


def forget(rt, session: Session):
    """Drop a session from memory (steps): a fleet replica's lease is back before the reply."""
    released = rt.residency.forget(session)
    return wait(released) if released is not None else None


def session_release(rt, request, session_id):
    """Hand a session back to the store (a fleet's eviction): snapshotted and on disk, its slot
    freed, dropped from memory and its lease given back. One this daemon does not hold is not an error."""
    session = rt.residency.sessions.get(session_id)
    if session is None or not visible(session.owner, request.owner):
        return {"session_id": session_id, "tokens": None, "released": False}
    idle(session)

    def stored(_):
        tokens = session.length
        return after(forget(rt, session), lambda _: {"session_id": session_id, "tokens": tokens, "released": True})
    return after(rt.stored(session), stored)  # whatever the ack policy


def session_delete(rt, request, session_id):
    """Remove a session; in a fleet its lease is back before the reply, so that the next replica
    asked finds no session rather than one held."""
    session = idle(rt.residency.session(session_id, request.owner))
    write = rt.residency.delete(session)
    released = forget(rt, session)  # out of memory at once (no op finds it meanwhile); the lease after the removal
    return after(rt.acknowledged(write), lambda _: after(released, lambda _: {"session_id": session_id}))


def session_grant(rt, request, session_id, key=None):
    """Give a session to the API key named `key`, which then reaches it over HTTP by this id (None:
    back to the operator alone). The operator's: sessions made over the socket, or before keys
    were set, are no key's until granted."""
    if key is not None and key not in rt.key_owners:
        raise ProtocolError("not_found", f"no API key is named {key!r} (the names in api_key_file: "
                                         f"{', '.join(sorted(rt.key_owners)) or 'none'})")
    session = idle(rt.residency.session(session_id, request.owner))
    rt.residency.resident(session)  # the change is stored with a snapshot, which takes a resident session
    session.owner = rt.key_owners.get(key)
    session.touch()
    return Then(Acknowledge(session), lambda _: {"session_id": session_id, "key": key})


def session_info(rt, request, session_id):
    session = rt.residency.session(session_id, request.owner)
    return session.info(resident=session.slot is not None)


def session_list(rt, request):
    return {"sessions": rt.residency.list(request.owner)}


def session_export(rt, request, session_id):
    session = rt.residency.session(session_id, request.owner)

    def exported(_):
        stored = rt.residency.stored_meta(session_id)  # a busy session is exported as of its last turn
        return {"session_id": session_id, "tokens": stored["tokens"] + len(stored["pending"]),
                "blob": rt.residency.export(session_id)}
    return after(rt.stored(session) if session.slot is not None else None, exported)


def session_import(rt, request, data):
    meta = rt.residency.import_blob(data, request.owner)
    return rt.residency.session(meta["session_id"], request.owner).info(resident=False)


def session_turns(rt, request, session_id):
    """A session's turns, chat messages and token ids (pending ones included; a session that is not
    resident has them read from the store, its KV left there). Each turn's text is added off the
    engine thread (turns.with_text, the op's finish)."""
    session = rt.residency.session(session_id, request.owner)
    tokens = session.tokens if session.tokens is not None else rt.residency.stored_tokens(session_id)
    return {"session_id": session_id, "turns": session.info(resident=session.slot is not None)["turns"],
            "messages": session.messages, "token_ids": [*tokens, *session.pending]}


OPS = (
    Op("session.open", s.SessionOpen, session_open, "sessions", reply=SESSION_INFO, errors=("capacity", "store")),
    Op("session.append", s.SessionAppend, session_append, "sessions", idle=True, reply=APPENDED, errors=TURN),
    Op("session.fork", s.SessionFork, session_fork, "sessions", idle=True, reply=SESSION_INFO,
       errors=(*NAMED, "busy")),
    Op("session.rewind", s.SessionRewind, session_rewind, "sessions", idle=True, reply=SESSION_INFO,
       errors=(*NAMED, "busy")),
    Op("session.snapshot", s.Named, session_snapshot, "sessions",
       reply=("chunks_written", "bytes_written", "stored_tokens", "ms"), errors=NAMED),
    Op("session.resume", s.Named, session_resume, "sessions", reply=("session_id", "tokens", "ms"), errors=NAMED),
    Op("session.close", s.Named, session_close, "sessions", idle=True, reply=("session_id", "snapshotted"),
       errors=(*NAMED, "busy")),
    Op("session.release", s.Named, session_release, "sessions", idle=True, reply=("session_id", "tokens", "released"),
       errors=("busy", "store")),
    Op("session.delete", s.Named, session_delete, "sessions", idle=True, reply=("session_id",),
       errors=(*NAMED, "busy")),
    Op("session.grant", s.SessionGrant, session_grant, "sessions", idle=True, reply=("session_id", "key"),
       errors=(*NAMED, "busy")),
    Op("session.info", s.Named, session_info, "sessions", reply=SESSION_INFO, errors=NAMED),
    Op("session.list", s.Owned, session_list, "sessions", reply=("sessions",), errors=("store",)),
    Op("session.export", s.Named, session_export, "sessions", download="blob",
       reply=("session_id", "tokens", "bytes"), errors=NAMED),
    Op("session.import", s.SessionImport, session_import, "sessions", upload="data", reply=SESSION_INFO,
       errors=("not_found", "fingerprint", "store")),
    Op("session.turns", s.Named, session_turns, "sessions", finish=with_text, reply=("session_id", "turns", "messages"),
       errors=NAMED),
)
