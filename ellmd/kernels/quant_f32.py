"""Row dot products of GGUF block weights in float32: the portable path (exact to float32 rounding).

njit API:
  dot_rows(x, w, out, j0, j1, acc=None)   out[:, j0:j1] = x @ w[j0:j1].T, x [n, k] float32
                                    (acc: a work area of acc_floats(n) float32)

Blocks are converted to float32 in vector registers with LLVM's generic vectors (AVX2, AVX-512
or SSE), never stored; the formats are quant.py's.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ellmd.kernels.aligned import line_start
from ellmd.kernels.quant import PREFETCH, QK, as_bytes, f16_at, record_name, scale_min_k4, u32_at

@intrinsic
def prefetch(typingctx, b, o):
    """Ask for the cache line of b[o] (a byte view); any o: a prefetch never faults."""
    if not (isinstance(b, types.Array) and b.dtype == types.uint8 and b.ndim == 1):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [data.type, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.gep(data, [args[1]]), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(b, types.intp), codegen


@numba.njit(cache=True, nogil=True, fastmath=False, inline="always")
def prefetch_ahead(b, o, size):
    """Ask for the cache lines of the size bytes PREFETCH past b[o] (see PREFETCH)."""
    for line in range(0, size, 64):
        prefetch(b, o + PREFETCH + line)


# ---- the fused row dots ------------------------------------------------------------------------
#
# A decode step reads each weight row once for the whole batch: every 16 values of a block are
# unpacked and scaled in one vector register (fma16), then multiplied into the float32
# accumulators acc[i, :] of every input row i, so the weights are converted once, not once
# per input, and never stored. Values 16 * s apart go to different accumulators (ACC_SLOTS):
# one chain of dependent FMAs through acc would cap a core near two weights per cycle.

_LANES = 16
ACC_SLOTS = 4  # accumulator vectors per input row: acc is [n, ACC_SLOTS * 16]


def _fma16_codegen(high):
    """Codegen of acc[:n] += v * x[:n, xoff:xoff+16], v[l] = float(code[l]) * scale + bias,
    code[l] = ((b[off+l] ^ flip) >> shift) & mask, plus high bits (see fma16 below)."""

    def codegen(context, builder, signature, args):
        acc, x, n, xoff, b, off, flip, shift, mask, scale, bias, h1, h2, h3, h4 = args
        acc_t, x_t, b_t = signature.args[0], signature.args[1], signature.args[4]
        i32, i8, f32 = ir.IntType(32), ir.IntType(8), ir.FloatType()
        i32v, i8v, f32v = (ir.VectorType(t, _LANES) for t in (i32, i8, f32))

        def splat(value, vty):
            vec = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(i32, 0))
            return builder.shuffle_vector(vec, ir.Constant(vty, ir.Undefined), ir.Constant(i32v, [0] * _LANES))

        def bytes_at(offset):
            ptr = builder.gep(context.make_array(b_t)(context, builder, b).data, [offset])
            return builder.zext(builder.load(builder.bitcast(ptr, i8v.as_pointer()), align=1), i32v)

        def lane_field(vec, sh, mk):
            vec = builder.lshr(vec, splat(builder.trunc(sh, i32), i32v))
            return builder.and_(vec, splat(builder.trunc(mk, i32), i32v))

        code = builder.xor(bytes_at(off), splat(builder.trunc(flip, i32), i32v))
        code = lane_field(code, shift, mask)
        if high == "bits":  # h1: a 32-bit field, bit (h2 + l) of it is bit 4 of lane l
            bits = builder.lshr(splat(builder.trunc(h1, i32), i32v),
                                builder.add(splat(builder.trunc(h2, i32), i32v), ir.Constant(i32v, list(range(_LANES)))))
            code = builder.or_(code, builder.shl(builder.and_(bits, ir.Constant(i32v, [1] * _LANES)),
                                                 ir.Constant(i32v, [4] * _LANES)))
        elif high == "bytes":  # lane l gets ((b[h1 + l] >> h2) & h3) << h4
            extra = lane_field(bytes_at(h1), h2, h3)
            code = builder.or_(code, builder.shl(extra, splat(builder.trunc(h4, i32), i32v)))
        v = builder.uitofp(code, f32v)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32v, [f32v] * 3), "llvm.fma.v16f32")
        v = builder.call(fma, [v, splat(scale, f32v), splat(bias, f32v)])
        xa = context.make_array(x_t)(context, builder, x)
        aa = context.make_array(acc_t)(context, builder, acc)
        k = cgutils.unpack_tuple(builder, xa.shape)[1]
        width = cgutils.unpack_tuple(builder, aa.shape)[1]
        # ACC_SLOTS accumulators per input, by value position: independent FMA chains
        slot = builder.and_(xoff, ir.Constant(xoff.type, _LANES * ACC_SLOTS - 1))

        def accumulate(r):
            xp = builder.bitcast(builder.gep(xa.data, [builder.add(builder.mul(r, k), xoff)]), f32v.as_pointer())
            ap = builder.bitcast(builder.gep(aa.data, [builder.add(builder.mul(r, width), slot)]), f32v.as_pointer())
            builder.store(builder.call(fma, [v, builder.load(xp, align=4), builder.load(ap, align=4)]), ap, align=4)

        one = ir.Constant(n.type, 1)
        with builder.if_else(builder.icmp_signed("==", n, one), likely=True) as (single, batch):
            with single:  # a decode batch of one: no loop
                accumulate(ir.Constant(n.type, 0))
            with batch:
                with cgutils.for_range(builder, n) as loop:
                    accumulate(loop.index)
        return context.get_dummy_value()

    return codegen


def _make_fma16(high):
    @intrinsic
    def fma16(typingctx, acc, x, n, xoff, b, off, flip, shift, mask, scale, bias, h1, h2, h3, h4):
        f32_2d = types.Array(types.float32, 2, "C")
        if not (acc == f32_2d and isinstance(x, types.Array) and x.dtype == types.float32 and x.layout == "C"):
            return None
        if not (isinstance(b, types.Array) and b.dtype == types.uint8 and b.ndim == 1 and b.layout == "C"):
            return None
        ints = (types.intp,) * 7
        sig = types.void(acc, x, types.intp, types.intp, b, *ints[:4], types.float32, types.float32, *ints[:4])
        return sig, _fma16_codegen(high)

    return fma16


fma16 = _make_fma16(None)
fma16_bits = _make_fma16("bits")
fma16_bytes = _make_fma16("bytes")


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q8_0(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 34):
        o, y = blk * 34, blk * 32
        prefetch_ahead(b, o, 34)
        d = f16_at(b, o)
        for h in range(2):  # int8 codes: flip the sign bit to an unsigned code, then minus 128
            fma16(acc, x, n, y + 16 * h, b, o + 2 + 16 * h, 0x80, 0, 255, d, -128 * d, 0, 0, 0, 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q4_0(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 18):
        o, y = blk * 18, blk * 32
        prefetch_ahead(b, o, 18)
        d = f16_at(b, o)
        fma16(acc, x, n, y, b, o + 2, 0, 0, 15, d, -8 * d, 0, 0, 0, 0)
        fma16(acc, x, n, y + 16, b, o + 2, 0, 4, 15, d, -8 * d, 0, 0, 0, 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q4_1(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 20):
        o, y = blk * 20, blk * 32
        prefetch_ahead(b, o, 20)
        d, m = f16_at(b, o), f16_at(b, o + 2)
        fma16(acc, x, n, y, b, o + 4, 0, 0, 15, d, m, 0, 0, 0, 0)
        fma16(acc, x, n, y + 16, b, o + 4, 0, 4, 15, d, m, 0, 0, 0, 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q5_0(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 22):
        o, y = blk * 22, blk * 32
        prefetch_ahead(b, o, 22)
        d, qh = f16_at(b, o), u32_at(b, o + 2)
        fma16_bits(acc, x, n, y, b, o + 6, 0, 0, 15, d, -16 * d, qh, 0, 0, 0)
        fma16_bits(acc, x, n, y + 16, b, o + 6, 0, 4, 15, d, -16 * d, qh, 16, 0, 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q5_1(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 24):
        o, y = blk * 24, blk * 32
        prefetch_ahead(b, o, 24)
        d, m, qh = f16_at(b, o), f16_at(b, o + 2), u32_at(b, o + 4)
        fma16_bits(acc, x, n, y, b, o + 8, 0, 0, 15, d, m, qh, 0, 0, 0)
        fma16_bits(acc, x, n, y + 16, b, o + 8, 0, 4, 15, d, m, qh, 16, 0, 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q4_k(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 144):
        o, y = blk * 144, blk * QK
        prefetch_ahead(b, o, 144)
        d, dmin = f16_at(b, o), f16_at(b, o + 2)
        for c in range(4):
            sc1, m1 = scale_min_k4(b, o + 4, 2 * c)
            sc2, m2 = scale_min_k4(b, o + 4, 2 * c + 1)
            d1, mm1 = d * np.float32(sc1), dmin * np.float32(m1)
            d2, mm2 = d * np.float32(sc2), dmin * np.float32(m2)
            q0, y0 = o + 16 + 32 * c, y + 64 * c
            for h in range(2):
                fma16(acc, x, n, y0 + 16 * h, b, q0 + 16 * h, 0, 0, 15, d1, -mm1, 0, 0, 0, 0)
                fma16(acc, x, n, y0 + 32 + 16 * h, b, q0 + 16 * h, 0, 4, 15, d2, -mm2, 0, 0, 0, 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q5_k(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 176):
        o, y = blk * 176, blk * QK
        prefetch_ahead(b, o, 176)
        d, dmin = f16_at(b, o), f16_at(b, o + 2)
        for c in range(4):
            sc1, m1 = scale_min_k4(b, o + 4, 2 * c)
            sc2, m2 = scale_min_k4(b, o + 4, 2 * c + 1)
            d1, mm1 = d * np.float32(sc1), dmin * np.float32(m1)
            d2, mm2 = d * np.float32(sc2), dmin * np.float32(m2)
            q0, y0 = o + 48 + 32 * c, y + 64 * c
            for h in range(2):
                qh = o + 16 + 16 * h
                fma16_bytes(acc, x, n, y0 + 16 * h, b, q0 + 16 * h, 0, 0, 15, d1, -mm1, qh, 2 * c, 1, 4)
                fma16_bytes(acc, x, n, y0 + 32 + 16 * h, b, q0 + 16 * h, 0, 4, 15, d2, -mm2, qh, 2 * c + 1, 1, 4)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q6_k(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 210):
        o, y = blk * 210, blk * QK
        prefetch_ahead(b, o, 210)
        d = f16_at(b, o + 208)
        for half in range(2):
            ql, qh, sc, y0 = o + 64 * half, o + 128 + 32 * half, o + 192 + 8 * half, y + 128 * half
            for g in range(2):  # 16 values per scale
                for part in range(4):  # values y0 + 32 * part + 16 * g + l
                    ds = d * np.float32(np.int8(b[sc + g + 2 * part]))
                    lo = ql + 16 * g + 32 * (part % 2)
                    fma16_bytes(acc, x, n, y0 + 32 * part + 16 * g, b, lo, 0, 4 * (part // 2), 15, ds, -32 * ds,
                                qh + 16 * g, 2 * part, 3, 4)


_ROW_DOTS = {
    "Q8_0": _dot_q8_0,
    "Q4_0": _dot_q4_0,
    "Q4_1": _dot_q4_1,
    "Q5_0": _dot_q5_0,
    "Q5_1": _dot_q5_1,
    "Q4_K": _dot_q4_k,
    "Q5_K": _dot_q5_k,
    "Q6_K": _dot_q6_k,
}


def acc_floats(n):
    """float32 elements of the accumulator dot_rows needs for n input rows (room to align it)."""
    return n * _LANES * ACC_SLOTS + _LANES


def dot_rows(x, w, out, j0, j1, acc=None):
    """out[:, j0:j1] = x @ w[j0:j1].T for a block matrix w [m, blocks]; x [n, k] float32 C-contiguous.

    One pass over each weight row for all n inputs (fma16). acc: 1-D float32 work area of at least
    acc_floats(n) elements (a caller's workspace, so that decode allocates nothing); without it a
    [n, 64] accumulator is allocated per call.
    """
    raise NotImplementedError("numba only")


@overload(dot_rows, jit_options={"fastmath": True, "nogil": True})
def _dot_rows_overload(x, w, out, j0, j1, acc=None):
    name = record_name(w.dtype)
    if name is None:
        return None
    row_dot = _ROW_DOTS[name]

    def rows(x, wb, out, j0, j1, raw):
        n = x.shape[0]
        width = _LANES * ACC_SLOTS
        # on a cache line: a vector store split over two lines is not forwarded to the next load
        acc = line_start(raw)[: n * width].reshape((n, width))
        for j in range(j0, j1):
            acc[:] = 0.0
            row_dot(x, wb[j], acc)
            for i in range(n):
                total = np.float32(0.0)
                for l in range(width):
                    total += acc[i, l]
                out[i, j] = total

    rows = numba.njit(fastmath=True, nogil=True, inline="always")(rows)
    if acc is None or isinstance(acc, (types.NoneType, types.Omitted)):

        def impl_allocating(x, w, out, j0, j1, acc=None):
            rows(x, as_bytes(w), out, j0, j1, np.empty(x.shape[0] * _LANES * ACC_SLOTS + _LANES, np.float32))

        return impl_allocating

    def impl(x, w, out, j0, j1, acc=None):
        rows(x, as_bytes(w), out, j0, j1, acc)

    return impl
