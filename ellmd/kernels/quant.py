"""GGUF block formats kept in their blocks: dtypes, row decoders, and the generic row linear.

A quantized tensor is a numpy array of one structured dtype per GGUF block type (BLOCK_DTYPES),
so that, as for bf16/f16 (formats.py), the format is carried by the dtype inside kernels:
numba compiles one loop per block type. The layout is GGUF's, byte for byte, so a block tensor
of a GGUF file is a view of its memory map.

Shape legend:
  rows        weight rows (output features); k input features = blocks * BLOCK_SIZES[name]
  blocks      blocks per row
  [rows, blocks]      a quantized matrix; [E, rows, blocks] an expert stack kept as one array
  n           input rows of a linear (decode batch, 1..16)

njit API (callable from other numba code, every storage format):
  decode_row(w_row, out)            out[:k] = w_row as float32 (w_row: 1-D storage or blocks)
  linear_rows(x, w, out, j0, j1, acc=None)   out[:, j0:j1] = x @ w[j0:j1].T, x [n, k] float32
                                    (acc: dot_rows' work area, acc_floats(n) float32)
Kernels read the block bytes through as_bytes (a uint8 view, no copy).

Kernel paths (cpu.py): the portable kernels (exact to float32 rounding) convert blocks to float32
in vector registers (dot_rows), with LLVM's generic vectors (AVX2, AVX-512 or SSE); the "vnni"
path (ELLM_KERNELS=vnni or auto, where the CPU has AVX512-VNNI) multiplies Q8_0/Q4_0/Q4_1 blocks
by int8-quantized activations with vpdpbusd (rows_vnni), ~4x faster per row but ~5% of the largest
logit off on SmolLM2 (enough to change its greedy answers), so it is asked for, not assumed.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ellmd.kernels.formats import decode, f16_to_f32

QK = 256  # weights per K-quant super-block

BLOCK_DTYPES = {
    "Q8_0": np.dtype([("d", "<u2"), ("qs", "i1", (32,))]),
    "Q4_0": np.dtype([("d", "<u2"), ("qs", "u1", (16,))]),
    "Q4_1": np.dtype([("d", "<u2"), ("m", "<u2"), ("qs", "u1", (16,))]),
    "Q5_0": np.dtype([("d", "<u2"), ("qh", "u1", (4,)), ("qs", "u1", (16,))]),
    "Q5_1": np.dtype([("d", "<u2"), ("m", "<u2"), ("qh", "u1", (4,)), ("qs", "u1", (16,))]),
    "Q4_K": np.dtype([("d", "<u2"), ("dmin", "<u2"), ("scales", "u1", (12,)), ("qs", "u1", (128,))]),
    "Q5_K": np.dtype(
        [("d", "<u2"), ("dmin", "<u2"), ("scales", "u1", (12,)), ("qh", "u1", (32,)), ("qs", "u1", (128,))]
    ),
    "Q6_K": np.dtype([("ql", "u1", (128,)), ("qh", "u1", (64,)), ("scales", "i1", (16,)), ("d", "<u2")]),
}
BLOCK_SIZES = {name: (QK if name.endswith("_K") else 32) for name in BLOCK_DTYPES}
_NAME_OF = {dt: name for name, dt in BLOCK_DTYPES.items()}


def block_name(a) -> str | None:
    """The GGUF block type of an array (or dtype), None for float storage."""
    return _NAME_OF.get(getattr(a, "dtype", a))


def is_blocks(a) -> bool:
    """True when a holds quantized blocks."""
    return block_name(a) is not None


def columns(a) -> int:
    """Input features of a weight matrix (its logical last dimension)."""
    name = block_name(a)
    return a.shape[-1] * BLOCK_SIZES[name] if name else a.shape[-1]


def from_bytes(raw: np.ndarray, name: str, shape) -> np.ndarray:
    """GGUF tensor bytes -> block array of logical shape [..., rows, k] (a view, no copy)."""
    blocks = np.asarray(raw).reshape(-1).view(BLOCK_DTYPES[name])
    return blocks.reshape(*shape[:-1], shape[-1] // BLOCK_SIZES[name])


def dequantize(a: np.ndarray) -> np.ndarray:
    """Block array [..., blocks] -> float32 [..., k], by the gguf package (the reference)."""
    import gguf

    name = block_name(a)
    raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1, a.dtype.itemsize)
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    return values.reshape(*a.shape[:-1], a.shape[-1] * BLOCK_SIZES[name]).astype(np.float32)


def quantize(x: np.ndarray, name: str) -> np.ndarray:
    """float32 [..., k] -> block array [..., k / block size] (gguf's quantizer; Q4_K our own)."""
    import gguf

    x = np.ascontiguousarray(x, dtype=np.float32)
    size = BLOCK_SIZES[name]
    if x.shape[-1] % size:
        raise ValueError(f"{name} needs a width that is a multiple of {size}, got {x.shape[-1]}")
    if name == "Q4_K":
        raw = _quantize_q4_k(x.reshape(-1, QK))
    else:
        raw = gguf.quants.quantize(x.reshape(-1, size), gguf.GGMLQuantizationType[name])
    return np.ascontiguousarray(raw).view(BLOCK_DTYPES[name]).reshape(*x.shape[:-1], x.shape[-1] // size)


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[N, 256] float32 -> [N, 144] uint8 Q4_K blocks: 8 sub-blocks of 32 with a 6-bit scale and min.

    Scale and min of a sub-block span its range (min clipped to <= 0), as llama.cpp's reference
    quantizer starts from before its refinement search.
    """
    sub = x.reshape(len(x), 8, 32).astype(np.float64)
    lo = np.minimum(sub.min(axis=2), 0.0)  # [N, 8]
    scale = (sub.max(axis=2) - lo) / 15.0  # [N, 8]
    d = scale.max(axis=1) / 63.0  # [N]
    dmin = -lo.min(axis=1) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    d, dmin = d16.astype(np.float64), dmin16.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmin[:, None] > 0, np.rint(-lo / dmin[:, None]), 0).clip(0, 63).astype(np.uint8)
        step = d[:, None] * sc  # [N, 8]
        q = np.where(step[..., None] > 0, np.rint((sub + (dmin[:, None] * mn)[..., None]) / step[..., None]), 0)
    q = q.clip(0, 15).astype(np.uint8).reshape(len(x), 4, 2, 32)  # [N, 64-chunk, half, 32]
    scales = np.zeros((len(x), 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(x), 128)
    return np.concatenate([d16.view(np.uint8).reshape(-1, 2), dmin16.view(np.uint8).reshape(-1, 2), scales, qs], 1)


# ---- numba: byte views and row decoders -----------------------------------------------------


@intrinsic
def as_bytes(typingctx, a):
    """A C-contiguous block array [..., blocks] viewed as uint8 [..., blocks * itemsize]."""
    if not (isinstance(a, types.Array) and isinstance(a.dtype, types.Record) and a.layout == "C"):
        return None
    ret = types.Array(types.uint8, a.ndim, "C", readonly=not a.mutable)
    sig = ret(a)

    def codegen(context, builder, signature, args):
        src = context.make_array(signature.args[0])(context, builder, args[0])
        dst = context.make_array(ret)(context, builder)
        shape = cgutils.unpack_tuple(builder, src.shape)
        strides = cgutils.unpack_tuple(builder, src.strides)
        intp = context.get_value_type(types.intp)
        size = ir.Constant(intp, signature.args[0].dtype.size)
        shape[-1] = builder.mul(shape[-1], size)
        strides[-1] = ir.Constant(intp, 1)
        context.populate_array(
            dst,
            data=builder.bitcast(src.data, dst.data.type),
            shape=cgutils.pack_array(builder, shape),
            strides=cgutils.pack_array(builder, strides),
            itemsize=ir.Constant(intp, 1),
            meminfo=src.meminfo,
            parent=src.parent,
        )
        out = dst._getvalue()
        context.nrt.incref(builder, ret, out)  # a new reference to the same memory
        return out

    return sig, codegen


@intrinsic
def _address(typingctx, a):
    """The address of an array's first element."""
    if not isinstance(a, types.Array):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, context.get_value_type(types.intp))

    return types.intp(a), codegen


@intrinsic
def _f16_at(typingctx, b, o):
    """The f16 at bytes b[o:o+2] as float32 (one vcvtph2ps where the CPU has F16C)."""
    if not (isinstance(b, types.Array) and b.dtype == types.uint8 and b.ndim == 1):
        return None
    sig = types.float32(b, types.intp)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.HalfType().as_pointer())
        return builder.fpext(builder.load(ptr, align=1), ir.FloatType())

    return sig, codegen


@numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
def _u32_at(b, o):
    return (
        np.uint32(b[o])
        | (np.uint32(b[o + 1]) << np.uint32(8))
        | (np.uint32(b[o + 2]) << np.uint32(16))
        | (np.uint32(b[o + 3]) << np.uint32(24))
    )


@numba.njit(cache=True, nogil=True, fastmath=True)
def _row_q8_0(b, out):
    for blk in range(b.shape[0] // 34):
        o, y = blk * 34, blk * 32
        d = _f16_at(b, o)
        for l in range(32):
            out[y + l] = d * np.float32(np.int8(b[o + 2 + l]))


@numba.njit(cache=True, nogil=True, fastmath=True)
def _row_q4_0(b, out):
    for blk in range(b.shape[0] // 18):
        o, y = blk * 18, blk * 32
        d = _f16_at(b, o)
        for l in range(16):
            q = np.int32(b[o + 2 + l])
            out[y + l] = d * np.float32((q & 15) - 8)
            out[y + 16 + l] = d * np.float32((q >> 4) - 8)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _row_q4_1(b, out):
    for blk in range(b.shape[0] // 20):
        o, y = blk * 20, blk * 32
        d, m = _f16_at(b, o), _f16_at(b, o + 2)
        for l in range(16):
            q = np.int32(b[o + 4 + l])
            out[y + l] = d * np.float32(q & 15) + m
            out[y + 16 + l] = d * np.float32(q >> 4) + m


@numba.njit(cache=True, nogil=True, fastmath=True)
def _row_q5_0(b, out):
    for blk in range(b.shape[0] // 22):
        o, y = blk * 22, blk * 32
        d = _f16_at(b, o)
        qh = _u32_at(b, o + 2)
        for l in range(16):
            q = np.int32(b[o + 6 + l])
            lo = (q & 15) | np.int32(((qh >> np.uint32(l)) & np.uint32(1)) << np.uint32(4))
            hi = (q >> 4) | np.int32(((qh >> np.uint32(l + 16)) & np.uint32(1)) << np.uint32(4))
            out[y + l] = d * np.float32(lo - 16)
            out[y + 16 + l] = d * np.float32(hi - 16)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _row_q5_1(b, out):
    for blk in range(b.shape[0] // 24):
        o, y = blk * 24, blk * 32
        d, m = _f16_at(b, o), _f16_at(b, o + 2)
        qh = _u32_at(b, o + 4)
        for l in range(16):
            q = np.int32(b[o + 8 + l])
            lo = (q & 15) | np.int32(((qh >> np.uint32(l)) & np.uint32(1)) << np.uint32(4))
            hi = (q >> 4) | np.int32(((qh >> np.uint32(l + 16)) & np.uint32(1)) << np.uint32(4))
            out[y + l] = d * np.float32(lo) + m
            out[y + 16 + l] = d * np.float32(hi) + m


@numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
def _scale_min_k4(b, s, j):
    """6-bit scale and min of sub-block j from the 12 scale bytes at b[s:]."""
    if j < 4:
        return np.int32(b[s + j] & 63), np.int32(b[s + j + 4] & 63)
    sc = (b[s + j + 4] & 15) | ((b[s + j - 4] >> 6) << 4)
    mn = (b[s + j + 4] >> 4) | ((b[s + j] >> 6) << 4)
    return np.int32(sc), np.int32(mn)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _row_q4_k(b, out):
    for blk in range(b.shape[0] // 144):
        o, y = blk * 144, blk * QK
        d, dmin = _f16_at(b, o), _f16_at(b, o + 2)
        for c in range(4):
            sc1, m1 = _scale_min_k4(b, o + 4, 2 * c)
            sc2, m2 = _scale_min_k4(b, o + 4, 2 * c + 1)
            d1, mm1 = d * np.float32(sc1), dmin * np.float32(m1)
            d2, mm2 = d * np.float32(sc2), dmin * np.float32(m2)
            q0, y0 = o + 16 + 32 * c, y + 64 * c
            for l in range(32):
                q = np.int32(b[q0 + l])
                out[y0 + l] = d1 * np.float32(q & 15) - mm1
                out[y0 + 32 + l] = d2 * np.float32(q >> 4) - mm2


@numba.njit(cache=True, nogil=True, fastmath=True)
def _row_q5_k(b, out):
    for blk in range(b.shape[0] // 176):
        o, y = blk * 176, blk * QK
        d, dmin = _f16_at(b, o), _f16_at(b, o + 2)
        for c in range(4):
            sc1, m1 = _scale_min_k4(b, o + 4, 2 * c)
            sc2, m2 = _scale_min_k4(b, o + 4, 2 * c + 1)
            d1, mm1 = d * np.float32(sc1), dmin * np.float32(m1)
            d2, mm2 = d * np.float32(sc2), dmin * np.float32(m2)
            q0, y0 = o + 48 + 32 * c, y + 64 * c
            for l in range(32):
                q = np.int32(b[q0 + l])
                h = np.int32(b[o + 16 + l]) >> (2 * c)
                out[y0 + l] = d1 * np.float32((q & 15) | ((h & 1) << 4)) - mm1
                out[y0 + 32 + l] = d2 * np.float32((q >> 4) | ((h & 2) << 3)) - mm2


@numba.njit(cache=True, nogil=True, fastmath=True)
def _row_q6_k(b, out):
    for blk in range(b.shape[0] // 210):
        o, y = blk * 210, blk * QK
        d = _f16_at(b, o + 208)
        for half in range(2):
            ql, qh, sc, y0 = o + 64 * half, o + 128 + 32 * half, o + 192 + 8 * half, y + 128 * half
            for l in range(32):
                s = l // 16
                a, c, h = np.int32(b[ql + l]), np.int32(b[ql + 32 + l]), np.int32(b[qh + l])
                out[y0 + l] = d * np.float32(np.int8(b[sc + s])) * np.float32(((a & 15) | ((h & 3) << 4)) - 32)
                out[y0 + 32 + l] = d * np.float32(np.int8(b[sc + s + 2])) * np.float32(
                    ((c & 15) | (((h >> 2) & 3) << 4)) - 32
                )
                out[y0 + 64 + l] = d * np.float32(np.int8(b[sc + s + 4])) * np.float32(
                    ((a >> 4) | (((h >> 4) & 3) << 4)) - 32
                )
                out[y0 + 96 + l] = d * np.float32(np.int8(b[sc + s + 6])) * np.float32(
                    ((c >> 4) | (((h >> 6) & 3) << 4)) - 32
                )


_ROW_DECODERS = {
    "Q8_0": _row_q8_0,
    "Q4_0": _row_q4_0,
    "Q4_1": _row_q4_1,
    "Q5_0": _row_q5_0,
    "Q5_1": _row_q5_1,
    "Q4_K": _row_q4_k,
    "Q5_K": _row_q5_k,
    "Q6_K": _row_q6_k,
}
_RECORD_NAMES = {numba.from_dtype(dt): name for name, dt in BLOCK_DTYPES.items()}


def record_name(numba_dtype) -> str | None:
    """The block type of a numba array dtype (typing time), None for float storage."""
    return _RECORD_NAMES.get(numba_dtype)


def decode_row(w_row, out):
    """out[:k] = one weight row as float32, inside kernels: storage (formats.py) or blocks."""
    raise NotImplementedError("numba only")


@overload(decode_row, jit_options={"fastmath": True, "nogil": True})
def _decode_row_overload(w_row, out):
    name = record_name(w_row.dtype)
    if name is not None:
        row_decoder = _ROW_DECODERS[name]
        return lambda w_row, out: row_decoder(as_bytes(w_row), out)

    def impl(w_row, out):
        for c in range(w_row.shape[0]):
            out[c] = decode(w_row[c])

    return impl


# ---- numba: fused decode kernels -------------------------------------------------------------
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
        d = _f16_at(b, o)
        for h in range(2):  # int8 codes: flip the sign bit to an unsigned code, then minus 128
            fma16(acc, x, n, y + 16 * h, b, o + 2 + 16 * h, 0x80, 0, 255, d, -128 * d, 0, 0, 0, 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q4_0(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 18):
        o, y = blk * 18, blk * 32
        d = _f16_at(b, o)
        fma16(acc, x, n, y, b, o + 2, 0, 0, 15, d, -8 * d, 0, 0, 0, 0)
        fma16(acc, x, n, y + 16, b, o + 2, 0, 4, 15, d, -8 * d, 0, 0, 0, 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q4_1(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 20):
        o, y = blk * 20, blk * 32
        d, m = _f16_at(b, o), _f16_at(b, o + 2)
        fma16(acc, x, n, y, b, o + 4, 0, 0, 15, d, m, 0, 0, 0, 0)
        fma16(acc, x, n, y + 16, b, o + 4, 0, 4, 15, d, m, 0, 0, 0, 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q5_0(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 22):
        o, y = blk * 22, blk * 32
        d, qh = _f16_at(b, o), _u32_at(b, o + 2)
        fma16_bits(acc, x, n, y, b, o + 6, 0, 0, 15, d, -16 * d, qh, 0, 0, 0)
        fma16_bits(acc, x, n, y + 16, b, o + 6, 0, 4, 15, d, -16 * d, qh, 16, 0, 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q5_1(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 24):
        o, y = blk * 24, blk * 32
        d, m, qh = _f16_at(b, o), _f16_at(b, o + 2), _u32_at(b, o + 4)
        fma16_bits(acc, x, n, y, b, o + 8, 0, 0, 15, d, m, qh, 0, 0, 0)
        fma16_bits(acc, x, n, y + 16, b, o + 8, 0, 4, 15, d, m, qh, 16, 0, 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q4_k(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 144):
        o, y = blk * 144, blk * QK
        d, dmin = _f16_at(b, o), _f16_at(b, o + 2)
        for c in range(4):
            sc1, m1 = _scale_min_k4(b, o + 4, 2 * c)
            sc2, m2 = _scale_min_k4(b, o + 4, 2 * c + 1)
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
        d, dmin = _f16_at(b, o), _f16_at(b, o + 2)
        for c in range(4):
            sc1, m1 = _scale_min_k4(b, o + 4, 2 * c)
            sc2, m2 = _scale_min_k4(b, o + 4, 2 * c + 1)
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
        d = _f16_at(b, o + 208)
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
        skip = (-_address(raw) % 64) // 4
        acc = raw[skip : skip + n * width].reshape((n, width))
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


# ---- numba: the int8 path (AVX512-VNNI vpdpbusd) ---------------------------------------------
#
# As llama.cpp's q8 x q8: the activations are quantized per block of 32 to int8 with a float
# scale (quantize_activations), and a Q8_0 weight block meets them in one vpdpbusd (32 byte
# products summed by fours into 8 int32 lanes). vpdpbusd multiplies unsigned by signed bytes,
# so the weights' sign bit is flipped (w + 128) and 128 * sum(xq) taken off per block.


@numba.njit(cache=True, nogil=True, fastmath=True)
def quantize_activations(x, xq, xd, xs):
    """x [n, k] float32 -> xq [n, k] int8, xd [n, k/32] float32 scales, xs [n, k/32] int32 sums."""
    n, k = x.shape
    for i in range(n):
        for blk in range(k // 32):
            amax = np.float32(0.0)
            for l in range(32):
                amax = max(amax, abs(x[i, blk * 32 + l]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            total = 0
            for l in range(32):
                q = np.int32(np.rint(x[i, blk * 32 + l] * inv))
                xq[i, blk * 32 + l] = np.int8(q)
                total += q
            xd[i, blk] = d
            xs[i, blk] = total


def quantize_activations_ref(x):
    """numpy reference of quantize_activations: returns (xq, xd, xs)."""
    n, k = x.shape
    blocks = x.reshape(n, k // 32, 32)
    d = np.abs(blocks).max(axis=2) / np.float32(127.0)  # [n, k/32]
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.int32)
    return q.astype(np.int8).reshape(n, k), d.astype(np.float32), q.sum(axis=2).astype(np.int32)


def rows_vnni_ref(xq, xd, xs, w, out, j0, j1):
    """numpy reference of rows_vnni: the dequantized activations times the dequantized blocks."""
    n, k = xq.shape
    x = (xq.astype(np.float64).reshape(n, -1, 32) * xd[..., None]).reshape(n, k)
    out[:, j0:j1] = (x @ dequantize(w[j0:j1]).astype(np.float64).T).astype(np.float32)


# block type -> (bytes per block, offset of the codes, per-block correction): the block's value
# is sum(code * xq) * d * dx + correction * dx * sum(xq)
_VNNI_BLOCKS = {"Q8_0": (34, 2, "flip"), "Q4_0": (18, 2, "minus8"), "Q4_1": (20, 4, "min")}


def _make_rows_vnni(name):
    size, codes_at, correction = _VNNI_BLOCKS[name]

    @intrinsic
    def rows_vnni(typingctx, wb, xq, xd, xs, out, j):
        """out[:, j] = block row wb (bytes) times every quantized activation row, by vpdpbusd."""
        if not (isinstance(wb, types.Array) and wb.dtype == types.uint8 and wb.ndim == 1):
            return None
        return types.void(wb, xq, xd, xs, out, types.intp), _rows_vnni_codegen(size, codes_at, correction)

    return rows_vnni


def _rows_vnni_codegen(size, codes_at, correction):
    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:5], args[:5])]
        w_a, xq_a, xd_a, xs_a, out_a = arrays
        j_v = args[5]
        i8, i32, f32, f16 = ir.IntType(8), ir.IntType(32), ir.FloatType(), ir.HalfType()
        i8x16, i8x32, i32x8, f32x8 = (ir.VectorType(i8, 16), ir.VectorType(i8, 32), ir.VectorType(i32, 8),
                                      ir.VectorType(f32, 8))
        intp = context.get_value_type(types.intp)
        dpbusd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i32x8, [i32x8] * 3), "llvm.x86.avx512.vpdpbusd.256"
        )
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32x8, [f32x8] * 3), "llvm.fma.v8f32")
        n, k = cgutils.unpack_tuple(builder, xq_a.shape)
        nb = cgutils.unpack_tuple(builder, xd_a.shape)[1]
        acc = cgutils.alloca_once(builder, f32x8)
        corr = cgutils.alloca_once(builder, f32)

        def const(v):
            return ir.Constant(intp, v)

        def f16_at(offset):
            ptr = builder.bitcast(builder.gep(w_a.data, [offset]), f16.as_pointer())
            return builder.fpext(builder.load(ptr, align=1), f32)

        def codes(o):
            """The block's 32 codes as unsigned bytes, in value order."""
            ptr = builder.gep(w_a.data, [builder.add(o, const(codes_at))])
            if correction == "flip":  # int8: flip the sign bit
                raw = builder.load(builder.bitcast(ptr, i8x32.as_pointer()), align=1)
                return builder.xor(raw, ir.Constant(i8x32, [0x80] * 32))
            raw = builder.load(builder.bitcast(ptr, i8x16.as_pointer()), align=1)
            lo = builder.and_(raw, ir.Constant(i8x16, [15] * 16))
            hi = builder.lshr(raw, ir.Constant(i8x16, [4] * 16))
            return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(i32, 32), list(range(32))))

        with cgutils.for_range(builder, n) as rows:
            i = rows.index
            builder.store(ir.Constant(f32x8, [0.0] * 8), acc)
            builder.store(ir.Constant(f32, 0.0), corr)
            with cgutils.for_range(builder, nb) as blocks:
                blk = blocks.index
                o = builder.mul(blk, const(size))
                dw = f16_at(o)
                xi = builder.add(builder.mul(i, k), builder.mul(blk, const(32)))
                xv = builder.load(builder.bitcast(builder.gep(xq_a.data, [xi]), i8x32.as_pointer()), align=1)
                dp = builder.call(dpbusd, [ir.Constant(i32x8, [0] * 8), builder.bitcast(codes(o), i32x8),
                                           builder.bitcast(xv, i32x8)])
                bi = builder.add(builder.mul(i, nb), blk)
                dx = builder.load(builder.gep(xd_a.data, [bi]))
                s = builder.fmul(dw, dx)
                sv = builder.shuffle_vector(
                    builder.insert_element(ir.Constant(f32x8, ir.Undefined), s, ir.Constant(i32, 0)),
                    ir.Constant(f32x8, ir.Undefined), ir.Constant(i32x8, [0] * 8),
                )
                builder.store(builder.call(fma, [builder.sitofp(dp, f32x8), sv, builder.load(acc)]), acc)
                if correction == "min":
                    c = builder.fmul(f16_at(builder.add(o, const(2))), dx)
                else:
                    c = builder.fmul(s, ir.Constant(f32, -128.0 if correction == "flip" else -8.0))
                xsum = builder.sitofp(builder.load(builder.gep(xs_a.data, [bi])), f32)
                builder.store(builder.fadd(builder.load(corr), builder.fmul(c, xsum)), corr)
            total = builder.load(acc)
            lanes = [builder.extract_element(total, ir.Constant(i32, lane)) for lane in range(8)]
            while len(lanes) > 1:
                lanes = [builder.fadd(lanes[a], lanes[a + 1]) for a in range(0, len(lanes), 2)]
            value = builder.fadd(lanes[0], builder.load(corr))
            st0, st1 = cgutils.unpack_tuple(builder, out_a.strides)  # out may be a column slice
            at = builder.add(builder.mul(i, st0), builder.mul(j_v, st1))
            ptr = builder.gep(builder.bitcast(out_a.data, ir.IntType(8).as_pointer()), [at])
            builder.store(value, builder.bitcast(ptr, f32.as_pointer()))
        return context.get_dummy_value()

    return codegen


_ROWS_VNNI = {name: _make_rows_vnni(name) for name in _VNNI_BLOCKS}
VNNI_BLOCKS = tuple(_VNNI_BLOCKS)


def rows_vnni(xq, xd, xs, w, out, j0, j1):
    """out[:, j0:j1] = x @ w[j0:j1].T for w in a VNNI_BLOCKS type, x given quantized
    (quantize_activations): xq [n, k] int8, xd [n, k/32] float32, xs [n, k/32] int32, all
    C-contiguous; out: [n, m] float32, any layout. Needs AVX512-VNNI (the "vnni" path of cpu.py)."""
    raise NotImplementedError("numba only")


@overload(rows_vnni, jit_options={"fastmath": True, "nogil": True})
def _rows_vnni_overload(xq, xd, xs, w, out, j0, j1):
    name = record_name(w.dtype)
    if name not in _ROWS_VNNI:
        return None
    row_kernel = _ROWS_VNNI[name]

    def impl(xq, xd, xs, w, out, j0, j1):
        wb = as_bytes(w)
        for j in range(j0, j1):
            row_kernel(wb[j], xq, xd, xs, out, j)

    return impl
