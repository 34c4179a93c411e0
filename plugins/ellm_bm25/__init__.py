"""The built-in retriever: Okapi BM25 over an inverted index that takes additions and removals in place.

Hand-written rather than bm25s or rank-bm25: both rebuild the whole index on any change (and bm25s
adds scipy), while re-indexing a folder adds and removes a few chunks at a time.

Shapes: n = slots (chunks indexed, plus freed slots awaiting reuse), p = chunks holding one term.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np

from ellm_bm25.tokens import tokenize
from ellmd.runtime.context.retrieval import Chunk, RetrievalError, Retriever, write_atomic

__all__ = ["BM25Retriever", "tokenize"]

K1 = 1.5
B = 0.75
INDEX_FILE = "bm25.msgpack"
INDEX_VERSION = 1


class BM25Retriever(Retriever):
    """Okapi BM25 with k1=1.5 and b=0.75 (options "k1" and "b") and Lucene's idf,
    ln(1 + (N - df + 0.5) / (df + 0.5)), which is never negative. Each distinct query term counts once:

        score(q, d) = sum over terms t of q in d:  idf(t) * tf * (k1 + 1) / (tf + k1 * (1 - b + b * |d| / avgdl))
    """

    def __init__(self, directory: Path, options: dict):
        super().__init__(directory, options)
        unknown = set(self.options) - {"k1", "b"}
        if unknown:
            raise RetrievalError(f"unknown bm25 option {', '.join(sorted(unknown))}; known: k1, b")
        self.k1 = float(self.options.get("k1", K1))
        self.b = float(self.options.get("b", B))
        self.ids: list[str | None] = []  # slot -> chunk id, None when free
        self.terms: list[list[str]] = []  # slot -> its distinct terms, to take it out of the postings
        self.lengths = np.zeros(0, np.int64)  # [n] tokens per chunk, 0 when free
        self.postings: dict[str, dict[int, int]] = {}  # term -> {slot: term frequency}
        path = self.directory / INDEX_FILE
        if path.exists():
            index = msgpack.unpackb(path.read_bytes(), strict_map_key=False)
            if index["version"] != INDEX_VERSION:
                raise RetrievalError(f"{path} has BM25 index version {index['version']}; index the folder again")
            self.ids, self.terms, self.postings = index["ids"], index["terms"], index["postings"]
            self.lengths = np.frombuffer(index["lengths"], np.int64).copy()  # [n]
        self.slots = {cid: slot for slot, cid in enumerate(self.ids) if cid is not None}
        self.free = [slot for slot, cid in enumerate(self.ids) if cid is None]
        self.total_length = int(self.lengths.sum())

    def add(self, chunks: list[Chunk]) -> None:
        self.remove([c.id for c in chunks if c.id in self.slots])
        for chunk in chunks:
            counts = Counter(tokenize(chunk.text))
            if self.free:
                slot = self.free.pop()
            else:
                slot = len(self.ids)
                self.ids.append(None)
                self.terms.append([])
                if slot == len(self.lengths):
                    self.lengths = np.concatenate([self.lengths, np.zeros(max(slot, 64), np.int64)])  # [2n]
            self.ids[slot], self.terms[slot] = chunk.id, list(counts)
            self.slots[chunk.id] = slot
            self.lengths[slot] = counts.total()
            self.total_length += counts.total()
            for term, tf in counts.items():
                self.postings.setdefault(term, {})[slot] = tf

    def remove(self, chunk_ids: list[str]) -> None:
        for chunk_id in chunk_ids:
            slot = self.slots.pop(chunk_id, None)
            if slot is None:
                continue
            for term in self.terms[slot]:
                postings = self.postings[term]
                del postings[slot]
                if not postings:
                    del self.postings[term]
            self.total_length -= int(self.lengths[slot])
            self.lengths[slot] = 0
            self.ids[slot], self.terms[slot] = None, []
            self.free.append(slot)

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        n_docs = len(self.slots)
        if n_docs == 0:
            return []
        avgdl = max(self.total_length / n_docs, 1e-9)
        scores = np.zeros(len(self.ids))  # [n]
        for term in dict.fromkeys(tokenize(query)):
            postings = self.postings.get(term)
            if not postings:
                continue
            slots = np.fromiter(postings.keys(), np.int64, len(postings))  # [p]
            tf = np.fromiter(postings.values(), np.float64, len(postings))  # [p]
            idf = math.log(1 + (n_docs - len(postings) + 0.5) / (len(postings) + 0.5))
            norm = self.k1 * (1 - self.b + self.b * self.lengths[slots] / avgdl)  # [p]
            scores[slots] += idf * tf * (self.k1 + 1) / (tf + norm)
        hits = np.flatnonzero(scores > 0)
        if len(hits) > k:
            kth = np.partition(scores[hits], len(hits) - k)[len(hits) - k]
            hits = hits[scores[hits] >= kth]
        # Ties broken by chunk id, so the order does not depend on the slots' history.
        best = sorted(hits.tolist(), key=lambda s: (-scores[s], self.ids[s]))[:k]
        return [(self.ids[s], float(scores[s])) for s in best]

    def save(self) -> None:
        n = len(self.ids)
        write_atomic(self.directory / INDEX_FILE, msgpack.packb({
            "version": INDEX_VERSION, "ids": self.ids, "terms": self.terms,
            "lengths": self.lengths[:n].tobytes(), "postings": self.postings}))
