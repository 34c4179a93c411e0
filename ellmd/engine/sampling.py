"""Sampling: logits processors and samplers as plain callables.

Shapes: logits [V] f32 (one sequence at a time; the batched forward hands out one row per slot).
Order as vLLM and transformers: penalties, logit bias, temperature, top-k, top-p, min-p, draw.
Processing runs in float64 and never lets a NaN reach the RNG: NaN logits count as -inf, +inf ones
share the mass, and when nothing is left (every token at -inf) the model's own argmax is taken.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class SamplingParams:
    """What to generate and when to stop. temperature 0 means greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        checks = [
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Picks the next token of one sequence; holds the RNG and the token counts for penalties."""

    def __init__(self, params: SamplingParams, prompt_tokens=()):
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.seen = set(int(t) for t in prompt_tokens)  # repetition penalty: prompt and output
        self.counts: dict[int, int] = {}  # presence/frequency penalties: output only, as OpenAI
        p = params
        self.plain_greedy = p.greedy and not p.logit_bias and not self._penalised()

    def _penalised(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    def __call__(self, logits: np.ndarray) -> int:
        if self.plain_greedy:
            return int(np.argmax(logits))
        with np.errstate(all="ignore"):  # overflows become inf, handled below
            processed = self.process(logits.astype(np.float64))
        processed[np.isnan(processed)] = -np.inf
        if processed.max() == -np.inf:  # everything banned or broken: the model's own choice
            return int(np.argmax(np.where(np.isnan(logits), -np.inf, logits)))
        return int(np.argmax(processed)) if self.params.greedy else self.draw(processed)

    def accept(self, token: int) -> None:
        """Record a generated token (for the penalties)."""
        self.seen.add(token)
        self.counts[token] = self.counts.get(token, 0) + 1

    def process(self, logits: np.ndarray) -> np.ndarray:
        p = self.params
        if p.repetition_penalty != 1.0 and self.seen:
            ids = np.fromiter(self.seen, np.int64)
            values = logits[ids]
            logits[ids] = np.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.counts:
            ids = np.fromiter(self.counts.keys(), np.int64)
            counts = np.fromiter(self.counts.values(), np.float32)
            logits[ids] -= p.presence_penalty + p.frequency_penalty * counts
        for token, bias in p.logit_bias.items():
            logits[int(token)] += bias
        return logits

    def draw(self, logits: np.ndarray) -> int:
        """Draw from processed float64 logits (no NaN, at least one above -inf)."""
        p = self.params
        if np.isposinf(logits.max()):  # the +inf tokens take all the mass, evenly
            logits = np.where(np.isposinf(logits), 0.0, -np.inf)
        with np.errstate(over="ignore", invalid="ignore"):
            logits = logits / p.temperature
        logits[np.isnan(logits)] = -np.inf
        if np.isposinf(logits.max()):  # a tiny temperature overflowed: greedy among the largest
            logits = np.where(np.isposinf(logits), 0.0, -np.inf)
        if p.top_k and p.top_k < logits.size:
            candidates = np.argpartition(-logits, p.top_k - 1)[: p.top_k]
        else:
            candidates = np.arange(logits.size)
        order = candidates[np.argsort(-logits[candidates], kind="stable")]  # most likely first
        probs = np.exp(logits[order] - logits[order[0]])
        probs /= probs.sum()
        keep = probs.size
        if p.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (at least one token).
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0.0:
            keep = min(keep, int(np.count_nonzero(probs >= p.min_p * probs[0])))
        probs = probs[:keep] / probs[:keep].sum()
        if not np.isfinite(probs).all():  # cannot happen after the guards above; never hand NaN to the RNG
            return int(order[0])
        return int(order[self.rng.choice(keep, p=probs)])


def verify_draft(sampler: Sampler, logits: np.ndarray, draft: int | None) -> tuple[int, bool]:
    """The next token, sampled from logits, and whether it keeps the draft token proposed for it.

    Speculative sampling with a deterministic draft d and the target distribution p (after the
    sampler's processing) accepts d with probability p(d) and otherwise draws from p with d removed
    and renormalised. Drawing t ~ p as plain decoding does and keeping d iff t == d is that same
    law (P(t = d) = p(d); given t != d, t follows p without d), and it consumes the RNG as plain
    decoding does: a seeded generation gives the same tokens with drafts as without.
    """
    token = sampler(logits)
    return token, draft is not None and token == draft
