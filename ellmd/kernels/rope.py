"""Rotary position embeddings: the cos/sin tables and their application to q and k.

Shape legend:
  n     tokens
  heads attention heads of the array being rotated (q heads or kv heads)
  hd    head_dim; half = hd // 2
  L     table length (positions 0..L-1)

The tables follow transformers' ROPE_INIT_FUNCTIONS step by step in float32, the way its
float32 model computes them, so that angles match at large positions too (one rounding of
inv_freq would move the angle at position 32k by ~1e-3).
"""

import math

import numba
import numpy as np
from numba import prange

from ellmd.kernels.activations import PARALLEL_MIN


def _pos_freqs(head_dim, base):
    """base**(2i/hd) [half] as transformers' float32 code computes it."""
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)  # [half]
    # A correctly rounded float32 pow, which is what torch's pow gives in practice.
    return np.power(np.float64(base), exponent.astype(np.float64)).astype(np.float32)


def _base_inv_freq(head_dim, base):
    """1 / base**(2i/hd) [half] float32."""
    return np.float32(1.0) / _pos_freqs(head_dim, base)


def _llama3_inv_freq(inv_freq, params, max_position_embeddings):
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params.get("original_max_position_embeddings", max_position_embeddings)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq)
    smooth = (np.float32(old_context_len) / wavelen - np.float32(low_freq_factor)) / np.float32(
        high_freq_factor - low_freq_factor
    )
    smoothed = (np.float32(1) - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(head_dim, base, params, max_position_embeddings):
    """Returns (inv_freq, attention_factor) of YaRN."""
    original = params.get("original_max_position_embeddings", max_position_embeddings)
    factor = params.get("factor") or max_position_embeddings / original

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations):
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp

    pos_freqs = _pos_freqs(head_dim, base)  # [half]
    inv_extrapolation = np.float32(1.0) / pos_freqs
    inv_interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    ramp = (np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    extrapolation_factor = np.float32(1) - np.clip(ramp, np.float32(0), np.float32(1))
    inv_freq = (
        inv_interpolation * (np.float32(1) - extrapolation_factor)
        + inv_extrapolation * extrapolation_factor
    )
    return inv_freq.astype(np.float32), attention_factor


def rope_tables(head_dim, rope_theta, rope_scaling, max_position_embeddings, length):
    """cos and sin tables, each [length, head_dim // 2] float32, for positions 0..length-1.

    rope_scaling is config.json's dict (or None); its type is read from "rope_type" or the
    legacy "type": default, linear, dynamic, llama3, yarn. "dynamic" uses the frequencies
    transformers starts with, exact up to max_position_embeddings. yarn's attention factor is
    multiplied into both tables, as transformers does.
    """
    params = rope_scaling or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    attention_factor = 1.0
    if rope_type == "default":
        inv_freq = _base_inv_freq(head_dim, rope_theta)
    elif rope_type == "linear":
        inv_freq = _base_inv_freq(head_dim, rope_theta) / np.float32(params["factor"])
    elif rope_type == "dynamic":
        factor = params["factor"]
        seq_len = max_position_embeddings
        base = rope_theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (
            head_dim / (head_dim - 2)
        )
        inv_freq = _base_inv_freq(head_dim, base)
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(
            _base_inv_freq(head_dim, rope_theta), params, max_position_embeddings
        )
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(
            head_dim, rope_theta, params, max_position_embeddings
        )
    else:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    positions = np.arange(length, dtype=np.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [L, half], float32 products as in torch
    cos = np.cos(freqs) * np.float32(attention_factor)
    sin = np.sin(freqs) * np.float32(attention_factor)
    return np.ascontiguousarray(cos, dtype=np.float32), np.ascontiguousarray(sin, dtype=np.float32)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _rope_rows(x, positions, cos, sin, lo, hi):
    heads, hd = x.shape[1], x.shape[2]
    half = hd // 2
    for i in range(lo, hi):
        p = positions[i]
        for h in range(heads):
            for j in range(half):
                x1 = x[i, h, j]
                x2 = x[i, h, half + j]
                c = cos[p, j]
                s = sin[p, j]
                x[i, h, j] = x1 * c - x2 * s
                x[i, h, half + j] = x2 * c + x1 * s


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def rope(x, positions, cos, sin):
    """Rotate x in place by its tokens' positions (neox / HF rotate_half layout).

    x: [n, heads, hd] float32; positions: [n] int64; cos, sin: [L, hd // 2] float32.
    """
    n = x.shape[0]
    if n * x.shape[1] * x.shape[2] < PARALLEL_MIN:
        _rope_rows(x, positions, cos, sin, 0, n)
        return
    for i in prange(n):
        _rope_rows(x, positions, cos, sin, i, i + 1)


def rope_ref(x, positions, cos, sin):
    """numpy reference of rope: x * cos + rotate_half(x) * sin."""
    half = x.shape[2] // 2
    c = np.concatenate([cos[positions], cos[positions]], axis=-1)[:, None, :]  # [n, 1, hd]
    s = np.concatenate([sin[positions], sin[positions]], axis=-1)[:, None, :]  # [n, 1, hd]
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [n, heads, hd]
    x[:] = x * c + rotated * s
