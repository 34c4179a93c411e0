"""RMSNorm, as Hugging Face's LlamaRMSNorm / Qwen3RMSNorm computes it in float32.

Shape legend:
  n   rows (tokens, or tokens * heads for Qwen3's per-head q/k norm)
  d   normalized width (hidden size, or head_dim)
"""

import numba
import numpy as np
from numba import prange

from ellmd.kernels.activations import PARALLEL_MIN
from ellmd.kernels.quant_int import FASTMATH_IN_ORDER

# The sums of squares run without reassoc: with it, LLVM chose their order per compiled copy, and
# the prange path's copy (a chunk of >= PARALLEL_MIN / d tokens) summed a row's squares in another
# order than the serial one (a short chunk, a decode step) whenever both compiled in one process:
# other last bits for the same token (on a cache loaded from disk the two happened to agree).
# In order (Zen 1): a row of 576 takes 1.35 us, 512 rows on 2 threads 346 us (66 with reassoc),
# under 1% of a prefill; explicit 8-lane partial sums would vectorize in a fixed order.


@numba.njit(cache=True, nogil=True, fastmath=FASTMATH_IN_ORDER)
def _rmsnorm_rows(x, weight, eps, out, lo, hi):
    d = x.shape[1]
    for i in range(lo, hi):
        ss = np.float32(0.0)
        for j in range(d):
            ss += x[i, j] * x[i, j]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + np.float32(eps))
        for j in range(d):
            out[i, j] = weight[j] * (x[i, j] * inv)


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def rmsnorm(x, weight, eps, out):
    """out = x / sqrt(mean(x**2) + eps) * weight, row by row.

    x: [n, d] float32; weight: [d] float32; out: [n, d] float32, may be x itself.
    """
    n = x.shape[0]
    if n * x.shape[1] < PARALLEL_MIN:
        _rmsnorm_rows(x, weight, eps, out, 0, n)
        return
    for i in prange(n):
        _rmsnorm_rows(x, weight, eps, out, i, i + 1)


def rmsnorm_ref(x, weight, eps, out):
    """numpy reference of rmsnorm."""
    var = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    out[:] = (x / np.sqrt(var + eps) * weight).astype(np.float32)


@numba.njit(cache=True, nogil=True, fastmath=FASTMATH_IN_ORDER)
def rmsnorm_heads(x, weight, eps):
    """Qwen3's q/k norm: rmsnorm over each head, in place. x: [n, heads, d] float32 (may be a
    strided view of the fused qkv buffer); weight: [d] float32."""
    n, heads, d = x.shape
    for i in range(n):
        for h in range(heads):
            ss = np.float32(0.0)
            for j in range(d):
                ss += x[i, h, j] * x[i, h, j]
            inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + np.float32(eps))
            for j in range(d):
                x[i, h, j] = weight[j] * (x[i, h, j] * inv)


@numba.njit(cache=True, nogil=True, fastmath=True)
def qk_norm(qkv, heads, kv_heads, q_norm, k_norm, eps):
    """Qwen3's q and k norms on fused qkv rows [n, (H + 2G) * d] (q heads, k heads, v heads), in place.

    Prefill and the decode step both norm through here, so the heads reach rmsnorm_heads as the
    same array type whatever n: a one-row view is C-contiguous to numpy, and the loop compiled for
    that layout summed the squares in another order than the strided one (another last bit)."""
    d = q_norm.shape[0]
    x = qkv.reshape((qkv.shape[0], heads + 2 * kv_heads, d))
    rmsnorm_heads(x[:, :heads], q_norm, eps)
    rmsnorm_heads(x[:, heads : heads + kv_heads], k_norm, eps)


def rmsnorm_heads_ref(x, weight, eps):
    """numpy reference of rmsnorm_heads."""
    var = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    x[:] = (x / np.sqrt(var + eps) * weight).astype(np.float32)
