"""GGUF block formats kept in their blocks: dtypes, layouts, decoding to float32, and the
activations quantized per block for the integer kernels.

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
  quantize_activations(x, xq, xd, xs)   x [n, k] float32 -> the integer kernels' codes and scales
Kernels read the block bytes through as_bytes (a uint8 view, no copy).

The products over blocks are in two modules that import this one: quant_f32.py (the portable
path: blocks converted to float32 in vector registers) and quant_int.py (the integer paths:
codes times quantized activations on vpdpbusd, vpdpwssd or vpmaddwd).
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ellmd.kernels import cpu
from ellmd.kernels.formats import decode

QK = 256  # weights per K-quant super-block
# bytes ahead of the one in use that the kernels streaming weight rows ask for: the hardware
# prefetcher alone left Q4_K decode at 8 of the 19 Gw/s a core reaches with it (2,048 measured best
# of 1-8 KiB, scripts/kernel_bench.py, before Zen 5); on Zen 5 (class avx512) 4,096 (lanes tiles'
# decode from memory, 2 threads: Q6_K 40-45 against 29-30 GB/s, Q4_K 54 against 48-50)
PREFETCH = 4096 if cpu.CLASS == "avx512" else 2048

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
VNNI_BLOCKS = tuple(BLOCK_DTYPES)  # the block types quant_int.rows_vnni takes: every one


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
def f16_at(typingctx, b, o):
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
def u32_at(b, o):
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
        d = f16_at(b, o)
        for l in range(32):
            out[y + l] = d * np.float32(np.int8(b[o + 2 + l]))


@numba.njit(cache=True, nogil=True, fastmath=True)
def _row_q4_0(b, out):
    for blk in range(b.shape[0] // 18):
        o, y = blk * 18, blk * 32
        d = f16_at(b, o)
        for l in range(16):
            q = np.int32(b[o + 2 + l])
            out[y + l] = d * np.float32((q & 15) - 8)
            out[y + 16 + l] = d * np.float32((q >> 4) - 8)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _row_q4_1(b, out):
    for blk in range(b.shape[0] // 20):
        o, y = blk * 20, blk * 32
        d, m = f16_at(b, o), f16_at(b, o + 2)
        for l in range(16):
            q = np.int32(b[o + 4 + l])
            out[y + l] = d * np.float32(q & 15) + m
            out[y + 16 + l] = d * np.float32(q >> 4) + m


@numba.njit(cache=True, nogil=True, fastmath=True)
def _row_q5_0(b, out):
    for blk in range(b.shape[0] // 22):
        o, y = blk * 22, blk * 32
        d = f16_at(b, o)
        qh = u32_at(b, o + 2)
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
        d, m = f16_at(b, o), f16_at(b, o + 2)
        qh = u32_at(b, o + 4)
        for l in range(16):
            q = np.int32(b[o + 8 + l])
            lo = (q & 15) | np.int32(((qh >> np.uint32(l)) & np.uint32(1)) << np.uint32(4))
            hi = (q >> 4) | np.int32(((qh >> np.uint32(l + 16)) & np.uint32(1)) << np.uint32(4))
            out[y + l] = d * np.float32(lo) + m
            out[y + 16 + l] = d * np.float32(hi) + m


@numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
def scale_min_k4(b, s, j):
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
        d, dmin = f16_at(b, o), f16_at(b, o + 2)
        for c in range(4):
            sc1, m1 = scale_min_k4(b, o + 4, 2 * c)
            sc2, m2 = scale_min_k4(b, o + 4, 2 * c + 1)
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
        d, dmin = f16_at(b, o), f16_at(b, o + 2)
        for c in range(4):
            sc1, m1 = scale_min_k4(b, o + 4, 2 * c)
            sc2, m2 = scale_min_k4(b, o + 4, 2 * c + 1)
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
        d = f16_at(b, o + 208)
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


# ---- activations quantized per block, for the integer kernels (quant_int.py) --------------------


def activation_group(k, itemsize):
    """Values sharing one activation scale: 256 for int16 codes of a width 256 divides (a K-quant
    super-block, whose sub-block scales then apply in integers), else 32 (one block)."""
    return 256 if itemsize == 2 and k % 256 == 0 else 32


@numba.njit(cache=True, nogil=True, fastmath=True)
def quantize_activations(x, xq, xd, xs):
    """x [n, k] float32 -> xq [n, k] int8 or int16 codes, xd [n, k/32] float32 scales (one per 32
    values, x ~ xq * xd; equal over each activation_group), xs [n, k/16] float32 sums of the codes
    per 16 values (exact: |sum| < 2^20; converted here once, not by every weight row that takes
    them)."""
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
    return q.astype(dtype), d.astype(np.float32), q.reshape(n, k // 16, 16).sum(axis=2).astype(np.float32)
