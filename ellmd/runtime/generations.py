"""Generations: the state machine of a generating session, from its first sampled token to its
closed turn.

started (prompt prefilled, first token sampled) -> decoding (one token per batched decode step,
or several when a draft is kept: speculative decoding, see drafts.py and `verify`) -> finished
(stop, length or cancelled: the assistant turn is closed as the template would close it and
tool calls are parsed) or failed. An ended generation is an `Ended` record in `ended`, which the
engine loop takes after each step (Runtime._settle): it snapshots the turn, or puts a failed one's
session back, and replies.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from ellmd.engine.sampling import Sampler, SamplingParams, verify_draft
from ellmd.errors import EllmError
from ellmd.runtime.drafts import DRAFT_TOKENS, PromptLookup
from ellmd.runtime.errors import ProtocolError
from ellmd.runtime.session import Session, tally
from ellmd.text import IncrementalDetokenizer, StopMatcher, detect_format, parse_tool_calls
from ellmd.text.constraints import Constraint

log = logging.getLogger("ellmd.runtime")


@dataclass
class Generation:
    """A generating session between decode steps."""

    request: object
    session: Session
    sampler: Sampler
    params: SamplingParams
    stream: bool
    logprobs: int  # top log-probabilities to report per generated token (0: none)
    detok: IncrementalDetokenizer
    stopper: StopMatcher
    start: int  # session length when generation began (after the prompt)
    usage: dict
    next_token: int = -1
    generated: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    token_logprobs: list[dict] = field(default_factory=list)
    first_token_at: float | None = None
    restore: tuple = ()  # the session before the op (turns.snapshot_of): a failure goes back to it
    name: str | None = None  # of the turn it logs: a point to continue from (session.continue)
    constraint: Constraint | None = None  # a schema or grammar: masks the logits, consumes the tokens

    def masked(self, logits):
        """This position's logits [V], with the tokens the constraint (if any) refuses masked out."""
        return logits if self.constraint is None else self.constraint.apply(logits)

    def sample(self, logits) -> int:
        """The next token from this position's logits [V], within the constraint if any."""
        return self.sampler(self.masked(logits))
    drafter: PromptLookup | None = None  # None: this generation does not draft
    drafted: int = 0  # draft tokens run through the model
    accepted: int = 0  # of those, tokens the samples agreed with
    steps: int = 0  # decode steps run
    finished: bool = False


@dataclass(eq=False)
class Ended:
    """A generation that ended: its reply's result, or its error (its session is to be put back)."""

    gen: Generation
    result: dict | None = None
    error: Exception | None = None


class Generations:
    """Every generating session; `step` runs one batched decode step over all of them."""

    def __init__(self, engine):
        self.engine = engine
        self.active: list[Generation] = []
        self.ended: list[Ended] = []  # generations ended since the loop last took them
        self.counters = {"generated": 0, "drafted": 0, "accepted": 0}  # since start, over every generation
        self.draft_rows = 0  # draft tokens in the last step (the policy's step-time observations)
        self.observers: list = []  # callables given the final usage of every generation
        template = engine.chat_template
        self.tool_format = detect_format(template.source) if template else None

    def of(self, session: Session) -> Generation | None:
        return next((g for g in self.active if g.session is session), None)

    def start(self, request, session: Session, sampling: dict, start: int, logits, usage: dict,
              restore: tuple, name: str | None = None) -> Generation:
        """Begin decoding after a prefilled prompt: sample the first token from its logits (which
        may end it at once); `name` names the turn it logs."""
        stream = sampling.pop("stream", True)
        logprobs = sampling.pop("logprobs", 0)
        constraint = sampling.pop("constraint", None)
        draft_tokens = sampling.pop("draft_tokens", DRAFT_TOKENS)
        draft_tokens = draft_tokens if sampling.pop("speculative", True) else 0
        params = SamplingParams(**sampling)
        gen = Generation(
            request=request, session=session, sampler=Sampler(params, session.tokens), params=params,
            stream=stream, logprobs=logprobs, detok=IncrementalDetokenizer(self.engine.tokenizer, skip_special_tokens=True),
            stopper=StopMatcher(params.stop), start=start, usage=usage, restore=restore, constraint=constraint,
            name=name,
        )
        gen.drafter = self.drafter(gen, draft_tokens)
        self.active.append(gen)
        try:
            self.accept(gen, gen.sample(logits), logits)
        except Exception as e:
            self.fail(gen, e)
        return gen

    def drafter(self, gen: Generation, draft_tokens: int) -> PromptLookup | None:
        """The draft proposer of a generation, or None where it does not draft (asked not to, or
        no room for a draft). The one place that decides whether a generation may draft; a
        constrained one does too (its drafts cut where the grammar refuses, its rows masked each
        for the state the row before left: `drafts`, `verify`)."""
        if draft_tokens <= 0 or self.engine.step_rows < 2:
            return None
        return PromptLookup(gen.session.tokens, self.engine.kv.sequence_length, draft_tokens)

    def drafts(self, gens: list[Generation], spare: int) -> list[list[int]]:
        """Each generation's draft for the next step, within `spare` rows of the step shared evenly,
        the generation's room in the context and its max_tokens, and cut where its constraint (if
        any) would refuse a token: no sample could agree with the rest."""
        drafting = [g for g in gens if g.drafter is not None]
        share = spare // len(drafting) if drafting else 0
        drafts = []
        for gen in gens:
            if gen.drafter is None or share <= 0:
                drafts.append([])
                continue
            room = min(self.engine.kv.sequence_length - len(gen.session.tokens) - 2,
                       gen.params.max_tokens - len(gen.generated) - 1)
            draft = gen.drafter.propose(min(share, room))
            if gen.constraint:
                draft = draft[: gen.constraint.accepted_prefix(draft)]
            drafts.append(draft)
        return drafts

    def step(self, extend=None, extend_logits: bool = False):
        """One forward over every generating session (each its next token and its draft), and
        extend's prefill tokens (Engine.step); returns extend's logits. A failure ends the
        generations it touched; one of a step that carried a prefill goes up instead, and the loop
        runs the step again without it."""
        gens = list(self.active)
        spare = self.engine.step_rows - len(gens) - (len(extend[1]) if extend is not None else 0)
        rows = [[g.next_token, *draft] for g, draft in zip(gens, self.drafts(gens, spare))]
        for gen in gens:
            if gen.constraint:  # the first row's mask is computed while the forward runs
                gen.constraint.start_mask()
        self.draft_rows = sum(len(r) - 1 for r in rows)
        try:
            logits, last = self.engine.step([g.session.slot for g in gens], rows, extend, extend_logits)
        except Exception as e:
            if extend is not None:
                raise
            for gen in gens:
                self.fail(gen, e)
            return None
        begin = 0
        for gen, tokens in zip(gens, rows):
            try:
                self.verify(gen, tokens, logits[begin : begin + len(tokens)])
            except Exception as e:
                self.fail(gen, e)
            begin += len(tokens)
        return last

    def verify(self, gen: Generation, tokens: list[int], logits) -> None:
        """Take a generation's rows of a step: its next token and its draft (tokens [r], logits
        [r, V]). Row by row: its token joins the session, a token is sampled from its logits (masked
        for the constraint's state after the row before) and accepted as plain decoding would
        (penalties, stops, max_tokens); the next row counts only while the sample agrees with its
        draft token. The rows past the last one kept leave the KV.
        """
        session, drafted, kept = gen.session, len(tokens) - 1, 0
        gen.steps += 1  # counted first: the usage is taken when a row's token ends the generation
        gen.drafted += drafted
        tally(self.counters, session, drafted=drafted)
        for i, row in enumerate(logits):
            session.tokens.append(tokens[i])  # its KV is in the slot
            draft = tokens[i + 1] if i + 1 < len(tokens) else None
            token, agrees = verify_draft(gen.sampler, gen.masked(row), draft)  # row's logits -> sample -> the draft?
            kept += agrees
            gen.accepted += agrees
            tally(self.counters, session, accepted=agrees)
            self.accept(gen, token, row)
            if gen.finished or not agrees:
                break
        self.engine.rewind(session.slot, len(session.tokens))
        if drafted:
            gen.drafter.record(drafted, kept)

    def accept(self, gen: Generation, token: int, logits) -> None:
        """Take a sampled token: stream its text, then finish or keep it for the next decode step."""
        gen.first_token_at = gen.first_token_at or time.perf_counter()
        if gen.logprobs:
            gen.token_logprobs.append(top_logprobs(logits, token, gen.logprobs))
        if gen.constraint:
            gen.constraint.consume(token)
        gen.sampler.accept(token)
        gen.generated.append(token)
        if gen.drafter is not None:
            gen.drafter.push(token)
        tally(self.counters, gen.session, generated=1)
        self.emit(gen, gen.stopper.push(gen.detok.push(token)), [token])
        stops = set(gen.params.stop_token_ids)
        if not gen.params.ignore_eos:
            stops |= set(self.engine.spec.eos_token_id)
        if token in stops or gen.stopper.hit:
            self.finish(gen, "stop")
        elif len(gen.generated) >= gen.params.max_tokens or gen.session.length + 1 >= self.engine.kv.sequence_length:
            self.finish(gen, "length")
        elif gen.request.cancelled.is_set():
            self.finish(gen, "cancelled")
        else:
            gen.next_token = token

    def emit(self, gen: Generation, text: str, token_ids: list[int]) -> None:
        if text:
            gen.text.append(text)
            if gen.stream and gen.request.emit:
                gen.request.emit("token", {"text": text, "token_ids": token_ids})

    def finish(self, gen: Generation, reason: str) -> None:
        """End a generation: close the assistant turn as the template would, log it, its reply's
        result ended (the loop replies once the turn's snapshot is acknowledged)."""
        self.active.remove(gen)
        gen.finished = True
        session = gen.session
        self.emit(gen, gen.stopper.push(gen.detok.flush()) + gen.stopper.flush(), [])
        text = "".join(gen.text)
        messages_before = len(session.messages)
        tool_calls = self.close_turn(gen, text)
        session.add_turn("generation", gen.start, role="assistant", name=gen.name, messages=messages_before)
        usage = self.final_usage(gen)
        for observe in self.observers:
            try:
                observe(usage)
            except Exception:
                log.exception("usage observer failed")
        self.ended.append(Ended(gen, {
            "session_id": session.session_id, "text": text, "token_ids": gen.generated,
            "finish_reason": reason, "tool_calls": tool_calls, "usage": usage,
            **({"content": session.messages[-1]["content"]} if tool_calls else {}),
            **({"logprobs": gen.token_logprobs} if gen.logprobs else {}),
        }))

    def close_turn(self, gen: Generation, text: str) -> list[dict]:
        """End the assistant turn as the template would and log its message; returns its tool calls.

        The last sampled token is not in the KV yet: it joins the next prefill, with the turn's end.
        """
        session, template = gen.session, self.engine.chat_template
        session.pending = [gen.generated[-1]]
        if template is None or not session.messages:
            return []
        generated_text = self.engine.tokenizer.decode(gen.generated)
        session.pending += self.engine.tokenizer.encode(template.end_of_turn(generated_text))
        message, tool_calls = {"role": "assistant", "content": text}, []
        if self.tool_format:
            content, tool_calls = parse_tool_calls(text, self.tool_format, session.tools)
            if tool_calls:
                message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
        session.messages.append(message)
        return tool_calls

    def final_usage(self, gen: Generation) -> dict:
        now, count = time.perf_counter(), len(gen.generated)
        return {**gen.usage, "generated_tokens": count, "decode_steps": gen.steps, "draft_tokens": gen.drafted,
                "accepted_tokens": gen.accepted,
                "ttft_ms": round((gen.first_token_at - gen.request.received) * 1000, 2),
                "decode_tok_s": round((count - 1) / (now - gen.first_token_at), 2) if count > 1 else None}

    def fail(self, gen: Generation, error: Exception) -> None:
        """End one generation that raised, its error (internal unless it is the client's) ended;
        every other generation goes on."""
        request = gen.request
        if not isinstance(error, EllmError):
            log.error("generation failed: op %s, session %s, args %s", request.op, gen.session.session_id,
                      brief(request.args), exc_info=error)
            error = ProtocolError("internal", f"{request.op}: the generation failed: {type(error).__name__}: {error}")
        if gen in self.active:
            self.active.remove(gen)
        self.ended.append(Ended(gen, error=error))

    def end_all(self) -> None:
        """Finish every generation as cancelled (at shutdown)."""
        for gen in list(self.active):
            try:
                self.finish(gen, "cancelled")
            except Exception as e:
                self.fail(gen, e)


def brief(args: dict) -> str:
    """A request's arguments for a log line (long values cut)."""
    return ", ".join(f"{k}={str(v)[:80]}" for k, v in args.items())


def top_logprobs(logits, token: int, count: int) -> dict:
    """The chosen token's log-probability and the `count` most likely tokens' (model distribution)."""
    shifted = logits - logits.max()
    logp = shifted - np.log(np.exp(shifted).sum())
    top = np.argpartition(-logp, count - 1)[:count]
    top = top[np.argsort(-logp[top], kind="stable")]
    return {"token": token, "logprob": float(logp[token]), "top": [[int(t), float(logp[t])] for t in top]}
