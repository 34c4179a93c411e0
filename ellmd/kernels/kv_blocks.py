"""The KV cache held in blocks: q8_0 and q4_0, optionally Hadamard-rotated over head_dim.

Shape legend:
  hd       head_dim (a multiple of 32); nb = hd // bv blocks of one key (or value) row of a head,
           bv = block_values(fmt, hd) values each
  n        tokens written; B decode rows; H, kvh query / kv heads; g = H // kvh
  k_layer, v_layer  [slots, kvh, S, nb] blocks        head: [S, nb] blocks of one slot's kv head
  kt, vt   [KB, hd] float32 tiles (attention.py's TILE_KEYS)

Layout: GGUF's Q8_0 and Q4_0 blocks (an f16 scale, then the codes): q4_0 is GGUF's byte for byte
(32 values, 18 bytes: 0.28125x bf16); q8_0 has 64 values a block where head_dim is a multiple of
64 (66 bytes: 0.516x bf16; SmolLM2's and Qwen3's 64 and 128), else GGUF's 32 (34 bytes: 0.531x).
The KV tensor keeps its shape [layers, slots, kvh, S, nb] with one block record per element, so
a slot's tokens are still contiguous per head, and copying, exporting and storing KV moves these
bytes as they are. Writing a token quantizes its rows once (store_blocks). Attention reads q8_0
blocks as stored (read_as_stored): scores on integer dot products of the key codes with int16
query codes, one query scale per key block (quantize_queries, quant_int.key_scores), and the
values' codes summed in registers, each key's probability times its block scale
(quant_int.value_sums); q4_0 blocks (and q8_0 on a CPU without AVX2) are converted a tile of KB
keys at a time to float32 in L1 for the float32 kernels of attention.py. Prefill and decode run
the same tiles and kernels: one arithmetic per token.

Rotation: H = the normalised Walsh-Hadamard matrix over groups of P = the largest power of two
dividing hd (64 or 128 for the supported models). H is orthogonal and its own inverse, so a key
row stored as H k gives q . k = (H q) . (H k), and values stored as H v give the output H^-1
(sum p v') = H (sum p v'). A large value of k is spread over all P coordinates, so no block's
scale is set by one outlier. Attention (prefill and decode alike: one arithmetic per token)
rotates each scaled query row once, computes scores and the values' sums on the rows as stored,
and rotates each segment's accumulator back before the segments are merged. A rotated cache's
blocks name their scale "dr" (block_dtype), so the kernels know the rotation from the type, as
every format is known inside kernels (formats.py).

Key smoothing: q4_0 keys are stored less m, a fixed mean key per (layer, kv head) calibrated at
load (engine/calibration.py), subtracted before the rotation. q . (k - m) = q . k - q . m shifts
every score of a query alike, so softmax, and attention, are unchanged and nothing else reads m;
keys less their lasting offset take 4 bits far better (docs/engine.md: +1.9% perplexity, not +7%).
"""

import numba
import numpy as np
from numba.extending import overload

from ellmd.kernels import cpu, quant, quant_int
from ellmd.kernels.formats import F32, FORMAT_NAMES, f32_to_f16
from ellmd.kernels.quant import as_bytes, f16_at

BLOCK = 32  # values of a q4_0 block, and of a q8_0 block where head_dim is no multiple of 64
Q8_0, Q8_0_ROTATED, Q4_0, Q4_0_PLAIN = 3, 4, 5, 6
# --kv-dtype names: both are rotated by default (q8_0's 64-value scale left one near tie of the
# SmolLM2 greedy prompts to another token without it: docs/engine.md), "-plain" without.
KV_DTYPES = {**FORMAT_NAMES, "q8_0": Q8_0_ROTATED, "q8_0-plain": Q8_0, "q4_0": Q4_0, "q4_0-plain": Q4_0_PLAIN}
_BLOCK_OF = {Q8_0: ("Q8_0", False), Q8_0_ROTATED: ("Q8_0", True), Q4_0: ("Q4_0", True), Q4_0_PLAIN: ("Q4_0", False)}
# Keys and values in two block formats, named "keys/values" (llama.cpp's -ctk and -ctv): keys take
# the cost of q4_0 (docs/engine.md), so "q8_0/q4_0" holds q4_0 values beside q8_0 keys. Each array
# carries its format in its block dtype, so the kernels need nothing more; a pair is one KV format
# id, named as a whole in fingerprints and budgets.
_BLOCK_NAMES = ("q8_0", "q8_0-plain", "q4_0", "q4_0-plain")
_PAIR_NAMES = [(k, v) for k in _BLOCK_NAMES for v in _BLOCK_NAMES if k != v]
_PAIRS = {16 + i: (KV_DTYPES[k], KV_DTYPES[v]) for i, (k, v) in enumerate(_PAIR_NAMES)}
KV_DTYPES.update({f"{k}/{v}": 16 + i for i, (k, v) in enumerate(_PAIR_NAMES)})


def block_dtype(name: str, values: int, rotate: bool) -> np.dtype:
    """The record of one block: an f16 scale ("dr" when the rows are rotated, so that kernels know
    it from the type) and `values` codes (q8_0: int8 each, q4_0: two to a byte)."""
    codes = ("i1", (values,)) if name == "Q8_0" else ("u1", (values // 2,))
    return np.dtype([("dr" if rotate else "d", "<u2"), ("qs", *codes)])


def block_values(fmt: int, head_dim: int) -> int:
    """Values of a block along head_dim: q8_0 takes 64 where head_dim allows (one scale for 64
    values: 0.516x bf16's bytes, where 32 give 0.531x), q4_0 32 (its 4 bits need the finer scale)."""
    return 64 if _BLOCK_OF[fmt][0] == "Q8_0" and head_dim % 64 == 0 else BLOCK


# every block record the KV can hold -> (GGUF type of its codes, values, rotated), for the kernels
_LAYOUTS = {numba.from_dtype(block_dtype(name, values, rotate)): (name, values, rotate)
            for name, values in (("Q8_0", 32), ("Q8_0", 64), ("Q4_0", 32)) for rotate in (False, True)}


def format_name(fmt: int) -> str:
    """The --kv-dtype name of a KV format id."""
    return {v: k for k, v in KV_DTYPES.items()}[fmt]


def is_block_format(fmt: int) -> bool:
    return fmt in _BLOCK_OF or fmt in _PAIRS


def key_value_formats(fmt: int) -> tuple[int, int]:
    """(format of the keys, format of the values) of KV format fmt."""
    return _PAIRS.get(fmt, (fmt, fmt))


def centred_keys(fmt: int) -> bool:
    """True when KV format fmt stores its keys less a calibrated mean key (q4_0 keys: see above)."""
    return is_block_format(fmt) and _BLOCK_OF[key_value_formats(fmt)[0]][0] == "Q4_0"


def rotated(fmt: int) -> bool:
    return _BLOCK_OF.get(fmt, ("", False))[1]


def storage(fmt: int, head_dim: int) -> tuple[np.dtype, int]:
    """(dtype, elements) of one key row of a head in block format fmt; a clear error when head_dim
    does not split into blocks."""
    if head_dim % BLOCK:
        raise ValueError(f"KV dtype {format_name(fmt)} needs a head_dim that is a multiple of {BLOCK}, "
                         f"this model's is {head_dim}")
    name, rotate = _BLOCK_OF[fmt]
    values = block_values(fmt, head_dim)
    return block_dtype(name, values, rotate), head_dim // values


# ---- numpy references --------------------------------------------------------------------


def hadamard_matrix(hd: int) -> np.ndarray:
    """[hd, hd] float64: block-diagonal normalised Walsh-Hadamard over groups of P (see above)."""
    p = hd & -hd
    h = np.ones((1, 1))
    while h.shape[0] < p:
        h = np.block([[h, h], [h, -h]])
    return np.kron(np.eye(hd // p), h / np.sqrt(p))


def _quantize_q8_ref(x: np.ndarray, values: int) -> np.ndarray:
    """float32 [..., hd] -> bytes [..., hd / values, 2 + values]: gguf's Q8_0 rule (scale
    max|x| / 127, codes rounded half away from zero) over blocks of `values`."""
    y = x.reshape(*x.shape[:-1], -1, values)
    d = np.abs(y).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    a = np.abs(y * inv)
    whole = np.floor(a)
    codes = (np.sign(y) * (whole + np.floor(np.float32(2) * (a - whole)))).astype(np.int8)  # gguf's np_roundf
    return np.concatenate([d.astype(np.float16).view(np.uint8), codes.view(np.uint8)], axis=-1)


def quantize_ref(x: np.ndarray, fmt: int) -> np.ndarray:
    """float32 [..., hd] -> blocks [..., nb] of fmt (gguf's quantizer, after the rotation)."""
    name, rotate = _BLOCK_OF[fmt]
    x = np.asarray(x, np.float32)
    dtype, _ = storage(fmt, x.shape[-1])
    if rotate:
        x = (x.astype(np.float64) @ hadamard_matrix(x.shape[-1]).T).astype(np.float32)
    if name == "Q8_0":
        return np.ascontiguousarray(_quantize_q8_ref(x, block_values(fmt, x.shape[-1]))).view(dtype)[..., 0]
    return quant.quantize(x, name).view(dtype)


def dequantize_ref(blocks: np.ndarray, fmt: int) -> np.ndarray:
    """blocks [..., nb] -> float32 [..., hd]: the values attention sees (rotated back)."""
    name, rotate = _BLOCK_OF[fmt]
    raw = np.ascontiguousarray(blocks).view(np.uint8).reshape(*blocks.shape, -1)  # [..., nb, bytes]
    if name == "Q8_0":
        d = raw[..., :2].copy().view(np.float16).astype(np.float32)  # [..., nb, 1]
        x = (d * raw[..., 2:].view(np.int8)).reshape(*blocks.shape[:-1], -1)
    else:
        x = quant.dequantize(raw.reshape(*blocks.shape[:-1], -1).view(quant.BLOCK_DTYPES[name]))
    if rotate:
        x = (x.astype(np.float64) @ hadamard_matrix(x.shape[-1])).astype(np.float32)
    return x


def as_f32(kv: np.ndarray, fmt: int) -> tuple[np.ndarray, int]:
    """A KV array of any format as (float32 values, F32): what the attention references take."""
    return (dequantize_ref(kv, fmt), F32) if is_block_format(fmt) else (kv, fmt)


def store_blocks_ref(k_new, v_new, k_layer, v_layer, fmt, slots, positions, key_mean=None):
    """numpy reference of store_blocks (leaves k_new and v_new as they are)."""
    key_fmt, value_fmt = key_value_formats(fmt)
    shift = 0 if key_mean is None or not key_mean.shape[0] else key_mean  # [kvh, hd]
    for i in range(k_new.shape[0]):
        k_layer[slots[i], :, positions[i]] = quantize_ref(k_new[i] - shift, key_fmt)
        v_layer[slots[i], :, positions[i]] = quantize_ref(v_new[i], value_fmt)


# ---- numba --------------------------------------------------------------------------------


def _is_rotated(a):
    """True (a compile-time constant) when block array a holds rotated rows."""
    raise NotImplementedError("numba only")


@overload(_is_rotated, jit_options={"fastmath": False})
def _is_rotated_overload(a):
    flag = _LAYOUTS[a.dtype][2]
    return lambda a: flag


def _row_values(a):
    """Values of a row of block array a (a compile-time constant times its blocks)."""
    raise NotImplementedError("numba only")


@overload(_row_values, jit_options={"fastmath": False})
def _row_values_overload(a):
    values = _LAYOUTS[a.dtype][1]
    return lambda a: a.shape[-1] * values


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


@numba.njit(cache=True, nogil=True, fastmath=False)
def _round_away(v):
    """gguf's np_roundf: round half away from zero."""
    a = abs(v)
    f = np.floor(a)
    r = f + np.floor(np.float32(2.0) * (a - f))
    return -r if v < 0 else r


@numba.njit(cache=True, nogil=True, fastmath=False)
def _put_scale(b, o, d):
    bits = f32_to_f16(d)
    b[o] = np.uint8(bits & np.uint16(0xFF))
    b[o + 1] = np.uint8(bits >> np.uint16(8))


# fastmath off, and said so (an unset flag is the first compiled caller's): the same float32 rounding
# as gguf's quantizers (a reciprocal would move codes)
@numba.njit(cache=True, nogil=True, fastmath=False)
def _quantize_q8_0(x, b, values):
    """Bytes b [nb * (2 + values)] = the Q8_0 blocks of `values` values of x [hd]."""
    for blk in range(x.shape[0] // values):
        o, y = blk * (2 + values), blk * values
        amax = np.float32(0.0)
        for l in range(values):
            amax = max(amax, abs(x[y + l]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        _put_scale(b, o, d)
        for l in range(values):
            b[o + 2 + l] = np.uint8(np.int32(_round_away(x[y + l] * inv)) & 0xFF)


@numba.njit(cache=True, nogil=True, fastmath=False)
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


@overload(_quantize_row, jit_options={"fastmath": False, "nogil": True})
def _quantize_row_overload(x, row):
    name, values, _ = _LAYOUTS[row.dtype]
    if name == "Q8_0":
        return lambda x, row: _quantize_q8_0(x, as_bytes(row), values)
    return lambda x, row: _quantize_q4_0(x, as_bytes(row))


@numba.njit(cache=True, nogil=True, fastmath=False)
def _store_row(src, dst):
    """dst (blocks [nb]) = src [hd] quantized, rotated first (in place) where dst's dtype says."""
    if _is_rotated(dst):
        hadamard(src)
    _quantize_row(src, dst)


@numba.njit(cache=True, nogil=True, fastmath=False)
def store_blocks(k_new, v_new, k_layer, v_layer, key_mean, slots, positions):
    """Quantize each token's keys and values into the cache at (slot, head, position).

    k_new, v_new: [n, kvh, hd] float32, centred and rotated in place for such a cache (they are
    the forward pass's scratch: nothing reads them after the store, and a decode step allocates
    nothing); k_layer, v_layer: blocks; key_mean: [kvh, hd] float32 subtracted from each key
    row first (key smoothing, above), or [0, hd]: none."""
    for i in range(k_new.shape[0]):
        for h in range(k_new.shape[1]):
            if key_mean.shape[0]:
                for d in range(k_new.shape[2]):
                    k_new[i, h, d] -= key_mean[h, d]
            _store_row(k_new[i, h], k_layer[slots[i], h, positions[i]])
            _store_row(v_new[i, h], v_layer[slots[i], h, positions[i]])


def dequantize_rows(head, k0, nk, dst):
    """dst[:nk, :hd] = positions k0..k0+nk of one head as float32, as stored (rotated or not):
    each value is its block's scale times its code, as gguf's dequantizers compute it.

    head: [S, nb] blocks; dst: [KB, >=hd] float32 (attention's key and value tiles). The block's
    size and values are constants of the compiled loop, which LLVM vectorizes (widening the codes
    and converting them 16 at a time): a value costs less than reading it from memory."""
    raise NotImplementedError("numba only")


@overload(dequantize_rows, jit_options={"nogil": True, "fastmath": True})
def _dequantize_rows_overload(head, k0, nk, dst):
    name, values, _ = _LAYOUTS[head.dtype]
    size = 2 + values if name == "Q8_0" else 18  # bytes of a block
    codes_at = 2  # the codes follow the f16 scale
    half = values // 2

    def impl_q8_0(head, k0, nk, dst):
        raw = as_bytes(head)  # [S, nb * size]
        codes = raw.view(np.int8)
        for j in range(nk):
            src, signed, row = raw[k0 + j], codes[k0 + j], dst[j]
            for blk in range(head.shape[1]):
                d = f16_at(src, blk * size)
                c = signed[blk * size + codes_at : blk * size + codes_at + values]
                out = row[blk * values : blk * values + values]
                for i in range(values):
                    out[i] = d * np.float32(c[i])

    def impl_q4_0(head, k0, nk, dst):
        raw = as_bytes(head)
        for j in range(nk):
            src, row = raw[k0 + j], dst[j]
            for blk in range(head.shape[1]):
                d = f16_at(src, blk * size)
                c = src[blk * size + codes_at : blk * size + codes_at + half]
                out = row[blk * values : blk * values + values]
                for i in range(half):  # low nibbles: the block's first half, high: its second
                    q = np.int32(c[i])
                    out[i] = d * np.float32((q & 15) - 8)
                    out[half + i] = d * np.float32((q >> 4) - 8)

    return impl_q8_0 if name == "Q8_0" else impl_q4_0


@numba.njit(cache=True, nogil=True, fastmath=True)
def rotate_rows(head, x, rows):
    """x[r, :hd] = H x[r, :hd] for r < rows when head's blocks are rotated (H is its own inverse:
    it rotates queries into the stored keys' basis and an accumulator of stored values back)."""
    if _is_rotated(head):
        hd = _row_values(head)
        for r in range(rows):
            hadamard(x[r, :hd])


# q8_0 blocks read as stored where the CPU has the "int16" path's instructions (vpdpwssd, or AVX2's
# vpmaddwd: every x86 class of DESIGN.md): keys' scores on integer dot products (quant_int.key_scores),
# values' codes converted in registers into the sums (quant_int.value_sums). Elsewhere, and for
# q4_0 blocks, attention converts a tile to float32 (dequantize_rows) for the float kernels.
INTEGER_KEYS = "int16" in cpu.host_paths()
QUERY_TOP = np.float32(32767.0)  # int16 query codes: a rounding of 2**-16 of a block's largest value


def read_as_stored(head_type):
    """True when arrays of this numba type hold q8_0 blocks that attention reads as stored (keys
    scored in integers, values summed from their codes), False for tiles converted to float32."""
    return INTEGER_KEYS and _LAYOUTS.get(getattr(head_type, "dtype", None), ("",))[0] == "Q8_0"




@numba.njit(cache=True, nogil=True, fastmath=False)
def _quantize_query_rows(qs, rows, values, qc, qd):
    for r in range(rows):
        for blk in range(qs.shape[1] // values):
            x = qs[r, blk * values : blk * values + values]
            amax = np.float32(0.0)
            for l in range(values):
                amax = max(amax, abs(x[l]))
            d = amax / QUERY_TOP
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            for l in range(values):
                qc[r, blk * values + l] = np.int16(np.rint(x[l] * inv))
            qd[r, blk] = d


def quantize_queries(head, qs, rows, qc, qd):
    """For q8_0 keys scored in integers (read_as_stored, quant_int.key_scores): each query row qs[r] (scaled, rotated as the
    keys are) to int16 codes qc[r] [hd] with one scale qd[r, blk] = max |x| / 32767 per key block,
    for quant_int.key_scores; nothing for other keys. qs: [>= rows, hd] float32; qc: [>= rows, hd]
    int16; qd: [>= rows, >= hd / 32] float32."""
    raise NotImplementedError("numba only")


@overload(quantize_queries, jit_options={"fastmath": False, "nogil": True})
def _quantize_queries_overload(head, qs, rows, qc, qd):
    if not read_as_stored(head):
        return lambda head, qs, rows, qc, qd: None
    values = _LAYOUTS[head.dtype][1]
    return lambda head, qs, rows, qc, qd: _quantize_query_rows(qs, rows, values, qc, qd)


def quantize_queries_ref(qs: np.ndarray, values: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy reference of quantize_queries: float32 [rows, hd] -> (int16 codes, [rows, hd / values] scales)."""
    blocks = qs.reshape(qs.shape[0], -1, values)
    d = np.abs(blocks).max(axis=2) / QUERY_TOP  # [rows, nb]
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    return np.rint(blocks * inv[..., None]).astype(np.int16).reshape(qs.shape), d.astype(np.float32)


def key_scores_ref(qc: np.ndarray, qd: np.ndarray, head: np.ndarray) -> np.ndarray:
    """numpy reference of quant_int.key_scores over every key of head: [rows, S] float32, each score
    the blocks' exact integer sums times their two scales, added in block order as the kernel does
    (float32 fma, here float64 then rounded: the same value)."""
    name, values, _ = _LAYOUTS[numba.from_dtype(head.dtype)]
    raw = np.ascontiguousarray(head).view(np.uint8).reshape(*head.shape, 2 + values)  # [S, nb, bytes]
    dk = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [S, nb]
    codes = raw[..., 2:].view(np.int8).astype(np.int64)  # [S, nb, values]
    sums = np.einsum("rbv,sbv->rsb", qc.reshape(qc.shape[0], -1, values).astype(np.int64), codes)  # [rows, S, nb]
    out = np.zeros(sums.shape[:2], np.float32)
    for blk in range(sums.shape[2]):
        scale = (dk[None, :, blk] * qd[:, None, blk]).astype(np.float32)
        out = (sums[..., blk].astype(np.float32).astype(np.float64) * scale + out).astype(np.float32)
    return out


def value_sums_ref(p: np.ndarray, values: np.ndarray) -> np.ndarray:
    """numpy reference of quant_int.value_sums from zero: p [rows, nk] float32 times the blocks'
    values [nk, hd] (the probabilities times each key's block scale, then times the codes)."""
    name, bv, _ = _LAYOUTS[numba.from_dtype(values.dtype)]
    raw = np.ascontiguousarray(values).view(np.uint8).reshape(*values.shape, 2 + bv)  # [nk, nb, bytes]
    dv = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [nk, nb]
    codes = raw[..., 2:].view(np.int8).astype(np.float64)  # [nk, nb, bv]
    weights = (p[:, :, None] * dv[None]).astype(np.float32).astype(np.float64)  # [rows, nk, nb]
    return np.einsum("rjb,jbv->rbv", weights, codes).reshape(p.shape[0], -1).astype(np.float32)
