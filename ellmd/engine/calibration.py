"""The mean key of each (layer, kv head), calibrated at load for the KV formats that store keys
less it (q4_0 keys: kv_blocks.py and docs/engine.md, "Key smoothing").

Softmax does not change when one vector m is subtracted from every key a query sees
(q . (k - m) = q . k - q . m, the same for every key), and keys less their lasting offset
quantize far better in 4 bits. m is the mean of the model's own keys (after RoPE, as stored)
over the last TOKENS tokens of the Python docs' topics: the text's end, which `ellmd perplexity`
scores by default only when it scores the whole text (its --max-tokens windows start at the
beginning).

m is computed once per model and weight format and cached on disk (XDG_CACHE_HOME/ellm/key-mean):
later starts skip the prefill, and a machine keeps one m whichever kernel paths its CPU of the day
takes (m names the stored q4_0 sessions: a recomputed m that rounded differently would refuse them).

Shapes: tokens [N]; keys [L, G, N, d] (one bf16 slot); key_mean [L, G, d] float32.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from ellmd.engine.kvcache import KVCache
from ellmd.engine.plan import Plan
from ellmd.kernels import cache_base
from ellmd.kernels.formats import BF16, to_f32, to_storage
from ellmd.text.corpus import python_docs

# SmolLM2-135M, q4_0 KV, `ellmd perplexity --context 2048 --max-tokens 2048` (docs/engine.md):
# m over these 2,048 tokens +1.9% over bf16 KV; over 64 to 1,024 tokens of other parts of the
# text, or averaged over several, +3.1 to +5.8%; without m +6.7%. Skipping the first keys (the
# attention sink) did not help.
TOKENS = 2048
TEXT_CHARS = 16_000  # the text's end: more than TOKENS tokens of it


def calibration_tokens(tokenizer, vocab_size: int, count: int = TOKENS) -> np.ndarray:
    """The last `count` tokens of the calibration text; without a tokenizer (random checkpoints,
    for benchmarks: their keys have no offset worth a long prefill) 64 fixed token ids. Ids are
    folded into the model's vocabulary (a no-op for a real model: tiny test checkpoints carry a
    real tokenizer beside a small embedding)."""
    if tokenizer is None:
        ids = np.arange(min(count, 64), dtype=np.int64) * 7919 + 13
    else:
        ids = np.asarray(tokenizer.encode(python_docs()[-TEXT_CHARS:], add_special_tokens=False)[-count:], np.int64)
    return ids % vocab_size


def key_mean(model, tokens: np.ndarray, chunk_size: int) -> np.ndarray:
    """[L, G, d] float32: the mean stored key of each (layer, kv head) over tokens, prefilled into
    a bf16 KV of its own (the model's keys, whatever the engine's KV format), rounded to bf16 so
    that the kernel path that computed them does not move it: the same weights give the same m."""
    spec = model.spec
    kv = KVCache(spec.num_hidden_layers, 1, spec.num_key_value_heads, len(tokens), spec.head_dim, BF16)
    for _ in Plan(model, kv, min(chunk_size, len(tokens))).prefill(0, tokens):
        pass
    keys = to_f32(kv.k[:, 0], BF16)  # [L, G, N, d]
    mean = keys.astype(np.float64).mean(axis=2).astype(np.float32)
    return to_f32(to_storage(mean, BF16), BF16)


def digest(key_mean: np.ndarray) -> str:
    """8 hex digits naming a key mean (in the fingerprint of the KV it centres)."""
    return hashlib.sha256(np.ascontiguousarray(key_mean, np.float32).tobytes()).hexdigest()[:8]


def cache_path(identity: str, tokens: np.ndarray) -> Path:
    """Where the key mean of a model (identity: its weights and their format) over tokens is kept."""
    name = hashlib.sha256(identity.encode() + np.ascontiguousarray(tokens, np.int64).tobytes()).hexdigest()[:24]
    return cache_base() / "key-mean" / f"{name}.npy"


def cached_key_mean(model, tokens: np.ndarray, chunk_size: int, identity: str) -> tuple[np.ndarray, bool]:
    """(key_mean, whether it came from the cache): the cached m of this model and tokens, else
    key_mean computed and cached (a cache that cannot be read or written only costs the prefill)."""
    spec = model.spec
    shape = (spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim)
    path = cache_path(identity, tokens)
    try:
        mean = np.load(path, allow_pickle=False)
        if mean.shape == shape and mean.dtype == np.float32 and np.isfinite(mean).all():
            return mean, True
    except (OSError, ValueError):
        pass
    mean = key_mean(model, tokens, chunk_size)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.npy")
        np.save(partial, mean)
        partial.replace(path)  # whole or absent: a reader never sees half a file
    except OSError:
        pass
    return mean, False
