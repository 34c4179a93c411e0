"""An optional dense retriever: WordLlama embeddings and cosine similarity (`pip install 'ellm[dense]'`).

The model is WordLlama's l2_supercat at 256 dimensions, whose weights and tokenizer ship inside the
wordllama wheel: nothing is downloaded. It averages static token embeddings, so it is fast on a CPU
and finds paraphrases BM25 misses, but it does not read word order.

Shapes: n = chunks indexed, d = DIM.
"""

from __future__ import annotations

import threading
from pathlib import Path

import msgpack
import numpy as np
import wordllama
from wordllama import WordLlama

from ellmd.runtime.context.retrieval import Chunk, RetrievalError, Retriever, write_atomic

__all__ = ["DenseRetriever"]

CONFIG = "l2_supercat"
DIM = 256
MODEL = f"wordllama {CONFIG} {DIM}"
INDEX_FILE = "dense.msgpack"

_model = None
_model_lock = threading.Lock()


def embed(texts: list[str]) -> np.ndarray:
    """Unit-length embeddings [len(texts), DIM] float32 (zero for a text with no tokens)."""
    global _model
    with _model_lock:
        if _model is None:
            # cache_dir = the package itself: load() looks for the bundled tokenizer in tokenizer/
            # while the wheel has it in tokenizers/, so by default it would try huggingface.co.
            _model = WordLlama.load(CONFIG, dim=DIM, cache_dir=Path(wordllama.__file__).parent, disable_download=True)
    vectors = _model.embed(texts, norm=True)  # [len(texts), d]
    return np.nan_to_num(vectors, nan=0.0).astype(np.float32, copy=False)


class DenseRetriever(Retriever):
    """Cosine similarity between the WordLlama embeddings of the query and of each chunk (no options)."""

    def __init__(self, directory: Path, options: dict):
        super().__init__(directory, options)
        if self.options:
            raise RetrievalError(f"the dense retriever takes no options, got {', '.join(sorted(self.options))}")
        self.ids: list[str] = []
        self.vectors = np.zeros((0, DIM), np.float32)  # [n, d] unit rows
        path = self.directory / INDEX_FILE
        if path.exists():
            index = msgpack.unpackb(path.read_bytes())
            if index["model"] != MODEL:
                raise RetrievalError(f"{path} holds {index['model']} embeddings, not {MODEL}; index the folder again")
            self.ids = index["ids"]
            self.vectors = np.frombuffer(index["vectors"], np.float32).reshape(len(self.ids), DIM).copy()  # [n, d]

    def add(self, chunks: list[Chunk]) -> None:
        self.remove([c.id for c in chunks])
        if chunks:
            self.ids += [c.id for c in chunks]
            self.vectors = np.concatenate([self.vectors, embed([c.text for c in chunks])])  # [n, d]

    def remove(self, chunk_ids: list[str]) -> None:
        drop = set(chunk_ids)
        keep = [i for i, cid in enumerate(self.ids) if cid not in drop]
        if len(keep) < len(self.ids):
            self.ids = [self.ids[i] for i in keep]
            self.vectors = self.vectors[keep]  # [n', d]

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        if not self.ids:
            return []
        scores = self.vectors @ embed([query])[0]  # [n]
        best = np.argsort(-scores, kind="stable")[:k]
        return [(self.ids[i], float(scores[i])) for i in best]

    def save(self) -> None:
        write_atomic(self.directory / INDEX_FILE, msgpack.packb(
            {"model": MODEL, "ids": self.ids, "vectors": self.vectors.tobytes()}))
