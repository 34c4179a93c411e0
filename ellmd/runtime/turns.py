"""Turns: appending to a session (rendering a fragment, prefilling it, logging the turn) and
putting a session back as it was when an op fails.

A prefill is not run here: `prefill` is a generator that yields a `Prefill` job to the engine
loop and gets the logits back when the job is done (or its error thrown in), so the loop decides
when its chunks run (between decode steps). Ops that prefill are generators too (`yield from`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ellmd.errors import CapacityError
from ellmd.runtime.errors import ProtocolError, SlotsBusy, busy
from ellmd.runtime.session import Session, tally


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
    handler: object = None  # the op's generator that yielded the job, resumed when it ends

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


class Turns:
    """Appends and their bookkeeping, over the runtime's engine and residency."""

    def __init__(self, engine, residency, counters: dict, context_role: str, after_turn):
        self.engine = engine
        self.residency = residency
        self.counters = counters
        self.after_turn = after_turn  # after_turn(session): the snapshot policy (a generator: it may wait for the write)
        self.context_role = context_role  # the role of skill and document messages

    def role(self, role) -> str:
        return role or self.context_role

    def append_message(self, request, session: Session, message, kind="message", name=None, snapshot=True):
        """Render a message as a fragment of the session's conversation and append it (generator)."""
        template = self.engine.chat_template
        if template is None:
            raise ProtocolError("bad_request", "this model has no chat template: append text or tokens")
        text = template.render_fragment(session.messages, [message], tools=session.tools,
                                        add_generation_prompt=False, allow_rewrite=True)
        return (yield from self.append(request, session, kind, self.encode(session, text),
                                       role=message["role"], name=name, message=message, snapshot=snapshot))

    def encode(self, session: Session, text: str) -> list[int]:
        """The tokens of a text to append; CapacityError before encoding one that surely cannot fit
        (a megabytes-long text would hold this thread, and every generation, for seconds)."""
        room = self.engine.kv.sequence_length - session.length
        if self.engine.tokenizer.cannot_fit(text, room):
            raise CapacityError(f"session {session.session_id} has room for {room} tokens; a text of "
                                f"{len(text)} characters is more than that (sequence length "
                                f"{self.engine.kv.sequence_length})")
        return self.engine.tokenizer.encode(text)

    def append(self, request, session: Session, kind: str, tokens: list[int], role=None, name=None, message=None,
               snapshot=True):
        """Prefill a turn's tokens and log the turn (generator); returns the reply's result. snapshot:
        False when the turn is the first half of a request whose end is snapshotted (a chat's message)."""
        if session.busy:
            raise busy(session.session_id)
        start, messages_before = session.length, len(session.messages)
        before = snapshot_of(session)
        try:
            yield from self.prefill(request, session, tokens, need_logits=False)
            if message is not None:
                session.messages.append(message)
            session.add_turn(kind, start, role=role, name=name, messages=messages_before)
            if snapshot:
                yield from self.after_turn(session)
        except SlotsBusy:
            raise
        except BaseException:  # a turn that reports an error has not been appended
            self.restore(session, before)
            raise
        return {"tokens_appended": len(tokens), "tokens": session.length, "usage": usage(request, session)}

    def prefill(self, request, session: Session, new_tokens: list[int], need_logits: bool):
        """Append tokens (after the session's pending ones) to its KV (generator); returns the
        last position's logits when asked, else None."""
        sequence_length = self.engine.kv.sequence_length
        if session.length + len(new_tokens) > sequence_length:  # before it takes a slot
            raise CapacityError(
                f"session {session.session_id} holds {session.length} tokens; adding {len(new_tokens)} "
                f"would exceed the sequence length {sequence_length}"
            )
        slot = self.residency.resident(session)
        if request.reused is None:
            request.reused = len(session.tokens)
            tally(self.counters, session, reused=request.reused)
        tokens = session.pending + list(new_tokens)
        if not session.tokens and tokens:  # a new session: its first tokens may be another's prefix
            shared = self.residency.share_prefix(session, tokens, limit=len(tokens) - need_logits)
            if shared:
                session.tokens, session.pending, tokens = tokens[:shared], [], tokens[shared:]
                request.reused += shared
                request.shared += shared
                tally(self.counters, session, reused=shared, shared=shared)
                if not tokens:
                    return None
        if not tokens:
            if not need_logits:
                return None
            if not session.tokens:
                raise ProtocolError("bad_request", f"session {session.session_id} is empty: append something first")
            # Nothing new: recompute the last position's logits by running its token again.
            tokens = [session.tokens.pop()]
            self.engine.rewind(slot, len(session.tokens))
            request.reused = min(request.reused, len(session.tokens))
        logits = yield Prefill(request, session, tokens, need_logits)
        session.tokens.extend(tokens)
        session.pending = []
        request.prefilled += len(tokens)
        tally(self.counters, session, prefilled=len(tokens))
        return logits

    def prefill_prompt(self, request, session: Session, prompt):
        """Prefill the generation prompt (rendered, or the given tokens) (generator); returns the
        logits of its last position."""
        template = self.engine.chat_template
        if prompt is None and template is not None and session.messages:
            text = template.render_fragment(session.messages, [], tools=session.tools,
                                            add_generation_prompt=True, allow_rewrite=True)
            prompt = self.engine.tokenizer.encode(text)
        prompt = prompt or []
        sequence_length = self.engine.kv.sequence_length
        if session.length + len(prompt) + 1 > sequence_length:
            raise CapacityError(
                f"session {session.session_id} holds {session.length} tokens: no room left to generate "
                f"within the sequence length {sequence_length}"
            )
        return (yield from self.prefill(request, session, prompt, need_logits=True))

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
    """Usage of this request so far: what it prefilled and what it found already computed."""
    return {"prompt_tokens": session.length, "prefilled_tokens": request.prefilled,
            "reused_tokens": request.reused, "shared_tokens": request.shared,
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
