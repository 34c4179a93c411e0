"""The scheduling policy: what the engine loop runs next, apart from the loop itself.

The loop alternates one prefill chunk and one batched decode step. The policy decides:
  - the chunk budget: with nobody decoding, a prefill runs whole chunks of the plan (its fastest
    pace); while sessions decode, its tokens ride along their decode step (Engine.step: one
    pass over the weights for both), as many as add about `gap_ratio` times the step's own
    time (both measured as the loop runs), so a decoding session's gap between two tokens
    grows to about (1 + gap_ratio) times its gap alone, whatever the length of the prefill.
    The step's drafts (speculative decoding) take the rows the prefill leaves; a row costs
    about the same whether it is a prefill or a draft token, so steps with drafts measure it too.
    When the step has no room for them (as many decoding sessions as its rows), a chunk runs
    on its own between two steps, cut to what prefills in about `gap_ratio` decode steps;
  - which prefill runs next: the one with the fewest tokens left (a user turn is not queued
    behind a 4k-token document), in arrival order among equals;
  - admission: a request that needs a slot while every slot is busy waits, and is retried once
    a slot is free or held by an idle session;
  - eviction: the idle session whose swap costs least, against how recently it was used: its
    last use plus the seconds it would take to write its KV not yet on disk and to read all of it
    back (GreedyDual-style: a session that is cheap to swap goes before one used as long ago that
    is expensive). Rates are measured as the store runs. Recomputing is never the cheaper way
    back: a prefill costs ~100x a resume per token (scripts/bench_resume.py), so an evicted
    session always comes back from the store.
"""

from __future__ import annotations

from dataclasses import dataclass

EMA = 0.3  # weight of the newest measurement in the running estimates


@dataclass(frozen=True)
class PrefillChunk:
    """Run up to `budget` tokens of a prefill job (turns.Prefill): inside the decode step (`ride`),
    or on its own."""

    job: object
    budget: int
    ride: bool


@dataclass(frozen=True)
class DecodeStep:
    """One batched decode step over every generating session (none when a chunk rode it)."""


class Policy:
    """The engine loop's decisions (tested against a fake engine: tests/test_scheduler.py)."""

    def __init__(self, chunk_size: int, gap_ratio: float | None = 1.0, min_chunk: int = 8):
        self.chunk_size = chunk_size  # the plan's: the most tokens one prefill forward takes
        self.gap_ratio = gap_ratio  # None: every chunk whole (decoding sessions wait for it)
        self.min_chunk = min(min_chunk, chunk_size)  # below it a forward's fixed cost dominates
        self.decode_s: float | None = None  # a decode step's seconds (running estimate)
        self.token_s: float | None = None  # prefill seconds per token, at the chunk sizes run
        self.ride_s: float | None = None  # seconds a row adds to a decode step (a riding prefill token, a draft token)
        self.swap_s = {"write": None, "read": None}  # store seconds per token of KV, each way

    # ---- measurements ----------------------------------------------------------------------

    def observe_decode(self, seconds: float, drafts: int = 0) -> None:
        """A decode step carrying `drafts` draft tokens took `seconds`. decode_s stays the time of
        a step without them (what a riding prefill stretches); a draft's rows cost what riding
        prefill tokens do (one more row each in the same forward), so they measure ride_s."""
        if drafts:
            self.observe_ride(drafts, seconds)
            return
        self.decode_s = seconds if self.decode_s is None else (1 - EMA) * self.decode_s + EMA * seconds

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        per_token = seconds / max(tokens, 1)
        self.token_s = per_token if self.token_s is None else (1 - EMA) * self.token_s + EMA * per_token

    def observe_ride(self, tokens: int, seconds: float) -> None:
        """A decode step carrying `tokens` more rows (prefill tokens, draft tokens) took `seconds`."""
        if self.decode_s is not None:  # what the step alone takes: measured on the steps without
            per_token = max(seconds - self.decode_s, 0.0) / max(tokens, 1)
            self.ride_s = per_token if self.ride_s is None else (1 - EMA) * self.ride_s + EMA * per_token

    def observe_swap(self, way: str, tokens: int, seconds: float) -> None:
        """A snapshot ("write") or resume ("read") moved `tokens` tokens' KV in `seconds`."""
        if tokens:
            per_token, old = seconds / tokens, self.swap_s[way]
            self.swap_s[way] = per_token if old is None else (1 - EMA) * old + EMA * per_token

    def swap_cost(self, session) -> float:
        """Seconds to evict a session (write its unsaved KV) and to resume it later (read it all)."""
        tokens = len(session.tokens or ())
        unsaved = max(tokens - session.stored_tokens, 0)
        return unsaved * (self.swap_s["write"] or 0.0) + tokens * (self.swap_s["read"] or 0.0)

    def stats(self) -> dict:
        """The setting and the running estimates, in ms (None until measured)."""

        def ms(seconds):
            return None if seconds is None else round(seconds * 1000, 3)

        return {"gap_ratio": self.gap_ratio, "decode_step_ms": ms(self.decode_s), "prefill_token_ms": ms(self.token_s),
                "riding_token_ms": ms(self.ride_s)}

    # ---- decisions -------------------------------------------------------------------------

    def budget(self, decoding: int, room: int = 0) -> int:
        """Tokens the next prefill chunk may take while `decoding` sessions generate; room: the
        prefill tokens their decode step can carry. A budget within room rides the step, a
        larger one (gap_ratio None: whole chunks) runs on its own."""
        if not decoding or self.gap_ratio is None:
            return self.chunk_size
        # a riding token has no forward of its own to amortize: one is enough
        per_token, most, least = (self.ride_s, min(room, self.chunk_size), 1) if room > 0 else \
            (self.token_s, self.chunk_size, self.min_chunk)
        if self.decode_s is None or per_token is None:
            return min(most, self.min_chunk)  # not measured yet: the cautious size, measured from then on
        tokens = int(self.gap_ratio * self.decode_s / max(per_token, 1e-9))
        return max(least, min(most, tokens))

    def next_jobs(self, prefills: list, decoding: int, room: int) -> list:
        """What the loop runs when no request is queued: a chunk of the prefill `next_prefill`
        picks, sized by `budget` (riding the decode step where it fits the step's `room`), then the
        decode step of the `decoding` sessions."""
        jobs = []
        job = self.next_prefill(prefills)
        if job is not None:
            budget = self.budget(decoding, room)
            jobs.append(PrefillChunk(job, budget, ride=budget <= room))
        if decoding:
            jobs.append(DecodeStep())
        return jobs

    def next_prefill(self, jobs: list):
        """The prefill job to run a chunk of next (jobs in arrival order), or None."""
        return min(jobs, key=lambda job: job.left, default=None)

    def admit(self, slots: list) -> bool:
        """May requests waiting for a slot be retried? (a slot is free, or its session idle)"""
        return any(s is None or not s.busy for s in slots)

    def victim(self, idle: list):
        """The idle session to evict for another (see the module's notes), or None if there is none."""
        return min(idle, key=lambda s: s.last_used + self.swap_cost(s), default=None)
