"""Drafts for speculative decoding, looked up in the session's own history (prompt lookup decoding).

A generation that copies from its context (code edits, quotes, a document rewritten) repeats long
runs of tokens it has seen. The draft for the next positions is what followed the most recent
earlier occurrence of the last n tokens (the longest n from NGRAM_MAX down to NGRAM_MIN that
occurs), continued with the match's period where it runs into the history's end; the decode step runs the draft's rows beside the sampled token's, and the tokens sampled
from them keep the draft as long as they agree with it (Generations.verify).

The draft length adapts to how the drafts fare: it doubles while whole drafts are accepted (up to
the generation's `draft_tokens`), falls to one past the accepted ones when a draft breaks, and a
generation whose drafts keep failing stops drafting for a while (twice as long after each failure
in a row, up to MAX_PAUSE steps): a failed draft costs its rows in the step and gives nothing.

Shapes: tokens [N] int32, the session's tokens and the generated ones, grown in place.
"""

from __future__ import annotations

import numpy as np

NGRAM_MAX = 4  # the longest suffix looked up: longer ones find the place being copied without doubt
NGRAM_MIN = 2  # a single token recurs too often for what follows it to be the continuation
DRAFT_TOKENS = 8  # the longest draft by default (the `draft_tokens` sampling option)
MAX_PAUSE = 32  # the longest pause of a generation whose drafts keep failing, in steps


class PromptLookup:
    """The draft proposer of one generation, over its session's tokens and the generated ones."""

    def __init__(self, tokens, capacity: int, max_draft: int = DRAFT_TOKENS, ngram: tuple[int, int] | None = None):
        self.tokens = np.zeros(max(capacity, len(tokens)), np.int32)  # [capacity]
        self.size = len(tokens)
        self.tokens[: self.size] = tokens
        self.max_draft = max_draft
        self.ngram_min, self.ngram_max = ngram or (NGRAM_MIN, NGRAM_MAX)
        self.length = max_draft  # the draft length to propose next
        self.failures = 0  # drafts in a row with nothing accepted
        self.pause = 0  # steps left without drafting

    def push(self, token: int) -> None:
        """Append a generated token to the history."""
        if self.size == len(self.tokens):
            self.tokens = np.concatenate([self.tokens, np.zeros_like(self.tokens)])
        self.tokens[self.size] = token
        self.size += 1

    def propose(self, limit: int) -> list[int]:
        """The draft for the positions after the history's last token (at most `limit` tokens;
        empty when no suffix recurs, or while paused)."""
        if self.pause:
            self.pause -= 1
            return []
        limit = min(limit, self.length)
        if limit <= 0:
            return []
        end = self.find()
        if end < 0:
            return []
        # what followed; past the history's end it repeats with the match's period (a loop, a rule of dashes)
        period = self.size - 1 - end
        return self.tokens[end + 1 + np.arange(limit) % period].tolist()

    def find(self) -> int:
        """The end of the most recent earlier occurrence of the longest recurring suffix (n tokens,
        NGRAM_MIN <= n <= NGRAM_MAX), or -1."""
        tokens, size = self.tokens, self.size
        if size < self.ngram_min + 1:
            return -1
        ends = np.flatnonzero(tokens[: size - 1] == tokens[size - 1])  # [hits] ends of 1-token matches
        best = int(ends[-1]) if len(ends) and self.ngram_min <= 1 else -1
        for n in range(2, min(self.ngram_max, size - 1) + 1):
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[size - n]]  # the match extends one token back
            if not len(ends):
                break
            if n >= self.ngram_min:
                best = int(ends[-1])
        return best

    def record(self, drafted: int, accepted: int) -> None:
        """Adapt to how a draft of `drafted` tokens fared (`accepted` of them kept)."""
        if not drafted:
            return
        if accepted == drafted:
            self.length = min(2 * self.length, self.max_draft)
        else:
            self.length = max(accepted + 1, 1)
        if accepted:
            self.failures = 0
        else:
            self.failures += 1
            self.pause = min(2 ** (self.failures - 1), MAX_PAUSE) if self.failures > 1 else 0
