"""Linear layers (x @ w.T) with weights in storage precision, and the embedding gather.

Shape legend:
  n   input rows (tokens; the decode batch is 1..16)
  k   input features (w's columns)
  m   output features (w's rows)
  V   vocabulary size, d embedding width

Decode (small n) is memory-bound: `linear` streams each weight row once for all n inputs,
converting bf16/f16 in registers, two rows x four inputs per pass so that the vector FMAs are
not starved by loads. Prefill (large n) is compute-bound: `linear_prefill` converts blocks of
weight rows to float32 and hands them to numpy's BLAS. `matmul` picks one by n.
"""

import numba
import numpy as np
from numba import prange

from ellmd.kernels.activations import PARALLEL_MIN
from ellmd.kernels.formats import F32, decode, kernel_view, to_f32

ROW_BLOCK = 16  # weight rows per parallel task
PREFILL_MIN_ROWS = 24  # from this many input rows the BLAS path wins
PREFILL_BLOCK_ROWS = 1024  # weight rows converted per BLAS call


@numba.njit(cache=True, nogil=True, fastmath=True)
def _rows(x, w, out, j0, j1):
    """out[:, j0:j1] = x @ w[j0:j1].T, w decoded in registers (format from its dtype)."""
    n, k = x.shape
    zero = np.float32(0.0)
    for j in range(j0, j1, 2):
        # an odd last row is computed twice, as both rows of the pair
        j2 = min(j + 1, j1 - 1)
        w0, w1 = w[j], w[j2]
        for i in range(0, n - 3, 4):
            x0, x1, x2, x3 = x[i], x[i + 1], x[i + 2], x[i + 3]
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = zero
            for c in range(k):
                u = decode(w0[c])
                v = decode(w1[c])
                a0 += x0[c] * u
                a1 += x1[c] * u
                a2 += x2[c] * u
                a3 += x3[c] * u
                b0 += x0[c] * v
                b1 += x1[c] * v
                b2 += x2[c] * v
                b3 += x3[c] * v
            out[i, j] = a0
            out[i + 1, j] = a1
            out[i + 2, j] = a2
            out[i + 3, j] = a3
            out[i, j2] = b0
            out[i + 1, j2] = b1
            out[i + 2, j2] = b2
            out[i + 3, j2] = b3
        for i in range(n - n % 4, n):
            xi = x[i]
            a0 = b0 = zero
            for c in range(k):
                a0 += xi[c] * decode(w0[c])
                b0 += xi[c] * decode(w1[c])
            out[i, j] = a0
            out[i, j2] = b0


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _linear(x, w, out):
    m = w.shape[0]
    if x.shape[0] * m * x.shape[1] < 8 * PARALLEL_MIN:
        _rows(x, w, out, 0, m)
        return
    for b in prange((m + ROW_BLOCK - 1) // ROW_BLOCK):
        _rows(x, w, out, b * ROW_BLOCK, min(m, b * ROW_BLOCK + ROW_BLOCK))


def linear(x, w, fmt, out):
    """out = x @ w.T for small n (decode): reads each weight row once, converts on the fly.

    x: [n, k] float32; w: [m, k] storage (float32 for F32, uint16 bits for BF16/F16);
    out: [n, m] float32, written in place. Parallel over blocks of weight rows.
    """
    _linear(x, kernel_view(w, fmt), out)


def linear_ref(x, w, fmt, out):
    """numpy reference of linear."""
    out[:] = (x.astype(np.float64) @ to_f32(w, fmt).T.astype(np.float64)).astype(np.float32)


def prefill_scratch_size(m, k):
    """float32 elements of the scratch linear_prefill needs for a [m, k] weight."""
    return min(m, PREFILL_BLOCK_ROWS) * k


@numba.njit(cache=True, nogil=True, fastmath=True)
def _decode_block_rows(w, r0, block, lo, hi):
    for j in range(lo, hi):
        src = w[r0 + j]
        dst = block[j]
        for c in range(src.shape[0]):
            dst[c] = decode(src[c])


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _decode_block(w, r0, block):
    """block[j] = w[r0 + j] as float32 for every row of block."""
    rows = block.shape[0]
    for b in prange((rows + ROW_BLOCK - 1) // ROW_BLOCK):
        _decode_block_rows(w, r0, block, b * ROW_BLOCK, min(rows, b * ROW_BLOCK + ROW_BLOCK))


def linear_prefill(x, w, fmt, out, scratch):
    """out = x @ w.T for large n (prefill) with numpy's BLAS.

    x: [n, k] float32; w: [m, k] storage; out: [n, m] float32 C-contiguous; scratch: 1-D
    float32 of at least prefill_scratch_size(m, k) elements (unused for F32). bf16/f16
    weights are converted block by block (PREFILL_BLOCK_ROWS rows) into scratch; BLAS writes
    each block's columns of out in place (a column slice is a strided matrix BLAS accepts).
    """
    if fmt == F32:
        np.matmul(x, w.T, out=out)
        return
    m, k = w.shape
    w = kernel_view(w, fmt)
    for r0 in range(0, m, PREFILL_BLOCK_ROWS):
        rows = min(PREFILL_BLOCK_ROWS, m - r0)
        block = scratch[: rows * k].reshape(rows, k)  # [rows, k]
        _decode_block(w, r0, block)
        np.matmul(x, block.T, out=out[:, r0 : r0 + rows])


def linear_prefill_ref(x, w, fmt, out, scratch):
    """numpy reference of linear_prefill."""
    linear_ref(x, w, fmt, out)


def matmul(x, w, fmt, out, scratch):
    """out = x @ w.T, choosing linear (few rows) or linear_prefill (many rows) by n.

    Shapes as in linear_prefill; scratch may be None when n < PREFILL_MIN_ROWS or fmt is F32.
    """
    if x.shape[0] < PREFILL_MIN_ROWS:
        linear(x, w, fmt, out)
    else:
        linear_prefill(x, w, fmt, out, scratch)


def matmul_ref(x, w, fmt, out, scratch):
    """numpy reference of matmul."""
    linear_ref(x, w, fmt, out)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _embed(tokens, table, out):
    # serial: one row per token, memory-bound
    for i in range(tokens.shape[0]):
        src = table[tokens[i]]
        dst = out[i]
        for c in range(dst.shape[0]):
            dst[c] = decode(src[c])


def embed(tokens, table, fmt, out):
    """out[i] = table[tokens[i]] as float32.

    tokens: [n] int64; table: [V, d] storage; out: [n, d] float32.
    """
    _embed(tokens, kernel_view(table, fmt), out)


def embed_ref(tokens, table, fmt, out):
    """numpy reference of embed."""
    out[:] = to_f32(table[tokens], fmt)
