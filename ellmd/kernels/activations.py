"""Activation kernels and the vectorizable exp they are built on.

Shape legend:
  n   tokens
  I   intermediate size (the MLP's hidden width)
"""

import numba
import numpy as np
from numba import prange

from ellmd.kernels.formats import _bitcast_f32

# Below this many elements the kernels run on the calling thread: a parallel launch costs
# a few microseconds, more than the work of a decode step.
PARALLEL_MIN = 1 << 15
# fastmath without arcp, for the kernels whose silu divides: with it LLVM rewrote the division one
# way in silu_mul's serial path and another in its parallel one, and a row's numbers changed with
# the rows beside it
FASTMATH_DIVIDES = {"nnan", "ninf", "nsz", "contract", "afn", "reassoc"}


@numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
def exp_f32(x):
    """e**x in float32 within 2 ulp, 0 below -87.3; branch-free so callers' loops vectorize.

    libm's expf is a scalar call that blocks vectorization (no SVML here), and softmax and
    silu are dominated by it.
    """
    # Cephes expf: e**x = 2**k * e**r with |r| <= ln2/2, degree-6 polynomial for e**r.
    # The upper clamp keeps k <= 127 so 2**k stays finite.
    xc = min(max(x, np.float32(-87.33654)), np.float32(88.37626))
    k = np.floor(xc * np.float32(1.4426950408889634) + np.float32(0.5))
    r = xc - k * np.float32(0.693359375) + k * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = p * (r * r) + r + np.float32(1.0)
    e = y * _bitcast_f32(np.uint32((np.int32(k) + np.int32(127)) << np.int32(23)))
    return e if x >= np.float32(-87.33654) else np.float32(0.0)


@numba.njit(cache=True, nogil=True, fastmath=FASTMATH_DIVIDES)
def _silu_mul_rows(gate_up, out, lo, hi):
    inter = out.shape[1]
    for i in range(lo, hi):
        for j in range(inter):
            g = gate_up[i, j]
            out[i, j] = g / (np.float32(1.0) + exp_f32(-g)) * gate_up[i, inter + j]


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def silu_mul(gate_up, out):
    """out = silu(gate_up[:, :I]) * gate_up[:, I:] (the SwiGLU of Llama/Qwen MLPs).

    gate_up: [n, 2*I] float32; out: [n, I] float32, written in place.
    """
    n = out.shape[0]
    if n * out.shape[1] < PARALLEL_MIN or n == 1:
        _silu_mul_rows(gate_up, out, 0, n)
        return
    for i in prange(n):
        _silu_mul_rows(gate_up, out, i, i + 1)


def silu_mul_ref(gate_up, out):
    """numpy reference of silu_mul."""
    inter = out.shape[1]
    g = gate_up[:, :inter].astype(np.float64)
    out[:] = (g / (1.0 + np.exp(-g)) * gate_up[:, inter:]).astype(np.float32)
