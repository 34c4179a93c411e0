"""Turns: appending to a session (rendering a fragment, prefilling it, logging the turn) and
putting a session back as it was when an op fails.

Nothing slow runs here: appending returns steps (steps.py) whose jobs the engine loop runs
(Runtime._run), giving each outcome (or its error) to the step's function: an `Encode` (the text
thread renders and tokenizes a text: the token ids), a `Prefill` (the loop runs its chunks between
decode steps: the logits), an `Acknowledge` (the loop snapshots the finished turn per its policy and
goes on once the turn is acknowledged). Ops that append chain on them (`steps.after`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ellmd.errors import CapacityError
from ellmd.runtime.errors import ProtocolError, SlotsBusy, busy
from ellmd.runtime.session import Session, tally
from ellmd.runtime.steps import Then, after, guarded


@dataclass
class Prefill:
    """Tokens to run through the model into a session's slot, chunk by chunk.

    The session's `tokens` grow only once the whole job is done: until then the KV beyond them
    is scratch, which a cancelled or failed job leaves behind by rewinding the slot.
    """

    request: object
    session: Session
    tokens: list[int]
    need_logits: bool
    done: int = 0  # tokens prefilled so far
    waiter: Then | None = None  # the op's step that waits for the job, resumed with the logits

    @property
    def left(self) -> int:
        return len(self.tokens) - self.done

    def piece(self, budget: int) -> tuple[list[int], bool]:
        """The next chunk (at most `budget` tokens), and whether its last token's logits are wanted."""
        piece = self.tokens[self.done:self.done + max(1, budget)]
        return piece, self.need_logits and self.done + len(piece) == len(self.tokens)

    def run(self, engine, budget: int):
        """Prefill the next chunk on its own; returns the logits once the job is done (None if
        they were not asked for), else None."""
        piece, last = self.piece(budget)
        logits = engine.prefill(self.session.slot, piece, logits="last" if last else "none")
        self.done += len(piece)
        return logits

    def ride(self, generations, budget: int):
        """Prefill the next chunk inside the generations' decode step (Engine.step); returns as run."""
        piece, last = self.piece(budget)
        logits = generations.step(extend=(self.session.slot, piece), extend_logits=last)
        self.done += len(piece)
        return logits


@dataclass(frozen=True)
class Acknowledge:
    """A finished turn of `session`: the loop snapshots it (Runtime.snapshot_turn), and with ack
    "written" goes on with the op once it is on disk (a failed write is the op's error)."""

    session: Session


@dataclass(frozen=True)
class Prefilled:
    """What one prefill of a request did: a line of its log, from which its usage is computed."""

    found: int  # tokens in the session's KV when it began
    kept: int  # of those, tokens not run again (with the prefix copied from another session: `shared`)
    shared: int  # tokens whose KV was copied from another session (Residency.share_prefix)
    ran: int  # tokens run through the model


@dataclass(eq=False)
class Encode:
    """Text to render and tokenize for a session's append, off the engine thread (a long message
    would hold every session's decode steps while it tokenizes): a chat fragment of `messages`
    after `history` (rendered with `tools`), or `text` as it is. The engine thread only sets it up
    (the session cannot change meanwhile: it is prefilling) and gets the token ids back."""

    request: object
    session: Session
    room: int  # tokens the session has left: a text surely longer is refused before it is tokenized
    text: str | None = None  # after the messages' fragment, if any
    history: list | None = None
    messages: list | None = None
    tools: list | None = None
    generation_prompt: bool = False
    waiter: Then | None = None  # the op's step that waits for the job, resumed with the token ids
    future: object = None  # of `run`, on the text thread

    def run(self, engine) -> list[int]:
        """On the text thread: the token ids (CapacityError for a text that surely cannot fit)."""
        text = self.text or ""
        if self.messages is not None:
            text = engine.chat_template.render_fragment(self.history, self.messages, tools=self.tools,
                                                        add_generation_prompt=self.generation_prompt,
                                                        allow_rewrite=True) + text
        if engine.tokenizer.cannot_fit(text, self.room):
            raise CapacityError(f"session {self.session.session_id} has room for {self.room} tokens; a text of "
                                f"{len(text)} characters is more than that (sequence length "
                                f"{engine.kv.sequence_length})")
        return engine.tokenizer.encode(text)


class Turns:
    """Appends and their bookkeeping, over the runtime's engine and residency."""

    def __init__(self, engine, residency, context_role: str):
        self.engine = engine
        self.residency = residency
        self.counters = {"prefilled": 0, "reused": 0, "shared": 0}  # since start, over every request
        self.context_role = context_role  # the role of skill and document messages

    def role(self, role) -> str:
        return role or self.context_role

    def append_message(self, request, session: Session, message, kind="message", name=None, snapshot=True):
        """Render a message as a fragment of the session's conversation and append it (steps)."""
        if self.engine.chat_template is None:
            raise ProtocolError("bad_request", "this model has no chat template: append text or tokens")
        if session.busy:
            raise busy(session.session_id)
        return Then(self.encode(request, session, messages=[message], tools=session.tools),
                    lambda tokens: self.append(request, session, kind, tokens, role=message["role"], name=name,
                                               message=message, snapshot=snapshot))

    def append_text(self, request, session: Session, text: str):
        """Tokenize a text and append it (steps)."""
        if session.busy:
            raise busy(session.session_id)
        return Then(self.encode(request, session, text=text),
                    lambda tokens: self.append(request, session, "text", tokens))

    def encode(self, request, session: Session, text: str | None = None, messages: list | None = None,
               generation_prompt: bool = False, tools=None) -> Encode:
        """The job that turns chat messages after the session's (rendered with `tools`), then a
        text, into the tokens to append."""
        room = self.engine.kv.sequence_length - session.length
        return Encode(request, session, room, text=text, history=list(session.messages), messages=messages,
                      tools=tools, generation_prompt=generation_prompt)

    def append(self, request, session: Session, kind: str, tokens: list[int], role=None, name=None, message=None,
               snapshot=True):
        """Prefill a turn's tokens and log the turn (steps); their result is the reply's. snapshot:
        False when the turn is the first half of a request whose end is snapshotted (a chat's message)."""
        if session.busy:
            raise busy(session.session_id)
        start, messages_before = session.length, len(session.messages)

        def logged(_):
            if message is not None:
                session.messages.append(message)
            session.add_turn(kind, start, role=role, name=name, messages=messages_before)
            return Then(Acknowledge(session), lambda _: None) if snapshot else None

        appended = guarded(lambda: after(self.prefill(request, session, tokens, need_logits=False), logged),
                           self.undo(session))  # a turn that reports an error has not been appended
        return after(appended, lambda _: {"tokens_appended": len(tokens), "tokens": session.length,
                                          "usage": usage(request, session)})

    def undo(self, session: Session, before: tuple | None = None):
        """The failure handler (steps.guarded) of an op that changes a session: the session goes back
        to `before` (default: as it is now) and the error is the op's. One waiting for a slot
        (SlotsBusy) is left: the op runs again once a slot may be free."""
        before = before or snapshot_of(session)

        def undo(error):
            if not isinstance(error, SlotsBusy):
                self.restore(session, before)
            raise error
        return undo

    def prefill(self, request, session: Session, new_tokens: list[int], need_logits: bool):
        """Append tokens (after the session's pending ones) to its KV (steps); their result is the
        last position's logits when asked, else None."""
        sequence_length = self.engine.kv.sequence_length
        if session.length + len(new_tokens) > sequence_length:  # before it takes a slot
            raise CapacityError(
                f"session {session.session_id} holds {session.length} tokens; adding {len(new_tokens)} "
                f"would exceed the sequence length {sequence_length}"
            )
        slot = self.residency.resident(session)
        found, shared = len(session.tokens), 0
        tokens = session.pending + list(new_tokens)
        if not session.tokens and tokens:  # a new session: its first tokens may be another's prefix
            shared = self.residency.share_prefix(session, tokens, limit=len(tokens) - need_logits)
            if shared:
                session.tokens, session.pending, tokens = tokens[:shared], [], tokens[shared:]
        if not tokens and need_logits:
            if not session.tokens:
                raise ProtocolError("bad_request", f"session {session.session_id} is empty: append something first")
            # Nothing new: recompute the last position's logits by running its token again.
            tokens = [session.tokens.pop()]
            self.engine.rewind(slot, len(session.tokens))
        kept = len(session.tokens)

        def prefilled(logits):
            if tokens:
                session.tokens.extend(tokens)
                session.pending = []
            self.log(request, session, Prefilled(found, kept, shared, len(tokens)))
            return logits
        return Then(Prefill(request, session, tokens, need_logits), prefilled) if tokens else prefilled(None)

    def log(self, request, session: Session, prefilled: Prefilled) -> None:
        """Keep what a prefill did in its request's log (its usage) and count it, for the daemon and
        the session."""
        first = not request.prefilled
        request.prefilled.append(prefilled)
        tally(self.counters, session, reused=(prefilled.found if first else 0) + prefilled.shared,
              shared=prefilled.shared, prefilled=prefilled.ran)

    def prefill_prompt(self, request, session: Session, prompt):
        """Prefill the generation prompt (rendered, or the given tokens) (steps); their result is
        the logits of its last position."""
        if prompt is None and self.engine.chat_template is not None and session.messages:
            return Then(self.encode(request, session, messages=[], generation_prompt=True, tools=session.tools),
                        lambda tokens: self.prefill_tokens(request, session, tokens))
        return self.prefill_tokens(request, session, prompt or [])

    def prefill_tokens(self, request, session: Session, prompt: list[int]):
        """Prefill a generation prompt's tokens (steps), refused if no room is left to generate."""
        sequence_length = self.engine.kv.sequence_length
        if session.length + len(prompt) + 1 > sequence_length:
            raise CapacityError(
                f"session {session.session_id} holds {session.length} tokens: no room left to generate "
                f"within the sequence length {sequence_length}"
            )
        return self.prefill(request, session, prompt, need_logits=True)

    def restore(self, session: Session, before: tuple) -> None:
        """Put a session back as it was before a failed op (`snapshot_of`): a cut, no recompute."""
        length, messages, updated = before
        if session.tokens is None:
            return
        if length < session.length:
            session.truncate(length)
        del session.messages[messages:]
        session.updated = updated
        if session.slot is not None:
            self.engine.rewind(session.slot, min(len(session.tokens), int(self.engine.kv.lengths[session.slot])))


def snapshot_of(session: Session) -> tuple:
    """What Turns.restore needs to put a session back as it is now."""
    return session.length, len(session.messages), session.updated


def usage(request, session: Session) -> dict:
    """Usage of this request so far, from its log of prefills: what it ran through the model and
    what it found already computed (the least KV any of its prefills kept: a prefill with nothing
    new recomputes the session's last token)."""
    log = request.prefilled
    return {"prompt_tokens": session.length, "prefilled_tokens": sum(p.ran for p in log),
            "reused_tokens": min((p.kept for p in log), default=None), "shared_tokens": sum(p.shared for p in log),
            "prefill_ms": round((time.perf_counter() - request.received) * 1000, 2)}


def with_text(result: dict, tokenizer) -> dict:
    """session.turns' result as the servers send it: each turn with its token count, its token ids
    and its text (special tokens kept: what the model saw), decoded off the engine thread."""
    ids = result["token_ids"]
    turns = []
    for turn in result["turns"]:
        span = ids[turn["start"]:turn["end"]]
        turns.append({**turn, "tokens": len(span), "token_ids": span,
                      "text": tokenizer.decode(span) if tokenizer is not None else None})
    return {"session_id": result["session_id"], "turns": turns, "messages": result["messages"]}
