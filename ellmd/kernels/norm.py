"""RMSNorm, as Hugging Face's LlamaRMSNorm / Qwen3RMSNorm computes it in float32.

Shape legend:
  n   rows (tokens, or tokens * heads for Qwen3's per-head q/k norm)
  d   normalized width (hidden size, or head_dim)
"""

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ellmd.kernels.activations import PARALLEL_MIN
from ellmd.kernels.quant_int import FASTMATH_IN_ORDER

# The sum of a row's squares (sum_squares) runs in one order, whatever the code around it: 16
# partial sums (value j in lane j % 16, in increasing j), then the lanes in order. Left to LLVM, a
# sum vectorized with reassoc took its order per compiled copy (the prange path's copy summed a row
# in another order than the serial one: other last bits for the same token), and without reassoc it
# ran one add at a time (Qwen3-1.7B's 512-token prefill spent 100 ms of 2.5 s in its norms).


@intrinsic
def sum_squares(typingctx, row):
    """The sum of row[j]**2 (float32): lanes as above, one fma a value. row: a 1-D float32 array of
    unit stride (a C row, or a row of a view whose last axis is contiguous)."""
    if not (isinstance(row, types.Array) and row.ndim == 1 and row.dtype == types.float32):
        return None

    def codegen(context, builder, signature, args):
        f32, intp = ir.FloatType(), context.get_value_type(types.intp)
        vec = ir.VectorType(f32, 16)
        array = context.make_array(signature.args[0])(context, builder, args[0])
        base, count = array.data, cgutils.unpack_tuple(builder, array.shape)[0]
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec] * 3), "llvm.fma.v16f32")
        fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
        acc = cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * 16))
        whole = builder.and_(count, ir.Constant(intp, -16))
        with cgutils.for_range_slice(builder, ir.Constant(intp, 0), whole, ir.Constant(intp, 16)) as (j, _):
            v = builder.load(builder.bitcast(builder.gep(base, [j]), vec.as_pointer()), align=4)
            builder.store(builder.call(fma, [v, v, builder.load(acc)]), acc)
        with cgutils.for_range_slice(builder, whole, count, ir.Constant(intp, 1)) as (j, _):
            v, lane = builder.load(builder.gep(base, [j])), builder.trunc(builder.sub(j, whole), ir.IntType(32))
            sums = builder.load(acc)
            builder.store(builder.insert_element(sums, builder.call(fma1, [v, v, builder.extract_element(sums, lane)]), lane), acc)
        sums = builder.load(acc)
        total = builder.extract_element(sums, ir.Constant(ir.IntType(32), 0))
        for lane in range(1, 16):
            total = builder.fadd(total, builder.extract_element(sums, ir.Constant(ir.IntType(32), lane)))
        return total

    return types.float32(row), codegen


@numba.njit(cache=True, nogil=True, fastmath=FASTMATH_IN_ORDER)
def _inverse_rms(row, eps):
    return np.float32(1.0) / np.sqrt(sum_squares(row) / np.float32(row.shape[0]) + np.float32(eps))


@numba.njit(cache=True, nogil=True, fastmath=FASTMATH_IN_ORDER)
def _rmsnorm_rows(x, weight, eps, out, lo, hi):
    d = x.shape[1]
    if x.strides[1] != 4:
        raise ValueError("rmsnorm: the rows must be contiguous")
    for i in range(lo, hi):
        inv = _inverse_rms(x[i], eps)
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
def _rmsnorm_heads_rows(x, weight, eps, lo, hi):
    d = x.shape[2]
    if x.strides[2] != 4:
        raise ValueError("rmsnorm_heads: the heads' last axis must be contiguous")
    for i in range(lo, hi):
        for h in range(x.shape[1]):
            row = x[i, h]
            inv = _inverse_rms(row, eps)
            for j in range(d):
                row[j] = weight[j] * (row[j] * inv)


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def rmsnorm_heads(x, weight, eps):
    """Qwen3's q/k norm: rmsnorm over each head, in place. x: [n, heads, d] float32 (may be a
    strided view of the fused qkv buffer, its last axis contiguous); weight: [d] float32."""
    n, heads, d = x.shape
    if n * heads * d < PARALLEL_MIN:
        _rmsnorm_heads_rows(x, weight, eps, 0, n)
        return
    for i in prange(n):
        _rmsnorm_heads_rows(x, weight, eps, i, i + 1)


def rmsnorm_heads_ref(x, weight, eps):
    """numpy reference of rmsnorm_heads."""
    var = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    x[:] = (x / np.sqrt(var + eps) * weight).astype(np.float32)
