"""Stored prefix donors: which stored sessions begin with the leading tokens of a new session's prompt.

A new session copies the KV of the longest prefix of its first tokens that a session of its owner
holds (Residency.share_prefix). Sessions in memory are compared directly; the store's sessions
(closed, evicted, stored by an earlier run of the daemon, imported) are found through this index
without reading them: a stored session has, for each whole block of BLOCK_TOKENS leading tokens,
the hash of its tokens up to that block's end, seeded with its owner, so a prompt's own hashes,
looked up in order, lead to the stored session that shares the most whole blocks with it, of the
same owner only. Residency keeps it as the store holds the sessions made under this daemon's
fingerprint (built at start, updated as it queues snapshots, forks, deletes and imports). It is a
hint: the donor's token ids are read and compared before any KV is copied.

Shapes: tokens [n] int; hashes [n // BLOCK_TOKENS] (one per whole block).
"""

from __future__ import annotations

import numpy as np
import xxhash

BLOCK_TOKENS = 32  # a prefix shorter than this is prefilled rather than read from disk
BLOCK_BYTES = BLOCK_TOKENS * 4  # tokens hashed as int32, little-endian (as the store keeps them)


def block_hashes(owner: str | None, tokens: list[int]) -> list[int]:
    """The hash of tokens[:(k + 1) * BLOCK_TOKENS] for each whole block k, seeded with the owner
    (so that equal tokens of two owners never meet in the index)."""
    whole = len(tokens) // BLOCK_TOKENS * BLOCK_TOKENS
    data = memoryview(np.asarray(tokens[:whole], "<i4").tobytes())  # [whole * 4] bytes
    hasher = xxhash.xxh3_64(seed=xxhash.xxh3_64_intdigest(repr(owner).encode()))
    hashes = []
    for start in range(0, len(data), BLOCK_BYTES):
        hasher.update(data[start:start + BLOCK_BYTES])
        hashes.append(hasher.intdigest())
    return hashes


class PrefixIndex:
    """Stored sessions by the hashes of their leading blocks (see the module docstring)."""

    def __init__(self):
        self._sessions: dict[int, dict[str, None]] = {}  # block hash -> ids holding it (in the order put)
        self._hashes: dict[str, list[int]] = {}  # session id -> its block hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def put(self, session_id: str, owner: str | None, tokens: list[int]) -> None:
        """Index a session as it is (to be) stored: owner and token ids (those with KV)."""
        self.remove(session_id)
        hashes = block_hashes(owner, tokens)
        if hashes:
            self._hashes[session_id] = hashes
        for digest in hashes:
            self._sessions.setdefault(digest, {})[session_id] = None

    def remove(self, session_id: str) -> None:
        for digest in self._hashes.pop(session_id, ()):
            holders = self._sessions[digest]
            del holders[session_id]
            if not holders:
                del self._sessions[digest]

    def find(self, owner: str | None, tokens: list[int], exclude: str) -> tuple[str | None, int]:
        """The stored session of `owner` (other than `exclude`) sharing the most whole leading blocks
        with `tokens` (of those, the last indexed), and the length of those blocks; (None, 0) if
        none shares one. Whoever holds block k holds every block before it: the walk stops at the
        first block nobody else holds."""
        found, length = None, 0
        for depth, digest in enumerate(block_hashes(owner, tokens), 1):
            holder = next((i for i in reversed(self._sessions.get(digest, {})) if i != exclude), None)
            if holder is None:
                break
            found, length = holder, depth * BLOCK_TOKENS
        return found, length
