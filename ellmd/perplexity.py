"""`ellmd perplexity`: a model's perplexity on a text, over sliding windows (as llama.cpp's
llama-perplexity and Hugging Face's strided evaluation do).

Windows of `context` tokens start every `stride` tokens; each scores only the tokens that no
window before it scored, each predicted once from at least `context - stride` tokens of its own
past (the first window's from fewer). A window's first token has no past in it: with
stride == context (no overlap) those tokens are not scored. Perplexity is
exp(mean NLL) and its standard error exp's first-order propagation of the NLLs' standard error of
the mean, as llama-perplexity reports it.

Shapes: tokens [n]; logits of a prefill piece [m, V]; nll [scored].
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ellmd.text.corpus import python_docs

Progress = Callable[[int, int], None]  # (tokens scored, tokens to score)


@dataclass(frozen=True)
class Perplexity:
    perplexity: float
    stderr: float  # of the perplexity
    mean_nll: float
    tokens_scored: int
    windows: int


def default_text() -> str:
    """A long English text every Python has (text.corpus.python_docs), scored from its start."""
    return python_docs()


def windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored target) of each window over n tokens."""
    if context < 2 or not 0 < stride <= context:
        raise ValueError(f"need context >= 2 and 0 < stride <= context (got context {context}, stride {stride})")
    out, scored_to = [], 1  # token 0 has no prediction
    for begin in range(0, max(n - 1, 1), stride):
        end = min(begin + context, n)
        if end > scored_to:
            out.append((begin, end, max(scored_to, begin + 1)))
            scored_to = end
        if end == n:
            break
    return out


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, in float64. logits [m, V], targets [m] -> [m]."""
    rows = logits.astype(np.float64)
    top = rows.max(axis=1, keepdims=True)
    log_sum = np.log(np.exp(rows - top).sum(axis=1)) + top[:, 0]
    return log_sum - rows[np.arange(len(targets)), targets]


def window_nll(engine, tokens: np.ndarray, first: int, slot: int = 0) -> np.ndarray:
    """NLL of tokens[first:] given the window's tokens before them, prefilled into an empty slot;
    logits are computed only for the pieces that predict a scored token."""
    engine.rewind(slot, 0)
    chunk, out = engine.chunk_size, []
    for begin in range(0, len(tokens), chunk):
        piece = tokens[begin:begin + chunk]
        predicts = np.arange(begin + 1, begin + 1 + len(piece))  # piece row i predicts token begin+i+1
        wanted = (predicts >= first) & (predicts < len(tokens))
        if not wanted.any():
            engine.prefill(slot, piece, logits="none")
            continue
        logits = engine.prefill(slot, piece, logits="all")  # [m, V]
        out.append(token_nll(logits[wanted], tokens[predicts[wanted]]))
    engine.rewind(slot, 0)
    return np.concatenate(out)


def perplexity(engine, tokens, context: int, stride: int, progress: Progress | None = None) -> Perplexity:
    """The perplexity of tokens under engine's model (slot 0 is used and left empty)."""
    tokens = np.asarray(tokens, np.int64)
    spans = windows(len(tokens), context, stride)
    if not spans:
        raise ValueError(f"the text has {len(tokens)} tokens: at least 2 are needed")
    total = spans[-1][1] - 1
    nll = []
    for begin, end, first in spans:
        nll.append(window_nll(engine, tokens[begin:end], first - begin))
        if progress:
            progress(end - 1, total)
    values = np.concatenate(nll)
    mean = float(values.mean())
    sem = float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0
    ppl = float(np.exp(mean))
    return Perplexity(ppl, ppl * sem, mean, len(values), len(spans))


def read_text(path: Path | None) -> str:
    return default_text() if path is None else Path(path).read_text(encoding="utf-8", errors="replace")
