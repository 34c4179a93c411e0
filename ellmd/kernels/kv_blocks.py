"""The KV cache held in blocks: q8_0 and q4_0, optionally Hadamard-rotated over head_dim.

Shape legend:
  hd       head_dim (a multiple of 32); nb = hd // 32 blocks of one key (or value) row of a head
  n        tokens written; B decode rows; H, kvh query / kv heads; g = H // kvh
  k_layer, v_layer  [slots, kvh, S, nb] blocks        head: [S, nb] blocks of one slot's kv head
  kt, vt   [KB, hdp] float32 tiles (attention.py's TILE_KEYS, hd rounded up to NR)

Layout: GGUF's Q8_0 and Q4_0 blocks byte for byte (quant.BLOCK_DTYPES): 32 values along head_dim
with one f16 scale, 34 bytes (q8_0: 0.53125x bf16) or 18 bytes (q4_0: 0.28125x). The KV tensor
keeps its shape [layers, slots, kvh, S, nb] with one block record per element, so a slot's
tokens are still contiguous per head, and copying, exporting and storing KV moves these bytes
as they are. Writing a token quantizes its rows once (store_blocks); attention converts a tile
of KB keys (then of values) to float32 in L1 and runs the float32 kernels of attention.py on it,
the same tiles in prefill and decode.

Rotation: H = the normalised Walsh-Hadamard matrix over groups of P = the largest power of two
dividing hd (64 or 128 for the supported models). H is orthogonal and its own inverse, so a key
row stored as H k gives q . k = (H q) . (H k), and values stored as H v give the output H^-1
(sum p v') = H (sum p v'). A large value of k is spread over all P coordinates, so no block's
scale is set by one outlier. Attention (prefill and decode alike: one arithmetic per token)
rotates each scaled query row once, computes scores and the values' sums on the rows as stored,
and rotates each segment's accumulator back before the segments are merged. The rotated cache has the same bytes under a dtype
whose scale field is named "dr" (ROTATED_DTYPES), so the kernels know the rotation from the type,
as every format is known inside kernels (formats.py).
"""

import numba
import numpy as np
from numba.extending import overload

from ellmd.kernels import quant
from ellmd.kernels.formats import F32, FORMAT_NAMES, f32_to_f16
from ellmd.kernels.quant import _row_q4_0, _row_q8_0, as_bytes

BLOCK = 32  # values of a block along head_dim
Q8_0, Q8_0_ROTATED, Q4_0, Q4_0_PLAIN = 3, 4, 5, 6
# --kv-dtype names: q8_0 keeps values as they are (its 8 bits need no rotation: measured in
# docs/engine.md), q4_0 is rotated by default.
KV_DTYPES = {**FORMAT_NAMES, "q8_0": Q8_0, "q8_0-rotated": Q8_0_ROTATED, "q4_0": Q4_0, "q4_0-plain": Q4_0_PLAIN}
_BLOCK_OF = {Q8_0: ("Q8_0", False), Q8_0_ROTATED: ("Q8_0", True), Q4_0: ("Q4_0", True), Q4_0_PLAIN: ("Q4_0", False)}
ROTATED_DTYPES = {
    "Q8_0": np.dtype([("dr", "<u2"), ("qs", "i1", (32,))]),
    "Q4_0": np.dtype([("dr", "<u2"), ("qs", "u1", (16,))]),
}


def format_name(fmt: int) -> str:
    """The --kv-dtype name of a KV format id."""
    return {v: k for k, v in KV_DTYPES.items()}[fmt]


def is_block_format(fmt: int) -> bool:
    return fmt in _BLOCK_OF


def rotated(fmt: int) -> bool:
    return _BLOCK_OF.get(fmt, ("", False))[1]


def storage(fmt: int, head_dim: int) -> tuple[np.dtype, int]:
    """(dtype, elements) of one key row of a head in block format fmt; a clear error when head_dim
    does not split into blocks."""
    if head_dim % BLOCK:
        raise ValueError(f"KV dtype {format_name(fmt)} needs a head_dim that is a multiple of {BLOCK}, "
                         f"this model's is {head_dim}")
    name, rotate = _BLOCK_OF[fmt]
    return (ROTATED_DTYPES if rotate else quant.BLOCK_DTYPES)[name], head_dim // BLOCK


# ---- numpy references --------------------------------------------------------------------


def hadamard_matrix(hd: int) -> np.ndarray:
    """[hd, hd] float64: block-diagonal normalised Walsh-Hadamard over groups of P (see above)."""
    p = hd & -hd
    h = np.ones((1, 1))
    while h.shape[0] < p:
        h = np.block([[h, h], [h, -h]])
    return np.kron(np.eye(hd // p), h / np.sqrt(p))


def quantize_ref(x: np.ndarray, fmt: int) -> np.ndarray:
    """float32 [..., hd] -> blocks [..., hd / 32] of fmt (gguf's quantizer, after the rotation)."""
    name, rotate = _BLOCK_OF[fmt]
    x = np.asarray(x, np.float32)
    if rotate:
        x = (x.astype(np.float64) @ hadamard_matrix(x.shape[-1]).T).astype(np.float32)
    return quant.quantize(x, name).view(storage(fmt, x.shape[-1])[0])


def dequantize_ref(blocks: np.ndarray, fmt: int) -> np.ndarray:
    """blocks [..., nb] -> float32 [..., hd]: the values attention sees (rotated back)."""
    name, rotate = _BLOCK_OF[fmt]
    x = quant.dequantize(np.ascontiguousarray(blocks).view(quant.BLOCK_DTYPES[name]))
    if rotate:
        x = (x.astype(np.float64) @ hadamard_matrix(x.shape[-1])).astype(np.float32)
    return x


def as_f32(kv: np.ndarray, fmt: int) -> tuple[np.ndarray, int]:
    """A KV array of any format as (float32 values, F32): what the attention references take."""
    return (dequantize_ref(kv, fmt), F32) if is_block_format(fmt) else (kv, fmt)


def store_blocks_ref(k_new, v_new, k_layer, v_layer, fmt, slots, positions):
    """numpy reference of store_blocks (leaves k_new and v_new as they are)."""
    for i in range(k_new.shape[0]):
        k_layer[slots[i], :, positions[i]] = quantize_ref(k_new[i], fmt)
        v_layer[slots[i], :, positions[i]] = quantize_ref(v_new[i], fmt)


# ---- numba --------------------------------------------------------------------------------


def _is_rotated(a):
    """True (a compile-time constant) when block array a holds rotated rows."""
    raise NotImplementedError("numba only")


@overload(_is_rotated)
def _is_rotated_overload(a):
    flag = "dr" in a.dtype.fields
    return lambda a: flag


@numba.njit(cache=True, nogil=True, fastmath=True)
def hadamard(x):
    """x = H x in place (x: [hd] float32): the fast Walsh-Hadamard transform, P log P adds a group."""
    hd = x.shape[0]
    p = hd & -hd
    norm = np.float32(1.0 / np.sqrt(p))
    for g0 in range(0, hd, p):
        y = x[g0 : g0 + p]
        h = 1
        while h < p:
            for i in range(0, p, 2 * h):
                for j in range(i, i + h):
                    a, b = y[j], y[j + h]
                    y[j] = a + b
                    y[j + h] = a - b
            h *= 2
        for j in range(p):
            y[j] *= norm


@numba.njit(cache=True, nogil=True)
def _round_away(v):
    """gguf's np_roundf: round half away from zero."""
    a = abs(v)
    f = np.floor(a)
    r = f + np.floor(np.float32(2.0) * (a - f))
    return -r if v < 0 else r


@numba.njit(cache=True, nogil=True)
def _put_scale(b, o, d):
    bits = f32_to_f16(d)
    b[o] = np.uint8(bits & np.uint16(0xFF))
    b[o + 1] = np.uint8(bits >> np.uint16(8))


# no fastmath: the same float32 rounding as gguf's quantizers (a reciprocal would move codes)
@numba.njit(cache=True, nogil=True)
def _quantize_q8_0(x, b):
    """Bytes b [nb * 34] = the Q8_0 blocks of x [hd]."""
    for blk in range(x.shape[0] // BLOCK):
        o, y = blk * 34, blk * BLOCK
        amax = np.float32(0.0)
        for l in range(BLOCK):
            amax = max(amax, abs(x[y + l]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        _put_scale(b, o, d)
        for l in range(BLOCK):
            b[o + 2 + l] = np.uint8(np.int32(_round_away(x[y + l] * inv)) & 0xFF)


@numba.njit(cache=True, nogil=True)
def _quantize_q4_0(x, b):
    """Bytes b [nb * 18] = the Q4_0 blocks of x [hd]: the value of largest magnitude maps to -8."""
    for blk in range(x.shape[0] // BLOCK):
        o, y = blk * 18, blk * BLOCK
        big = np.float32(0.0)
        for l in range(BLOCK):
            if abs(x[y + l]) > abs(big):
                big = x[y + l]
        d = big / np.float32(-8.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        _put_scale(b, o, d)
        for l in range(BLOCK // 2):
            lo = min(15, np.int32(x[y + l] * inv + np.float32(8.5)))
            hi = min(15, np.int32(x[y + 16 + l] * inv + np.float32(8.5)))
            b[o + 2 + l] = np.uint8(lo | (hi << 4))


def _quantize_row(x, row):
    raise NotImplementedError("numba only")


@overload(_quantize_row, jit_options={"nogil": True})
def _quantize_row_overload(x, row):
    quantize = _quantize_q8_0 if row.dtype.size == 34 else _quantize_q4_0
    return lambda x, row: quantize(x, as_bytes(row))


def _dequantize_row(row, out):
    raise NotImplementedError("numba only")


@overload(_dequantize_row, jit_options={"nogil": True, "fastmath": True})
def _dequantize_row_overload(row, out):
    decode = _row_q8_0 if row.dtype.size == 34 else _row_q4_0
    return lambda row, out: decode(as_bytes(row), out)


@numba.njit(cache=True, nogil=True)
def _store_row(src, dst):
    """dst (blocks [nb]) = src [hd] quantized, rotated first (in place) where dst's dtype says."""
    if _is_rotated(dst):
        hadamard(src)
    _quantize_row(src, dst)


@numba.njit(cache=True, nogil=True)
def store_blocks(k_new, v_new, k_layer, v_layer, slots, positions):
    """Quantize each token's keys and values into the cache at (slot, head, position).

    k_new, v_new: [n, kvh, hd] float32, rotated in place for a rotated cache (they are the
    forward pass's scratch: nothing reads them after the store, and a decode step allocates
    nothing); k_layer, v_layer: blocks."""
    for i in range(k_new.shape[0]):
        for h in range(k_new.shape[1]):
            _store_row(k_new[i, h], k_layer[slots[i], h, positions[i]])
            _store_row(v_new[i, h], v_layer[slots[i], h, positions[i]])


@numba.njit(cache=True, nogil=True, fastmath=True)
def dequantize_rows(head, k0, nk, dst):
    """dst[:nk, :hd] = positions k0..k0+nk of one head as float32, as stored (rotated or not).

    head: [S, nb] blocks; dst: [KB, >=hd] float32 (attention's key and value tiles)."""
    hd = head.shape[1] * BLOCK
    for j in range(nk):
        _dequantize_row(head[k0 + j], dst[j, :hd])


@numba.njit(cache=True, nogil=True, fastmath=True)
def rotate_rows(head, x, rows):
    """x[r, :hd] = H x[r, :hd] for r < rows when head's blocks are rotated (H is its own inverse:
    it rotates queries into the stored keys' basis and an accumulator of stored values back)."""
    if _is_rotated(head):
        hd = head.shape[1] * BLOCK
        for r in range(rows):
            hadamard(x[r, :hd])
