"""The protocol's ops, grouped by area, and the one table op -> handler (OPS).

A handler is `handler(rt, request, **args)` with the arguments its schema (schemas.py) let
through. It returns the reply's result, or None when a generation answers later. A handler that
prefills, or waits for a write to the store, is a generator: it yields turns.Prefill jobs and
writer.StoreWrite writes to the engine loop (see Runtime._resume).
Handlers of ops marked `aside` never touch the engine or the sessions and run beside the engine
thread, on a "write" or a "read" thread (SkillLibrary and RagLibrary are thread-safe), so that
indexing a folder never delays a decode step, nor a listing waits for an index run.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ellmd.errors import CapacityError
from ellmd.runtime.errors import RuntimeError_, SlotsBusy, busy, not_found
from ellmd.runtime.residency import visible
from ellmd.runtime.session import Session, common_prefix
from ellmd.runtime.turns import snapshot_of, usage

ANONYMOUS = "anonymous"  # the tag of sessions made by completion requests that named none


@dataclass(frozen=True)
class Op:
    handler: Callable
    aside: str | None = None  # "write" or "read": runs beside the engine thread, on that thread


# ---- guards ---------------------------------------------------------------------------------
# (token ids are checked against the vocabulary at validation, schemas.check_vocabulary)


def idle(session: Session) -> Session:
    """The session, unless a request is running on it (a generation, or a prefill in progress)."""
    if session.busy:
        raise busy(session.session_id)
    return session


def timed(began: float) -> float:
    return round((time.perf_counter() - began) * 1000, 2)


# ---- sessions -------------------------------------------------------------------------------


def session_open(rt, request, title=None, tags=None, system=None, tools=None):
    session = Session.new(rt.fingerprint, title or "", tags, tools, owner=request.owner)
    session.tokens = []
    try:
        if system is not None:  # may wait for a slot (SlotsBusy): register the session only after
            yield from rt.turns.append_message(request, session, {"role": "system", "content": system})
        else:
            yield from rt.after_turn(session)
    except BaseException:  # no ghost: a session that failed to open holds no slot
        rt.residency.release(session)
        raise
    rt.residency.adopt(session)
    return session.info(resident=session.slot is not None)


def session_append(rt, request, session_id, message=None, text=None, tokens=None):
    session = rt.residency.session(session_id, request.owner)
    if message is not None:
        return (yield from rt.turns.append_message(request, session, message))
    if text is not None:
        return (yield from rt.turns.append(request, session, "text", rt.turns.encode(session, text)))
    return (yield from rt.turns.append(request, session, "tokens", tokens))


def session_fork(rt, request, session_id, title=None):
    source = idle(rt.residency.session(session_id, request.owner))
    if source.slot is not None:
        yield from rt.stored(source)  # the copy takes the source as stored
    fork = Session.new(rt.fingerprint, title or f"fork of {source.title or source.session_id}",
                       source.tags, source.tools, owner=source.owner)
    for name in ("pending", "turns", "messages", "skills"):
        setattr(fork, name, copy.deepcopy(getattr(source, name)))
    write = rt.residency.fork(source, fork)
    if rt.snapshot_ack == "written":
        yield write
    return fork.info(resident=False)


def session_rewind(rt, request, session_id, turn=None, tokens=None):
    session = idle(rt.residency.session(session_id, request.owner))
    if turn is not None:
        if not turn < len(session.turns):
            raise RuntimeError_("not_found", f"session {session_id} has no turn {turn!r}")
        length = session.turns[turn]["start"]
    else:
        if not tokens <= session.length:
            raise RuntimeError_("bad_request", f"tokens must be in [0, {session.length}]")
        length = tokens
    slot = rt.residency.resident(session)
    session.truncate(length)
    rt.engine.rewind(slot, len(session.tokens))
    yield from rt.after_turn(session)
    return session.info(resident=True)


def session_snapshot(rt, request, session_id):
    session = rt.residency.session(session_id, request.owner)
    began = time.perf_counter()
    session.dirty = True  # an explicit snapshot always rewrites the metadata
    return {**(yield from rt.stored(session)), "ms": timed(began)}  # on disk, whatever the ack policy


def session_resume(rt, request, session_id):
    session = rt.residency.session(session_id, request.owner)
    began = time.perf_counter()
    rt.residency.resident(session)
    return {"session_id": session_id, "tokens": session.length, "ms": timed(began)}


def session_close(rt, request, session_id):
    session = idle(rt.residency.session(session_id, request.owner))
    snapshotted = session.slot is not None
    if snapshotted:
        yield from rt.stored(session)  # before its slot goes, as for an eviction
    released = rt.residency.forget(session)
    if released is not None:  # a fleet replica: its lease is back before the reply
        yield released
    return {"session_id": session_id, "snapshotted": snapshotted}


def session_release(rt, request, session_id):
    """Hand a session back to the store (a fleet's eviction): snapshotted and on disk, its slot
    freed, dropped from memory and its lease given back. One this daemon does not hold is not an error."""
    session = rt.residency.sessions.get(session_id)
    if session is None or not visible(session.owner, request.owner):
        return {"session_id": session_id, "tokens": None, "released": False}
    idle(session)
    yield from rt.stored(session)  # whatever the ack policy
    tokens = session.length
    released = rt.residency.forget(session)
    if released is not None:
        yield released
    return {"session_id": session_id, "tokens": tokens, "released": True}


def session_delete(rt, request, session_id):
    write = rt.residency.delete(idle(rt.residency.session(session_id, request.owner)))
    if rt.snapshot_ack == "written":
        yield write
    return {"session_id": session_id}


def session_info(rt, request, session_id):
    session = rt.residency.session(session_id, request.owner)
    return session.info(resident=session.slot is not None)


def session_list(rt, request):
    return {"sessions": rt.residency.list(request.owner)}


def session_turns(rt, request, session_id):
    """A session's turns, chat messages and token ids (pending ones included; a session that is not
    resident has them read from the store, its KV left there). The servers add each turn's text
    off the engine thread (turns.with_text)."""
    session = rt.residency.session(session_id, request.owner)
    tokens = session.tokens if session.tokens is not None else rt.residency.stored_tokens(session_id)
    return {"session_id": session_id, "turns": session.info(resident=session.slot is not None)["turns"],
            "messages": session.messages, "token_ids": [*tokens, *session.pending]}


def session_export(rt, request, session_id):
    session = rt.residency.session(session_id, request.owner)
    if session.slot is not None:
        yield from rt.stored(session)
    stored = rt.residency.stored_meta(session_id)  # a busy session is exported as of its last turn
    return {"session_id": session_id, "tokens": stored["tokens"] + len(stored["pending"]),
            "blob": rt.residency.export(session_id)}


def session_import(rt, request, data):
    meta = rt.residency.import_blob(data, request.owner)
    return rt.residency.session(meta["session_id"], request.owner).info(resident=False)


# ---- generation -----------------------------------------------------------------------------


def session_generate(rt, request, session_id, **sampling):
    yield from generate(rt, request, rt.residency.session(session_id, request.owner), sampling)


def session_chat(rt, request, session_id, content=None, message=None, **sampling):
    session = idle(rt.residency.session(session_id, request.owner))
    before = snapshot_of(session)
    message = message if message is not None else {"role": "user", "content": content}
    # one snapshot, after the reply's turn: the message and the reply are acknowledged, or undone, together
    yield from rt.turns.append_message(request, session, message, snapshot=False)
    yield from generate(rt, request, session, sampling, restore=before)


def completion(rt, request, tokens, session_id=None, messages=None, tools=None, name=None, tag=None, **sampling):
    """Generate after a whole prompt, reusing the KV of its longest prefix already computed.

    With session_id, that session (created if new) is rewound to the common prefix; without, the
    resident session of that `tag` (default anonymous) sharing the longest prefix is continued
    (see anonymous_session), so plain OpenAI clients get incremental prefill too. A prompt that
    extends the whole session (its pending end of turn included) rewinds nothing: its turns, and
    the points they name, stay.
    """
    sequence_length = rt.engine.kv.sequence_length
    if len(tokens) + 1 > sequence_length:
        raise CapacityError(f"the prompt holds {len(tokens)} tokens: no room left to generate within "
                            f"the sequence length {sequence_length}")
    owner = request.owner
    if session_id is not None:
        session = bound_session(rt, session_id, owner)
    else:
        session = anonymous_session(rt, tokens, owner, tag or ANONYMOUS)
    try:
        idle(session)
        slot = rt.residency.resident(session)
    except BaseException:  # a new session that did not get a slot gives its lease back (fleet)
        rt.residency.disown(session.session_id)
        raise
    if session.session_id not in rt.residency.sessions:  # new sessions once they hold a slot
        rt.residency.adopt(session)
    held = session.tokens + session.pending
    if len(held) < len(tokens) and common_prefix(held, tokens) == len(held):
        keep = len(held)  # the pending tokens join the prefill
    else:
        # Keep the longest common prefix that is in the KV (pending tokens are not), and at least
        # one prompt token to run, whose logits start the generation.
        keep = min(common_prefix(session.tokens, tokens), len(tokens) - 1)
        if keep < len(session.tokens) or session.pending:
            session.truncate(keep)
            rt.engine.rewind(slot, keep)
    session.messages, session.tools = list(messages or []), tools
    if request.emit and sampling.get("stream", True):  # the caller may not know which session it got
        request.emit("session", {"session_id": session.session_id})
    yield from generate(rt, request, session, sampling, prompt=tokens[keep:], name=name)


def session_continue(rt, request, session_id, after, messages, tools=None, forced="", name=None, **sampling):
    """Generate after chat messages appended at a point of a session: the end of its generation
    turn named `after` (the `name` a completion or an earlier continue gave it).

    At the session's end, the session goes on. Earlier (the conversation was continued from that
    point before), the messages go to a branch: a new session holding the conversation up to the
    point, whose KV is copied from this one (Residency.share_prefix), so that the later turns stay
    as they were and each point can still be continued. Only the new messages are prefilled.
    """
    template = rt.engine.chat_template
    if template is None:
        raise RuntimeError_("bad_request", "this model has no chat template")
    source = idle(rt.residency.session(session_id, request.owner))
    at = next((t["end"] for t in source.turns if t["kind"] == "generation" and t["name"] == after), None)
    if at is None:
        raise RuntimeError_("not_found", f"session {session_id} has no generation turn named {after!r} "
                                         "(rewound or deleted since?)")
    rt.residency.resident(source)  # its tokens: what a branch starts from
    session = source if source.length == at else branch(rt, source, at)
    rt.residency.resident(session)  # before anything changes: SlotsBusy runs the op again later
    if session.session_id not in rt.residency.sessions:  # a new branch (a fleet replica leases it)
        rt.residency.adopt(session)
    text = template.render_fragment(session.messages, messages, tools=tools, add_generation_prompt=True,
                                    allow_rewrite=True)
    prompt = rt.engine.tokenizer.encode(text + forced)
    before = snapshot_of(session)
    session.messages.extend(messages)
    session.tools = tools
    if request.emit and sampling.get("stream", True):
        request.emit("session", {"session_id": session.session_id})
    yield from generate(rt, request, session, sampling, prompt=prompt, restore=before, name=name)


def session_point(rt, request, session_id, name, note=None, forget=False):
    """A named point of a session: the end of its generation turn named `name`. `note` keeps a
    caller's record with it (an HTTP API's reply, to give it again), written once to the store,
    apart from the session's metadata; `forget` drops its name and note (it can no longer be
    continued or retrieved). Returns the turn as it was found (with its note), with the session's
    tools and system prompt."""
    session = rt.residency.session(session_id, request.owner)
    turn = next((t for t in session.turns if t["kind"] == "generation" and t["name"] == name), None)
    if turn is None:
        raise RuntimeError_("not_found", f"session {session_id} has no generation turn named {name!r}")
    found = dict(turn)
    if found.get("note") is None:  # kept apart (a note of an older store is in its turn)
        found.pop("note", None)
        if (kept := rt.residency.note(session.session_id, name)) is not None:
            found["note"] = kept
    if note is not None or forget:
        write = rt.residency.put_note(session.session_id, name, note)
        if rt.snapshot_ack == "written":
            yield write
    if forget:
        rt.residency.resident(session)  # the change is stored with a snapshot, which takes a resident session
        turn["name"] = None
        turn.pop("note", None)
        session.touch()
        yield from rt.after_turn(session)
    first = session.messages[0] if session.messages else {}
    return {"session_id": session_id, "turn": found, "tools": session.tools,
            "system": first.get("content") if first.get("role") == "system" else None}


def session_grant(rt, request, session_id, key=None):
    """Give a session to the API key named `key`, which then reaches it over HTTP by this id (None:
    back to the operator alone). The operator's: sessions made over the socket, or before keys
    were set, are no key's until granted."""
    if key is not None and key not in rt.key_owners:
        raise RuntimeError_("not_found", f"no API key is named {key!r} (the names in api_key_file: "
                                         f"{', '.join(sorted(rt.key_owners)) or 'none'})")
    session = idle(rt.residency.session(session_id, request.owner))
    rt.residency.resident(session)  # the change is stored with a snapshot, which takes a resident session
    session.owner = rt.key_owners.get(key)
    session.touch()
    yield from rt.after_turn(session)
    return {"session_id": session_id, "key": key}


def branch(rt, source: Session, at: int) -> Session:
    """A new session holding `source` up to token `at` (the end of one of its turns), as pending
    tokens: its first prefill copies their KV from `source` instead of computing it."""
    fork = Session.new(rt.fingerprint, f"branch of {source.title or source.session_id}", source.tags,
                       source.tools, owner=source.owner)
    fork.tokens, fork.pending = [], source.tokens + source.pending
    fork.turns, fork.messages = copy.deepcopy(source.turns), copy.deepcopy(source.messages)
    fork.skills = list(source.skills)
    fork.truncate(at)
    return fork


def generate(rt, request, session: Session, sampling: dict, prompt=None, restore: tuple | None = None, name=None):
    """Prefill the generation prompt (rendered, or the given tokens) and start decoding (generator);
    `name` names the generation's turn.

    restore: the session before the op (turns.snapshot_of); if the generation fails, from its
    prompt to its last token, the session goes back to it (default: as it is now).
    """
    idle(session)
    restore = restore or snapshot_of(session)
    start = session.length  # the turn opens with the generation prompt
    try:
        logits = yield from rt.turns.prefill_prompt(request, session, prompt)
    except SlotsBusy:
        raise
    except BaseException:
        rt.turns.restore(session, restore)
        raise
    rt.generations.start(request, session, sampling, start, logits, usage(request, session), restore, name)


def bound_session(rt, session_id: str, owner: str | None) -> Session:
    """The session a completion names, created if new (a fleet replica leases the id first, so
    that no other replica makes it meanwhile). A key names ids in its own scope (Residency.resolve):
    it cannot create one in another's."""
    kept = rt.residency.resolve(session_id, owner)
    if kept not in rt.residency.sessions:
        rt.residency.lease(kept)
    if rt.residency.known(kept):
        return rt.residency.session(kept, owner)
    if owner is not None and kept == session_id:  # an id of another scope: as if it did not exist
        rt.residency.disown(kept)
        raise not_found(session_id)
    session = Session.new(rt.fingerprint, title=session_id, owner=owner)
    session.session_id, session.tokens = kept, []
    return session


def anonymous_session(rt, tokens: list[int], owner: str | None, tag: str = ANONYMOUS) -> Session:
    """The session of that tag to continue: the resident one (of the same owner) sharing the
    longest prefix, or a new one. Only anonymous sessions are ever cut back to make room."""
    residency = rt.residency
    shared, best = max(((common_prefix(s.tokens, tokens), s) for s in residency.resident_sessions()
                        if not s.busy and tag in s.tags and s.owner == owner),
                       key=lambda pair: pair[0], default=(0, None))
    free = residency.free_slot_index()
    if shared and shared == len(best.tokens):
        return best  # the prompt extends that conversation
    if shared and free is None and 2 * shared >= len(best.tokens) and tag == ANONYMOUS:
        return best  # most of it is shared (a retry, an edited turn) and no slot to fork into: drop its tail
    # A new session: its first prefill copies the shared prefix (Residency.share_prefix).
    session = Session.new(rt.fingerprint, title=tag, tags=[tag], owner=owner)
    session.tokens = []
    return session


# ---- skills and retrieval -------------------------------------------------------------------


def skill_list(rt, request):
    return {"skills": rt.skills.list() if rt.skills else []}


def skill_load(rt, request, session_id, name, force=False, role=None, file=None):
    session = rt.residency.session(session_id, request.owner)
    if rt.skills is None:
        raise RuntimeError_("not_found", "no skill roots are configured (--skills-dir)")
    skill = rt.skills.get(name)
    key = skill.name if file is None else f"{skill.name}/{file}"
    if key in session.skills and not force:
        return {"skill": skill.name, "file": file, "loaded": False, "tokens_appended": 0,
                "tokens": session.length, "usage": usage(request, session)}
    message = {"role": rt.turns.role(role), "content": skill.message(file)}
    result = yield from rt.turns.append_message(request, session, message, kind="skill", name=key)
    session.skills.append(key)
    return {"skill": skill.name, "file": file, "loaded": True, **result}


def rag_library(rt):
    if rt.rag is None:
        raise RuntimeError_("not_found", "retrieval is not configured on this daemon")
    return rt.rag


def rag_index(rt, request, path, name="default", retriever=None):
    """Index a folder (aside: indexing never delays a generation)."""
    def progress(data):
        if request.emit:
            request.emit("progress", data)
    return rag_library(rt).index(Path(path), name=name, retriever=retriever, progress=progress,
                                 cancelled=request.cancelled)


def rag_list(rt, request):
    return {"indexes": rag_library(rt).list()}


def rag_remove(rt, request, name):
    return rag_library(rt).remove(name)


def rag_inject(rt, request, session_id, documents=None, query=None, k=None, index="default", role=None):
    session = rt.residency.session(session_id, request.owner)
    if query is not None:
        k = rt.rag_k if k is None else k
        passages = [p.to_dict() for p in rag_library(rt).search(query, k=k, name=index)]
        if not passages:
            return {"passages": [], "tokens_appended": 0, "tokens": session.length, "usage": usage(request, session)}
    else:
        passages = [{"text": d} if isinstance(d, str) else {k: v for k, v in d.items() if v is not None}
                    for d in documents]
    body = "\n\n".join(f"[{i + 1}] {d.get('source') or 'document'}\n{d['text'].strip()}" for i, d in enumerate(passages))
    message = {"role": rt.turns.role(role), "content": "Context passages:\n\n" + body}
    result = yield from rt.turns.append_message(request, session, message, kind="rag", name=query)
    return {"passages": passages, **result}


# ---- the daemon -----------------------------------------------------------------------------


def stats(rt, request):
    return {
        "model": str(rt.engine.model_path), "model_type": rt.engine.spec.model_type,
        **rt.residency.stats(), "generating": len(rt.generations.active),
        "uptime_s": round(time.time() - rt.started, 1), "counters": dict(rt.counters),
        "scheduler": rt.policy.stats(),
    }


def live(rt, request):
    """What the engine is doing now: each slot's session and state, the requests it holds, and the
    `stats` (one op, so that a live view costs the engine loop one request a refresh)."""
    prefills = {job.session.slot: job for job in rt.prefills}
    generations = {gen.session.slot: gen for gen in rt.generations.active}
    now = time.perf_counter()
    slots = [slot_state(i, session, prefills.get(i), generations.get(i), now)
             for i, session in enumerate(rt.residency.slots)]
    return {"slots": slots, "prefilling": len(rt.prefills), "generating": len(rt.generations.active),
            "waiting": len(rt.waiting) + sum(map(len, rt.deferred.values())), "queued": rt.queue.qsize(),
            "stats": stats(rt, request)}


def slot_state(index: int, session: Session | None, prefill, gen, now: float) -> dict:
    """One slot: free, idle (a session resident), prefilling (done of total tokens) or generating (tok/s)."""
    if session is None:
        return {"slot": index, "state": "free", "session_id": None}
    state = {"slot": index, "session_id": session.session_id, "title": session.title, "tokens": session.length,
             "state": "idle"}
    if prefill is not None:
        state.update(state="prefilling", done=prefill.done, total=len(prefill.tokens))
    elif gen is not None:
        count, began = len(gen.generated), gen.first_token_at
        state.update(state="generating", generated=count,
                     tok_s=round((count - 1) / (now - began), 2) if count > 1 and now > began else None)
    return state


OPS: dict[str, Op] = {
    "session.open": Op(session_open), "session.append": Op(session_append), "session.fork": Op(session_fork),
    "session.rewind": Op(session_rewind), "session.snapshot": Op(session_snapshot),
    "session.resume": Op(session_resume), "session.close": Op(session_close), "session.delete": Op(session_delete),
    "session.release": Op(session_release),
    "session.info": Op(session_info), "session.list": Op(session_list), "session.export": Op(session_export),
    "session.import": Op(session_import), "session.turns": Op(session_turns),
    "session.generate": Op(session_generate), "session.chat": Op(session_chat), "completion": Op(completion),
    "session.continue": Op(session_continue), "session.point": Op(session_point),
    "session.grant": Op(session_grant),
    "skill.list": Op(skill_list, aside="read"), "skill.load": Op(skill_load),
    "rag.index": Op(rag_index, aside="write"), "rag.list": Op(rag_list, aside="read"),
    "rag.remove": Op(rag_remove, aside="write"), "rag.inject": Op(rag_inject),
    "stats": Op(stats), "live": Op(live),
}
