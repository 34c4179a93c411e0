"""The scheduling policy: what the engine loop runs next.

One object decides which idle session leaves its slot when another needs one.
"""

from __future__ import annotations


class Policy:
    """The engine loop's decisions, apart from the loop (testable against a fake engine)."""

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size  # the plan's: the most tokens one prefill forward takes

    def victim(self, idle: list):
        """The idle session to evict for another (least recently used), or None if there is none."""
        return min(idle, key=lambda s: s.last_used, default=None)
