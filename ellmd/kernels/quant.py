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
in vector registers (dot_rows), with LLVM's generic vectors (AVX2, AVX-512 or SSE). Where the CPU
has AVX512-VNNI (or, for int16, AVX2), rows_vnni multiplies the codes of every block type in
integers by quantized activations: to int16 with vpdpwssd (AVX2: vpmaddwd + vpaddd) on the
"int16" path (the default; one scale per 256 values, ~1e-4 of a product, SmolLM2's logits within
2.5e-4 of the reference and its greedy text unchanged), or, one scale per 32 values, to int8
with vpdpbusd on the "vnni" path (as llama.cpp's q8 x q8; ~1% of a product, which moves
SmolLM2's logits by a few percent and changes some greedy answers, so it is asked for).
rows_vnni serves decode and prefill alike (matmul._linear_int tiles prefill's rows over it), and
sums an input row in one order whatever rows share its pass: a token's numbers do not depend on
the chunk or the batch it comes in.
"""

import numba
import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ellmd.kernels import cpu, tile
from ellmd.kernels.formats import decode, f16_to_f32

QK = 256  # weights per K-quant super-block
# bytes ahead of the one in use that the kernels streaming weight rows ask for: this machine's hardware
# prefetcher alone left Q4_K decode at 8 of the 19 Gw/s a core reaches with it (2,048 measured
# best of 1-8 KiB); scripts/kernel_bench.py
PREFETCH = 2048

binding.initialize_native_asmparser()  # numba's object emitter then takes inline assembly (_dot_words)

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
def _prefetch(typingctx, b, o):
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


@numba.njit(cache=True, nogil=True, inline="always")
def _prefetch_ahead(b, o, size):
    """Ask for the cache lines of the size bytes PREFETCH past b[o] (see PREFETCH)."""
    for line in range(0, size, 64):
        _prefetch(b, o + PREFETCH + line)


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
        _prefetch_ahead(b, o, 34)
        d = _f16_at(b, o)
        for h in range(2):  # int8 codes: flip the sign bit to an unsigned code, then minus 128
            fma16(acc, x, n, y + 16 * h, b, o + 2 + 16 * h, 0x80, 0, 255, d, -128 * d, 0, 0, 0, 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q4_0(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 18):
        o, y = blk * 18, blk * 32
        _prefetch_ahead(b, o, 18)
        d = _f16_at(b, o)
        fma16(acc, x, n, y, b, o + 2, 0, 0, 15, d, -8 * d, 0, 0, 0, 0)
        fma16(acc, x, n, y + 16, b, o + 2, 0, 4, 15, d, -8 * d, 0, 0, 0, 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q4_1(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 20):
        o, y = blk * 20, blk * 32
        _prefetch_ahead(b, o, 20)
        d, m = _f16_at(b, o), _f16_at(b, o + 2)
        fma16(acc, x, n, y, b, o + 4, 0, 0, 15, d, m, 0, 0, 0, 0)
        fma16(acc, x, n, y + 16, b, o + 4, 0, 4, 15, d, m, 0, 0, 0, 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q5_0(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 22):
        o, y = blk * 22, blk * 32
        _prefetch_ahead(b, o, 22)
        d, qh = _f16_at(b, o), _u32_at(b, o + 2)
        fma16_bits(acc, x, n, y, b, o + 6, 0, 0, 15, d, -16 * d, qh, 0, 0, 0)
        fma16_bits(acc, x, n, y + 16, b, o + 6, 0, 4, 15, d, -16 * d, qh, 16, 0, 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q5_1(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 24):
        o, y = blk * 24, blk * 32
        _prefetch_ahead(b, o, 24)
        d, m, qh = _f16_at(b, o), _f16_at(b, o + 2), _u32_at(b, o + 4)
        fma16_bits(acc, x, n, y, b, o + 8, 0, 0, 15, d, m, qh, 0, 0, 0)
        fma16_bits(acc, x, n, y + 16, b, o + 8, 0, 4, 15, d, m, qh, 16, 0, 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_q4_k(x, b, acc):
    n = x.shape[0]
    for blk in range(b.shape[0] // 144):
        o, y = blk * 144, blk * QK
        _prefetch_ahead(b, o, 144)
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
        _prefetch_ahead(b, o, 176)
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
        _prefetch_ahead(b, o, 210)
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


# ---- numba: the integer paths (vpdpbusd, vpdpwssd or AVX2 vpmaddwd) ----------------------------
#
# As llama.cpp's q8 x q8: the activations are quantized per block of 32 values
# (quantize_activations), to int8 for vpdpbusd (unsigned x signed bytes: 32 products summed by
# fours into 8 int32 lanes) or to int16 for vpdpwssd (signed words: 32 products summed by pairs
# into 16 int32 lanes). A group of 32 weights is a vector of unsigned codes c whose values are
# a * c + b (a and b per 16 values), so with the activations' scale dx and code sums per 16 (xs)
#   sum(w * x) = dx * (a * sum(c * xq) + b * sum(xq))
# and every offset (Q8_0's sign flip, Q4_0's -8, Q6_K's -32) and every min is the exact b term.
# Rounding x to int8 costs ~1% of a product (rms), to int16 ~1e-4 of that.
# int16 activations share one scale per 256 values where the width allows (activation_group):
# then a K-quant super-block's 6- or 8-bit sub-block scales multiply its codes in int16
# (vpmullw), its 8 groups sum in int32, and one float step per super-block remains (the
# per-group float scaling cost more than the products). Every kernel streams its rows with
# software prefetches PREFETCH bytes ahead. rows_vnni unpacks a weight row's blocks (codes,
# scales; the int16 K-quants' scaled codes) once for a pass of up to 8 input rows (ROW_PASSES):
# one row at a time, the unpacking was redone for each, and n rows cost n times one.


def activation_group(k, itemsize):
    """Values sharing one activation scale: 256 for int16 codes of a width 256 divides (a K-quant
    super-block, whose sub-block scales then apply in integers), else 32 (one block)."""
    return 256 if itemsize == 2 and k % 256 == 0 else 32


@numba.njit(cache=True, nogil=True, fastmath=True)
def quantize_activations(x, xq, xd, xs):
    """x [n, k] float32 -> xq [n, k] int8 or int16 codes, xd [n, k/32] float32 scales (one per 32
    values, x ~ xq * xd; equal over each activation_group), xs [n, k/16] int32 sums of the codes
    per 16 values."""
    n, k = x.shape
    top = np.float32(127.0) if xq.itemsize == 1 else np.float32(32767.0)
    group = 256 if xq.itemsize == 2 and k % 256 == 0 else 32
    for i in range(n):
        for g0 in range(0, k, group):
            amax = np.float32(0.0)
            for l in range(g0, g0 + group):
                amax = max(amax, abs(x[i, l]))
            d = amax / top
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            for s in range(g0 // 16, (g0 + group) // 16):
                total = 0
                for l in range(16 * s, 16 * s + 16):
                    q = np.int32(np.rint(x[i, l] * inv))
                    xq[i, l] = q
                    total += q
                xs[i, s] = total
            xd[i, g0 // 32 : (g0 + group) // 32] = d


def quantize_activations_ref(x, dtype=np.int8):
    """numpy reference of quantize_activations, codes of dtype (int8 or int16): (xq, xd, xs)."""
    n, k = x.shape
    group = activation_group(k, np.dtype(dtype).itemsize)
    groups = x.reshape(n, k // group, group)
    d = np.abs(groups).max(axis=2) / np.float32(np.iinfo(dtype).max)  # [n, k/group]
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.rint(groups * inv[..., None]).astype(np.int32).reshape(n, k)
    d = np.repeat(d, group // 32, axis=1)
    return q.astype(dtype), d.astype(np.float32), q.reshape(n, k // 16, 16).sum(axis=2).astype(np.int32)


def rows_vnni_ref(xq, xd, xs, w, out, j0, j1):
    """numpy reference of rows_vnni: the dequantized activations times the dequantized blocks."""
    n, k = xq.shape
    x = (xq.astype(np.float64).reshape(n, -1, 32) * xd[..., None]).reshape(n, k)
    out[:, j0:j1] = (x @ dequantize(w[j0:j1]).astype(np.float64).T).astype(np.float32)


class _Ir:
    """IR building blocks of the integer kernels (codegen time): vectors, splats, byte reads."""

    def __init__(self, builder, data):
        self.b, self.data = builder, data  # data: the row's uint8 pointer
        self.i8, self.i32, self.f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()

    def vec(self, elem, count):
        return ir.VectorType(elem, count)

    def splat(self, value, count):
        vty = self.vec(value.type, count)
        v = self.b.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(self.i32, 0))
        return self.b.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(self.vec(self.i32, count), [0] * count))

    def const8(self, value):
        return ir.Constant(self.vec(self.i8, 32), [value] * 32)

    def ptr(self, at):
        return self.b.gep(self.data, [at])

    def bytes(self, at, count):
        return self.b.load(self.b.bitcast(self.ptr(at), self.vec(self.i8, count).as_pointer()), align=1)

    def prefetch(self, at, size):
        """Ask for the cache lines of the size bytes PREFETCH past byte offset at (a prefetch never
        faults, so past the row's end is fine: it is the next row's start)."""
        i8p = self.i8.as_pointer()
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ir.VoidType(), [i8p, self.i32, self.i32, self.i32]),
                                            "llvm.prefetch.p0")
        for line in range(0, size, 64):
            ptr = self.ptr(self.b.add(at, ir.Constant(at.type, PREFETCH + line)))
            self.b.call(fn, [ptr, ir.Constant(self.i32, 0), ir.Constant(self.i32, 3), ir.Constant(self.i32, 1)])

    def byte(self, at):
        return self.b.zext(self.b.load(self.ptr(at)), self.i32)

    def f16(self, at):
        """The f16 at byte offset at, as f32, converted from an integer register (movzwl, opaque to LLVM,
        then vmovd, which writes the whole vector register): LLVM loads a half with vpinsrw, which merges
        into the register's old value, and when that was the last block's scale the false dependency
        chained a row's blocks (Q4_0 at 0.6x)."""
        word = self.b.asm(ir.FunctionType(self.i32, [self.i8.as_pointer()]), "movzwl ($1), $0", "=r,r",
                          [self.ptr(at)], side_effect=False, name="load_word")
        pair = self.b.fpext(self.b.bitcast(word, self.vec(ir.HalfType(), 2)), self.vec(self.f32, 2))
        return self.b.extract_element(pair, ir.Constant(self.i32, 0))

    def u32(self, at):
        return self.b.load(self.b.bitcast(self.ptr(at), self.i32.as_pointer()), align=1)

    def nibbles(self, at):
        """16 bytes -> their 32 nibbles as bytes: the low ones, then the high ones (Q4_0's order)."""
        raw = self.bytes(at, 16)
        lo = self.b.and_(raw, ir.Constant(raw.type, [15] * 16))
        hi = self.b.lshr(raw, ir.Constant(raw.type, [4] * 16))
        return self.b.shuffle_vector(lo, hi, ir.Constant(self.vec(self.i32, 32), list(range(32))))

    def bit4(self, word):
        """An i32 -> 32 bytes, byte l = bit l of the word << 4 (the fifth bit of Q5 codes)."""
        bits = self.b.zext(self.b.bitcast(word, self.vec(ir.IntType(1), 32)), self.vec(self.i8, 32))
        return self.b.shl(bits, self.const8(4))

    def field(self, v, shift, mask, to):
        """((v >> shift) & mask) << to, bytewise."""
        return self.b.shl(self.b.and_(self.b.lshr(v, self.const8(shift)), self.const8(mask)), self.const8(to))


def _ir_scale_min_k4(q, s, j):
    """IR of the 6-bit scale and min of sub-block j (constant) from the 12 scale bytes at s."""
    b, c = q.b, lambda v: ir.Constant(q.i32, v)

    def byte(offset):
        return q.byte(b.add(s, ir.Constant(s.type, offset)))

    if j < 4:
        sc, mn = b.and_(byte(j), c(63)), b.and_(byte(j + 4), c(63))
    else:
        lo, top, top_m = byte(j + 4), byte(j - 4), byte(j)
        sc = b.or_(b.and_(lo, c(15)), b.shl(b.lshr(top, c(6)), c(4)))
        mn = b.or_(b.lshr(lo, c(4)), b.shl(b.lshr(top_m, c(6)), c(4)))
    return b.uitofp(sc, q.f32), b.uitofp(mn, q.f32)


def _group(name, q, o, g):
    """Group g of the block at byte offset o: (32 unsigned codes, offset, a_lo, a_hi, m), values
    a * (code - offset) + m, a of the first and of the second 16 values, m None for no min."""
    b = q.b

    def at(v):
        return b.add(o, ir.Constant(o.type, v))

    if name == "Q8_0":  # int8 codes: the sign bit flipped
        d = q.f16(o)
        return b.xor(q.bytes(at(2), 32), q.const8(0x80)), 128, d, d, None
    if name in ("Q4_0", "Q4_1"):
        d, one = q.f16(o), name == "Q4_1"
        return q.nibbles(at(4 if one else 2)), 0 if one else 8, d, d, q.f16(at(2)) if one else None
    if name in ("Q5_0", "Q5_1"):
        d, one = q.f16(o), name == "Q5_1"
        codes = b.or_(q.nibbles(at(8 if one else 6)), q.bit4(q.u32(at(4 if one else 2))))
        return codes, 0 if one else 16, d, d, q.f16(at(2)) if one else None
    if name in ("Q4_K", "Q5_K"):
        sc, mn = _ir_scale_min_k4(q, at(4), g)
        a, m = b.fmul(q.f16(o), sc), b.fneg(b.fmul(q.f16(at(2)), mn))
        qs = q.bytes(at((16 if name == "Q4_K" else 48) + 32 * (g // 2)), 32)
        codes = q.field(qs, 4 * (g % 2), 15, 0)
        if name == "Q5_K":
            codes = b.or_(codes, q.field(q.bytes(at(16), 32), g, 1, 4))
        return codes, 0, a, a, m
    half, part = divmod(g, 4)  # Q6_K: values 128 * half + 32 * part + l, a scale per 16
    ql = q.bytes(at(64 * half + 32 * (part % 2)), 32)
    codes = b.or_(q.field(ql, 4 * (part // 2), 15, 0), q.field(q.bytes(at(128 + 32 * half), 32), 2 * part, 3, 4))
    d = q.f16(at(208))
    a_lo, a_hi = (b.fmul(d, b.sitofp(b.load(q.ptr(at(192 + 8 * half + 2 * part + s))), q.f32)) for s in (0, 1))
    return codes, 32, a_lo, a_hi, None


def _k4_scale_bytes(q, o):
    """The 8 six-bit scales and the 8 mins of a Q4_K/Q5_K super-block at byte offset o, as two
    <8 x i8> vectors."""
    b = q.b
    raw = q.bytes(b.add(o, ir.Constant(o.type, 4)), 16)  # 12 scale bytes (and 4 code bytes)

    def pick(*index):
        return b.shuffle_vector(raw, raw, ir.Constant(q.vec(q.i32, 8), list(index)))

    def c8(v):
        return ir.Constant(q.vec(q.i8, 8), [v] * 8)

    first = ir.Constant(q.vec(ir.IntType(1), 8), [j < 4 for j in range(8)])
    low, top = pick(0, 1, 2, 3, 8, 9, 10, 11), pick(0, 1, 2, 3, 0, 1, 2, 3)
    sc = b.select(first, b.and_(low, c8(63)), b.or_(b.and_(low, c8(15)), b.shl(b.lshr(top, c8(6)), c8(4))))
    low, top = pick(4, 5, 6, 7, 8, 9, 10, 11), pick(4, 5, 6, 7, 4, 5, 6, 7)
    mn = b.select(first, b.and_(low, c8(63)), b.or_(b.lshr(low, c8(4)), b.shl(b.lshr(top, c8(6)), c8(4))))
    return sc, mn


def _k_words(name, q, o, g):
    """Group g (32 values) of the K-quant super-block at byte offset o as <32 x i16> signed codes
    (Q6_K's offset 32 taken off), and the index of its scale for each of the 32 values. Codes are
    cut from their bytes on 256-bit vectors, then widened: a 512-bit shift would take the port
    the multiplies need."""
    b = q.b

    def at(v):
        return b.add(o, ir.Constant(o.type, v))

    w16 = q.vec(ir.IntType(16), 32)
    if name == "Q6_K":
        half, part = divmod(g, 4)  # values 128 * half + 32 * part + l, a scale per 16
        codes = b.or_(q.field(q.bytes(at(64 * half + 32 * (part % 2)), 32), 4 * (part // 2), 15, 0),
                      q.field(q.bytes(at(128 + 32 * half), 32), 2 * part, 3, 4))
        codes = b.sub(b.zext(codes, w16), ir.Constant(w16, [32] * 32))
        return codes, [8 * half + 2 * part + (l >= 16) for l in range(32)]
    codes = q.field(q.bytes(at((16 if name == "Q4_K" else 48) + 32 * (g // 2)), 32), 4 * (g % 2), 15, 0)
    if name == "Q5_K":
        codes = b.or_(codes, q.field(q.bytes(at(16), 32), g, 1, 4))
    return b.zext(codes, w16), [g] * 32


WORDS_VNNI = bool(binding.get_host_cpu_features().get("avx512vnni"))  # else the int16 path runs on AVX2


def _dot_words(b, acc, a, x):
    """acc + the pairwise products of a and x (<16 x i32> each, as 32 int16), exact int32 sums.
    With AVX512-VNNI the instruction vpdpwssd itself (LLVM would otherwise split it into vpmaddwd
    and vpaddd: two uops); on AVX2, vpmaddwd and vpaddd on each 256-bit half."""
    if WORDS_VNNI:
        return b.asm(ir.FunctionType(acc.type, [acc.type] * 3), "vpdpwssd $3, $2, $0", "=v,0,v,v", [acc, a, x],
                     side_effect=False, name="dpwssd")
    i32 = ir.IntType(32)
    words, pairs = ir.VectorType(ir.IntType(16), 16), ir.VectorType(i32, 8)
    madd = cgutils.get_or_insert_function(b.module, ir.FunctionType(pairs, [words, words]), "llvm.x86.avx2.pmadd.wd")
    halves = []
    for h in (0, 8):
        pick = ir.Constant(ir.VectorType(i32, 8), list(range(h, h + 8)))
        a_h, x_h = (b.bitcast(b.shuffle_vector(v, v, pick), words) for v in (a, x))
        halves.append(b.add(b.shuffle_vector(acc, acc, pick), b.call(madd, [a_h, x_h])))
    return b.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(i32, 16), list(range(16))))


def _k_scales(name, q, o):
    """The float scales of the K-quant super-block at byte offset o, for every input row to share:
    (scales, mins), scales times d (Q6_K: 16, one per 16 values; else 8, one per 32), mins times
    -dmin (8), None for Q6_K."""
    b = q.b
    d = q.f16(b.add(o, ir.Constant(o.type, 208 if name == "Q6_K" else 0)))
    if name == "Q6_K":  # 16 signed 8-bit scales
        sc = b.sitofp(q.bytes(b.add(o, ir.Constant(o.type, 192)), 16), q.vec(q.f32, 16))
        return b.fmul(sc, q.splat(d, 16)), None
    sc, mn = _k4_scale_bytes(q, o)
    f8 = q.vec(q.f32, 8)
    dmin = b.fneg(q.f16(b.add(o, ir.Constant(o.type, 2))))
    return b.fmul(b.uitofp(sc, f8), q.splat(d, 8)), b.fmul(b.uitofp(mn, f8), q.splat(dmin, 8))


def _k_row_scales(q, scales, mins, dxv, xsv):
    """One input row's (scales, bias) from _k_scales: scales[l] of value l * 16 of the block times
    the row's activation scale (dxv: the 8 of the block), bias the vector whose lane sum is the
    block's min term (xsv: the 16 code sums); None for no min."""
    b = q.b
    every = ir.Constant(q.vec(q.i32, 16), [l // 2 for l in range(16)])
    if mins is None:
        return b.fmul(scales, b.shuffle_vector(dxv, dxv, every)), None
    scales = b.fmul(scales, dxv)
    pairs = [b.shuffle_vector(xsv, xsv, ir.Constant(q.vec(q.i32, 8), list(range(h, 16, 2)))) for h in (0, 1)]
    sums = b.sitofp(b.add(*pairs), q.vec(q.f32, 8))  # code sums per 32
    return b.shuffle_vector(scales, scales, every), b.fmul(b.fmul(mins, dxv), sums)


# block type -> (bytes per block, groups of 32 values per block)
_INT_BLOCKS = {"Q8_0": (34, 1), "Q4_0": (18, 1), "Q4_1": (20, 1), "Q5_0": (22, 1), "Q5_1": (24, 1),
               "Q4_K": (144, 8), "Q5_K": (176, 8), "Q6_K": (210, 8)}
VNNI_BLOCKS = tuple(_INT_BLOCKS)


def _make_rows_vnni(name):
    @intrinsic
    def rows_vnni(typingctx, wb, xq, xd, xs, out, j):
        """out[:, j] = block row wb (bytes) times every quantized activation row."""
        if not (isinstance(wb, types.Array) and wb.dtype == types.uint8 and wb.ndim == 1):
            return None
        if not (isinstance(xq, types.Array) and xq.dtype in (types.int8, types.int16)):
            return None
        wide = xq.dtype == types.int16
        codegen = cpu.compiled_for("int16" if wide else "vnni", _rows_vnni_codegen(name, wide))
        return types.void(wb, xq, xd, xs, out, types.intp), codegen

    return rows_vnni


def _group_words(q, codes, offset, wide):
    """A group's 32 codes as the weight operand of _dot_group: the unsigned bytes (int8 path), or
    signed words, the codes less their offset (int16 path)."""
    if not wide:
        return codes
    w16 = q.vec(ir.IntType(16), 32)
    return q.b.sub(q.b.zext(codes, w16), ir.Constant(w16, [offset] * 32))


def _dot_group(q, xq_a, xi, words, wide):
    """int32 lanes of sum(code * xq) over one group (words: _group_words): vpdpbusd (int8 x,
    unsigned codes), or vpdpwssd (int16 x, signed words)."""
    b = q.b
    lanes = 16 if wide else 8
    i32v = q.vec(q.i32, lanes)
    zero = ir.Constant(i32v, [0] * lanes)
    xt = q.vec(ir.IntType(16) if wide else q.i8, 32)
    xv = b.load(b.bitcast(b.gep(xq_a.data, [xi]), xt.as_pointer()), align=1)
    if wide:
        return _dot_words(b, zero, b.bitcast(words, i32v), b.bitcast(xv, i32v))
    dp = cgutils.get_or_insert_function(b.module, ir.FunctionType(i32v, [i32v] * 3), "llvm.x86.avx512.vpdpbusd.256")
    return b.call(dp, [zero, b.bitcast(words, i32v), b.bitcast(xv, i32v)])


def _bias(q, xs_at, offset, a, m, wide):
    """sum(xq) times the b term of a block (values a * code + b), None when it has none; the
    int16 path has the offsets in its signed codes, the int8 path needs them here."""
    b = q.b
    terms = [m] if m is not None else []
    if offset and not wide:
        terms.append(b.fmul(a, ir.Constant(q.f32, -float(offset))))
    if not terms:
        return None
    total = b.sitofp(b.add(b.load(xs_at(0)), b.load(xs_at(1))), q.f32)  # exact: |sum| < 2^21
    return b.fmul(terms[0] if len(terms) == 1 else b.fadd(*terms), total)


# input rows that share one unpacking of a weight row's blocks (codes, scales), largest first: passes
# of 8 rows where 32 vector registers hold their sums (prefill's GEMM), of 4 on AVX2's 16, then at
# most one of 2 and one of 1 for the rest
ROW_PASSES = (8, 4, 2, 1) if WORDS_VNNI else (4, 2, 1)


class _RowSums:
    """One input row's sums over a weight row, in allocas (registers once LLVM promotes them): two
    vector chains of FMAs, two scalar chains of bias terms, and the int8 path's K-quant min terms."""

    def __init__(self, q, i, lanes, kbias_lanes):
        self.q, self.i, b = q, i, q.b
        self.accs = [cgutils.alloca_once_value(b, ir.Constant(q.vec(q.f32, lanes), [0.0] * lanes)) for _ in range(2)]
        self.corrs = [cgutils.alloca_once_value(b, ir.Constant(q.f32, 0.0)) for _ in range(2)]
        self.kbias = cgutils.alloca_once_value(b, ir.Constant(q.vec(q.f32, kbias_lanes), [0.0] * kbias_lanes))

    def add(self, slot, value):
        self.q.b.store(self.q.b.fadd(self.q.b.load(slot), value), slot)

    def fma(self, chain, a, x):
        """accs[chain] += a * x."""
        b, acc = self.q.b, self.accs[chain]
        fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(a.type, [a.type] * 3),
                                            f"llvm.fma.v{a.type.count}f32")
        b.store(b.call(fn, [a, x, b.load(acc)]), acc)

    def total(self):
        b, q = self.q.b, self.q
        total = tile.lane_sum(b, b.fadd(b.load(self.accs[0]), b.load(self.accs[1])))
        corr = b.fadd(b.load(self.corrs[0]), b.load(self.corrs[1]))
        return b.fadd(total, b.fadd(corr, tile.lane_sum(b, b.load(self.kbias))))


def _rows_vnni_codegen(name, wide):
    size, groups = _INT_BLOCKS[name]
    lanes = 16 if wide else 8  # lanes [0, lanes/2) hold the first 16 values of a group
    # float lanes of a one-scale group's sums: vpdpwssd's 16 converted as they are (a fold costs two
    # instructions on 512-bit registers, one less conversion and FMA gains nothing); else folded
    group_lanes = 16 if wide and WORDS_VNNI else lanes // 2

    def codegen(context, builder, signature, args):
        w_a, xq_a, xd_a, xs_a, out_a = (context.make_array(t)(context, builder, v)
                                        for t, v in zip(signature.args[:5], args[:5]))
        q = _Ir(builder, w_a.data)
        f32v = q.vec(q.f32, lanes)
        intp = context.get_value_type(types.intp)
        n, k = cgutils.unpack_tuple(builder, xq_a.shape)
        nb = builder.udiv(cgutils.unpack_tuple(builder, w_a.shape)[0], ir.Constant(intp, size))

        def c(v):
            return ir.Constant(intp, v)

        def x_at(row, blk, g):
            """Index in xq of group g of block blk, input row row."""
            at = builder.add(builder.mul(blk, c(groups)), c(g))
            return builder.add(builder.mul(row.i, k), builder.mul(at, c(32)))

        def group(rows, blk, chain):
            """Block blk of a one-group type (one scale) for every row of the pass, on chain."""
            o = builder.mul(blk, c(size))
            q.prefetch(o, size)
            codes, offset, a, _, m = _group(name, q, o, 0)  # one scale for the 32 values
            words = _group_words(q, codes, offset, wide)
            for row in rows:
                dot = _dot_group(q, xq_a, x_at(row, blk, 0), words, wide)
                if dot.type.count > group_lanes:  # one scale: the halves of the lanes add up before the float conversion
                    dot = tile.fold(builder, dot)
                dx = builder.gep(xd_a.data, [builder.add(builder.mul(row.i, builder.udiv(k, c(32))), blk)])
                dx = builder.load(dx)
                row.fma(chain, builder.sitofp(dot, q.vec(q.f32, group_lanes)), q.splat(builder.fmul(a, dx), group_lanes))
                s = builder.add(builder.mul(row.i, builder.udiv(k, c(16))), builder.mul(blk, c(2)))
                bias = _bias(q, lambda h: builder.gep(xs_a.data, [builder.add(s, c(h))]), offset, a, m, wide)
                if bias is not None:
                    row.add(row.corrs[chain], builder.fmul(bias, dx))

        def row_inputs(row, blk):
            """Super-block blk's 8 activation scales and 16 code sums of an input row."""
            at = builder.add(builder.mul(row.i, builder.udiv(k, c(32))), builder.mul(blk, c(8)))
            dxv = builder.load(builder.bitcast(builder.gep(xd_a.data, [at]), q.vec(q.f32, 8).as_pointer()), align=4)
            xsv = builder.load(builder.bitcast(builder.gep(xs_a.data, [builder.mul(at, c(2))]),
                                               q.vec(q.i32, 16).as_pointer()), align=4)
            return dxv, xsv

        def super_block(rows, blk):
            """K-quant super-block blk, int8 path, for every row of the pass."""
            o = builder.mul(blk, c(size))
            q.prefetch(o, size)
            block_scales = _k_scales(name, q, o)
            inputs = [row_inputs(row, blk) for row in rows]
            scaled = [_k_row_scales(q, *block_scales, dxv, xsv) for dxv, xsv in inputs]  # one per 16 values
            for g in range(groups):
                codes, offset = _group(name, q, o, g)[:2]
                index = ir.Constant(q.vec(q.i32, lanes), [2 * g + (lane >= lanes // 2) for lane in range(lanes)])
                for row, (scales, _) in zip(rows, scaled):
                    dot = _dot_group(q, xq_a, x_at(row, blk, g), codes, wide)
                    row.fma(g % 2, builder.sitofp(dot, f32v), builder.shuffle_vector(scales, scales, index))
            for row, (scales, bias), (_, xsv) in zip(rows, scaled, inputs):
                if name == "Q6_K":  # the codes' offset 32, on int8 activations
                    bias = builder.fmul(builder.fmul(scales, builder.sitofp(xsv, q.vec(q.f32, 16))),
                                        q.splat(ir.Constant(q.f32, -32.0), 16))
                if bias is not None:
                    row.add(row.kbias, bias)

        def super_block_words(rows, blk):
            # int16 activations share one scale per super-block (activation_group): the sub-block
            # scales multiply the codes in int16 and the 8 groups sum in int32 (|sum| < 2^30), the
            # lanes of uniform scale folded to 8 (one AVX2 register per input row)
            o = builder.mul(blk, c(size))
            q.prefetch(o, size)
            w16, i32v = q.vec(ir.IntType(16), 32), q.vec(q.i32, 16)
            if name == "Q6_K":
                scales = builder.sext(q.bytes(builder.add(o, c(192)), 16), q.vec(ir.IntType(16), 16))
            else:
                scales, mins = _k4_scale_bytes(q, o)
                scales = builder.zext(scales, q.vec(ir.IntType(16), 8))
                mins = builder.shuffle_vector(mins, mins, ir.Constant(q.vec(q.i32, 16), [l // 2 for l in range(16)]))
                mins, dmin = builder.uitofp(mins, f32v), builder.fneg(q.f16(builder.add(o, c(2))))
            d = q.f16(builder.add(o, c(208 if name == "Q6_K" else 0)))
            chains = 2 if len(rows) == 1 else 1  # int32 sums per input row
            width = 16 if WORDS_VNNI else 8  # vpdpwssd accumulates in its 16 lanes
            sums = [[ir.Constant(q.vec(q.i32, width), [0] * width)] * chains for _ in rows]
            for g in range(groups):
                codes, index = _k_words(name, q, o, g)
                scale = builder.shuffle_vector(scales, scales, ir.Constant(q.vec(q.i32, 32), index))
                product = builder.bitcast(builder.mul(codes, scale), i32v)
                for row, row_sums in zip(rows, sums):
                    xv = builder.bitcast(builder.gep(xq_a.data, [x_at(row, blk, g)]), w16.as_pointer())
                    xv, h = builder.bitcast(builder.load(xv, align=1), i32v), g % chains
                    if WORDS_VNNI:
                        row_sums[h] = _dot_words(builder, row_sums[h], product, xv)
                    else:
                        dot = _dot_words(builder, ir.Constant(i32v, [0] * 16), product, xv)
                        row_sums[h] = builder.add(row_sums[h], tile.fold(builder, dot))
            f8 = q.vec(q.f32, 8)
            for row, row_sums in zip(rows, sums):
                dxv, xsv = row_inputs(row, blk)
                dx = builder.extract_element(dxv, ir.Constant(q.i32, 0))
                total = row_sums[0] if chains == 1 else builder.add(*row_sums)
                total = builder.sitofp(tile.fold(builder, total) if WORDS_VNNI else total, f8)
                row.fma(0, total, q.splat(builder.fmul(d, dx), 8))
                if name != "Q6_K":  # the mins times the code sums per 16 of the activations
                    bias = tile.fold(builder, builder.fmul(mins, builder.sitofp(xsv, f32v)))
                    row.fma(0, bias, q.splat(builder.fmul(dmin, dx), 8))

        def rows_pass(i0, together):
            rows = [_RowSums(q, builder.add(i0, c(r)), group_lanes if groups == 1 else 8, 16 if name == "Q6_K" else 8)
                    for r in range(together)]
            if groups == 1:  # blocks in pairs, one on each chain, whatever the pass (a row sums in one order)
                with cgutils.for_range(builder, builder.udiv(nb, c(2))) as pairs:
                    for h in (0, 1):
                        group(rows, builder.add(builder.mul(pairs.index, c(2)), c(h)), h)
                with builder.if_then(builder.icmp_unsigned("!=", builder.urem(nb, c(2)), c(0))):
                    group(rows, builder.sub(nb, c(1)), 0)
            else:
                with cgutils.for_range(builder, nb) as blocks:
                    (super_block_words if wide else super_block)(rows, blocks.index)
            st0, st1 = cgutils.unpack_tuple(builder, out_a.strides)  # out may be a column slice
            for row in rows:
                ptr = builder.gep(builder.bitcast(out_a.data, q.i8.as_pointer()),
                                  [builder.add(builder.mul(row.i, st0), builder.mul(args[5], st1))])
                builder.store(row.total(), builder.bitcast(ptr, q.f32.as_pointer()))

        done = cgutils.alloca_once_value(builder, c(0))  # input rows summed
        for together in ROW_PASSES:
            start = builder.load(done)
            passes = builder.udiv(builder.sub(n, start), c(together))
            with cgutils.for_range(builder, passes) as loop:
                rows_pass(builder.add(start, builder.mul(loop.index, c(together))), together)
            builder.store(builder.add(start, builder.mul(passes, c(together))), done)
        return context.get_dummy_value()

    return codegen


_ROWS_VNNI = {name: _make_rows_vnni(name) for name in _INT_BLOCKS}
# numba's fastmath flags every float instruction of a function, an intrinsic's IR included; with
# reassoc, LLVM reordered the int8 path's K-quant sums by the rows of a pass (the last bits of a
# row differed alone and in a batch), so the row kernels are compiled without it
FASTMATH_IN_ORDER = {"nnan", "ninf", "nsz", "contract", "afn", "arcp"}


def rows_vnni(xq, xd, xs, w, out, j0, j1):
    """out[:, j0:j1] = x @ w[j0:j1].T for w in a VNNI_BLOCKS type, x given quantized
    (quantize_activations): xq [n, k] int8 (vpdpbusd) or int16 (vpdpwssd), xd [n, k/32] float32,
    xs [n, k/16] int32, all C-contiguous; out: [n, m] float32, any layout. int8 needs
    AVX512-VNNI (the "vnni" path of cpu.py), int16 AVX512-VNNI or AVX2 (the "int16" path)."""
    raise NotImplementedError("numba only")


@overload(rows_vnni, jit_options={"fastmath": FASTMATH_IN_ORDER, "nogil": True})
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
