"""Ops that generate: session.generate, session.chat, completion, session.continue, and
session.point (the named points a generation leaves, which continue starts from).

Handlers as in ops/sessions.py; one that generates returns steps ending in the Generation it
started, whose reply comes when it ends (Generations, Runtime._settle).
"""

from __future__ import annotations

import copy

from ellmd.errors import CapacityError
from ellmd.runtime import schemas as s
from ellmd.runtime.errors import ProtocolError, not_found
from ellmd.runtime.ops.base import GENERATION, NAMED, TURN, Op, idle
from ellmd.runtime.session import Session, common_prefix
from ellmd.runtime.steps import Then, after, guarded
from ellmd.runtime.turns import Acknowledge, snapshot_of, usage

ANONYMOUS = "anonymous"  # the tag of sessions made by completion requests that named none


def session_generate(rt, request, session_id, **sampling):
    return generate(rt, request, rt.residency.session(session_id, request.owner), sampling)


def session_chat(rt, request, session_id, content=None, message=None, **sampling):
    session = idle(rt.residency.session(session_id, request.owner))
    before = snapshot_of(session)
    message = message if message is not None else {"role": "user", "content": content}
    # one snapshot, after the reply's turn: the message and the reply are acknowledged, or undone, together
    return after(rt.turns.append_message(request, session, message, snapshot=False),
                 lambda _: generate(rt, request, session, sampling, restore=before))


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
    return generate(rt, request, session, sampling, prompt=tokens[keep:], name=name)


def session_continue(rt, request, session_id, after, messages, tools=None, forced="", name=None, **sampling):
    """Generate after chat messages appended at a point of a session: the end of its generation
    turn named `after` (the `name` a completion or an earlier continue gave it).

    At the session's end, the session goes on. Earlier (the conversation was continued from that
    point before), the messages go to a branch: a new session holding the conversation up to the
    point, whose KV is copied from this one (Residency.share_prefix), so that the later turns stay
    as they were and each point can still be continued. Only the new messages are prefilled.
    """
    if rt.engine.chat_template is None:
        raise ProtocolError("bad_request", "this model has no chat template")
    source = idle(rt.residency.session(session_id, request.owner))
    at = next((t["end"] for t in source.turns if t["kind"] == "generation" and t["name"] == after), None)
    if at is None:
        raise ProtocolError("not_found", f"session {session_id} has no generation turn named {after!r} "
                                         "(rewound or deleted since?)")
    rt.residency.resident(source)  # its tokens: what a branch starts from
    session = source if source.length == at else branch(rt, source, at)
    rt.residency.resident(session)  # before anything changes: SlotsBusy runs the op again later
    if session.session_id not in rt.residency.sessions:  # a new branch (a fleet replica leases it)
        rt.residency.adopt(session)

    def encoded(prompt):
        before = snapshot_of(session)
        session.messages.extend(messages)
        session.tools = tools
        if request.emit and sampling.get("stream", True):
            request.emit("session", {"session_id": session.session_id})
        return generate(rt, request, session, sampling, prompt=prompt, restore=before, name=name)
    return Then(rt.turns.encode(request, session, text=forced, messages=messages, generation_prompt=True,
                                tools=tools), encoded)


def session_point(rt, request, session_id, name, note=None, forget=False):
    """A named point of a session: the end of its generation turn named `name`. `note` keeps a
    caller's record with it (an HTTP API's reply, to give it again), written once to the store,
    apart from the session's metadata; `forget` drops its name and note (it can no longer be
    continued or retrieved). Returns the turn as it was found (with its note), with the session's
    tools and system prompt."""
    session = rt.residency.session(session_id, request.owner)
    turn = next((t for t in session.turns if t["kind"] == "generation" and t["name"] == name), None)
    if turn is None:
        raise ProtocolError("not_found", f"session {session_id} has no generation turn named {name!r}")
    found = dict(turn)
    if found.get("note") is None:  # kept apart (a note of an older store is in its turn)
        found.pop("note", None)
        if (kept := rt.residency.note(session.session_id, name)) is not None:
            found["note"] = kept

    def forgotten(_):
        if not forget:
            return None
        rt.residency.resident(session)  # the change is stored with a snapshot, which takes a resident session
        turn["name"] = None
        turn.pop("note", None)
        session.touch()
        return Then(Acknowledge(session), lambda _: None)

    def point(_):
        first = session.messages[0] if session.messages else {}
        return {"session_id": session_id, "turn": found, "tools": session.tools,
                "system": first.get("content") if first.get("role") == "system" else None}
    noted = rt.acknowledged(rt.residency.put_note(session.session_id, name, note)) if note is not None or forget \
        else None
    return after(after(noted, forgotten), point)


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
    """Prefill the generation prompt (rendered, or the given tokens) and start decoding (steps);
    their result is the Generation; `name` names the generation's turn.

    restore: the session before the op (turns.snapshot_of); if the generation fails, from its
    prompt to its last token, the session goes back to it (default: as it is now).
    """
    idle(session)
    restore = restore or snapshot_of(session)
    start = session.length  # the turn opens with the generation prompt
    return after(guarded(lambda: rt.turns.prefill_prompt(request, session, prompt), rt.turns.undo(session, restore)),
                 lambda logits: rt.generations.start(request, session, sampling, start, logits,
                                                     usage(request, session), restore, name))


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


OPS = (
    Op("session.generate", s.SessionGenerate, session_generate, "generation", idle=True, reply=GENERATION,
       errors=TURN),
    Op("session.chat", s.SessionChat, session_chat, "generation", idle=True, reply=GENERATION, errors=TURN),
    Op("completion", s.Completion, completion, "generation", idle=True, reply=GENERATION, errors=TURN),
    Op("session.continue", s.SessionContinue, session_continue, "generation", idle=True, reply=GENERATION,
       errors=TURN),
    Op("session.point", s.SessionPoint, session_point, "generation", reply=("session_id", "turn", "tools", "system"),
       errors=NAMED),
)
