"""GGUF blocks (Q8_0, Q5_0, Q4_0, Q4_1, Q4_K, Q6_K) with their outputs in lanes: an int16 GEMM/GEMV on
vpdpwssd (vpmaddwd on AVX2).

Shape legend:
  n   input rows (tokens)
  k   depth, a multiple of 32 (Q8_0, Q5_0, Q4_0, Q4_1) or 256 (Q4_K, Q6_K); nb = k / 32 or k / 256 blocks
  m   output features (weight rows); T = ceil(m / 16) tiles of 16 weight rows

rows_vnni (quant_int.py) sums a weight row's block in the lanes of one vector, then pays a lane
fold, a conversion and an FMA per (input row, weight row, block): the float steps cost as much as
the products. Here the 16 weight rows of a tile sit in the 16 int32 lanes of a vector: 32 values
cost 16 vpdpwssd (one per pair of depths, the input's pair of int16 codes broadcast), and a block
one conversion and one FMA for 16 outputs; no horizontal sum remains.

Tile layouts (repack; the GGUF's values rearranged, the same bytes but for Q4_K's scales; rows past
m are zero), a tile's block for tile t and block b:
  Q8_0 (544 = 16 x 34): the 16 rows' f16 scales (32 bytes), then for each pair p of depths (16
       pairs) 32 bytes, row r's codes at depths 32b + 2p and 32b + 2p + 1 at bytes 2r and 2r + 1.
  Q5_0 (352 = 16 x 22): the f16 scales, then the codes' low 4 bits in 8 runs of 32 bytes: run c
       holds pair c in its low nibbles and pair c + 8 in its high ones (byte 2r + h: depth 2c + h of
       row r, and 16 + 2c + h), then their fifth bits in 2 runs of 32 bytes (run j, bit 2e + u: the
       nibble run 4j + e, its half u).
  Q4_0 (288 = 16 x 18), Q4_1 (320 = 16 x 20): the f16 d (Q4_1: and the f16 m), then Q5_0's nibble runs.
  Q4_K (2,368 for the GGUF's 16 x 144): the rows' f16 d and dmin (64 bytes), their 8 six-bit
       scales and 8 mins as bytes ([sub-block][row], 256), then each sub-block of 32 values as Q5_0's
       nibble runs (8 x 256 bytes).
  Q6_K (3,360 = 16 x 210): the f16 d, the 16 int8 scales ([sub-block][row], 256 bytes), the codes'
       low 4 bits as Q4_K's, then their high 2 bits per 32 values in 2 runs of 64 bytes, run J's
       half h2 at bits 4e + 2u: the nibble run 4e + 2J + h2, its half u (_k6_high; two adjacent
       nibble runs then find their high bits at one shift in 64 adjacent bytes).
Cutting codes from nibbles and bit runs costs a few byte-wise instructions a vector of 16 rows,
shared by the input rows of a register block; a K-quant's sub-block scales multiply each
sub-block's int32 sums (vpmulld, once a sub-block per input row and tile), in prefill as in decode
(scaling the codes in int16 instead, a vpmullw a pair of depths and tile, ran Q4_K prefill at
0.92-0.97x on a Zen 5: 585-640 against 640-690 GFLOP/s on 2 threads; Q6_K alike).

One arithmetic: every output is, block by block in increasing order from acc = 0,
  acc = fma(float(isum), d[j, b] * xd[i, b], acc)
with isum the exact int32 sum of the block's code products (K-quants: times their sub-block scales;
one activation scale per 256 values, quant.activation_group), then for Q4_1
  acc = fma(m[j, b], xs32[i, b] * xd[i, b], acc),  xs32 the activations' code sum of the block,
and for Q4_K
  acc = fma(bias, -dmin[j, b] * xd[i, b], acc),  bias = its 8 mins times the activations' code
sums per 32, a float chain in order: an output's bits depend neither on n nor on the rows or tiles
that share its register block, so decode (n = 1) and prefill give a token the same numbers.

Measured (scripts/lanes_bench.py; one thread, CPU time, GFLOP/s at 512 rows, GB/s of the GGUF's
bytes at 1 row with the weights in cache), against rows_vnni on the same blocks:
  Xeon with AVX512-VNNI, no AMX, shared (directional), Q8_0: 120-220 against 35-78 (2.3-3.5x);
  decode 27-32 GB/s against 9-14, 13-16 GB/s from memory against 8-9.
  Xeon with AMX (family 6 model 167 as reported), quiet: Q8_0 184-250 against 57-74; Q5_0 136-172
  against 48-81, decode 19-24 against 8-11 GB/s; Q4_0 157-194 against 53-83, decode 20-26 against
  8-11; Q4_1 165-210 against 37-75, decode 23-32 against 6-10; Q4_K 166-210 against 98-125, decode
  22-25 against 10-12; Q6_K 135-171 against 93-141, decode 16-18 against 15-18.
  AMD EPYC Zen 1 (AVX2; vpmaddwd issues a 256-bit op every other cycle, 39 GOP/s of int16
  products a core at 2.45 GHz, the same as its f32 FMA), quiet: Q4_K 25, Q8_0 26-29, Q5_0 23-24,
  Q6_K 21 (two-thirds of that limit, the rest cutting codes and vpmullw on the same port); decode
  Q4_K 4.5-5.3, Q6_K 4.5-4.7, Q4_0 5.5 GB/s (weights in cache 6.2).
The register block: 4 x 3, 3 x 4, 5 x 2 and 6 x 2 within the noise (Q8_0, Q4_K); 4 x 3 kept (AVX2:
5 x 1, at RB). The
K-quants loop over their 8 sub-blocks in prefill (an eighth of the code to compile), unrolled in
decode. The model families repack matrices at load where `wanted` says (model/llama.py), and
matmul's linear, linear_prefill and path_rows run the tiles.

On the opt-in "int8" path (cpu.py; AVX2) the tiles of 4- to 6-bit codes (INT8_BLOCKS) take int8
activation codes instead, one scale per 32 values, in prefill and decode alike (_int8_emit: one
vpmaddubsw a pair of depths where int16 takes two vpmaddwd). Zen 1, one thread, as above: prefill
Q4_K 39-40 against 25 GFLOP/s, Q4_1 40 against 27, Q4_0 40 against 27, Q5_0 34 against 24, Q6_K 27-28
against 23; decode (weights in cache) Q4_K 9.1 against 6.6 GB/s, Q4_1 10.0 against 7.1, Q4_0 9.5
against 5.4, Q5_0 8.0 against 5.2, Q6_K 7.5 against 6.6.
"""
import contextlib
import functools

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ellmd.kernels import cpu, quant
from ellmd.kernels.quant_int import FASTMATH_IN_ORDER, WORDS_VNNI, _dot_words, _Ir, broadcasts_pairs

LANES = 16  # weight rows of a tile: vpdpwssd's int32 lanes
TILE_BLOCK = 2 * LANES + 16 * 2 * LANES  # bytes of a Q8_0 tile's block: 16 scales, 16 pairs of 16 x 2 codes
# a Q4_K tile's super-block (256 values): the 16 rows' d and dmin (f16), their 8 scales and 8 mins
# (bytes, [sub-block][row]), then per sub-block 8 runs of 32 code bytes (layout above)
K4_D, K4_DMIN, K4_SCALES, K4_MINS, K4_CODES = 0, 2 * LANES, 4 * LANES, 12 * LANES, 20 * LANES
K4_BLOCK = K4_CODES + 8 * 8 * 2 * LANES  # 2,368 bytes for the GGUF's 16 x 144
# a Q6_K tile's super-block: the 16 rows' d (f16) and 16 scales (int8, [sub-block][row]), the codes'
# low 4 bits as Q4_K's, then their high 2 bits per 32 values in 2 runs of 64 bytes (layout above)
K6_D, K6_SCALES, K6_LOW = 0, 2 * LANES, 18 * LANES
K6_HIGH = K6_LOW + 8 * 8 * 2 * LANES
K6_BLOCK = K6_HIGH + 8 * 4 * 2 * LANES  # 3,360 bytes: the GGUF's 16 x 210
# a Q5_0 tile's block: the 16 rows' d (f16), the codes' low 4 bits as Q4_K's sub-blocks, then their
# fifth bits in 2 runs of 32 bytes (layout above)
Q5_LOW = 2 * LANES
Q5_HIGH = Q5_LOW + 8 * 2 * LANES
Q5_BLOCK = Q5_HIGH + 2 * 2 * LANES  # 352 bytes: the GGUF's 16 x 22
# block type -> (values, bytes) of a tile's block; tiles are arrays [T, blocks] of a record type
# named after the block type (TILE_DTYPES), so that numba compiles a kernel for each type it meets
# Q4_0 and Q4_1 tiles' blocks: the f16 d (and Q4_1's f16 m), then the codes as Q5_0's nibble runs
Q4_0_BLOCK, Q4_1_BLOCK = 2 * LANES + 8 * 2 * LANES, 4 * LANES + 8 * 2 * LANES  # 288 = 16 x 18, 320 = 16 x 20
TILE_BLOCKS = {"Q8_0": (32, TILE_BLOCK), "Q5_0": (32, Q5_BLOCK), "Q4_0": (32, Q4_0_BLOCK), "Q4_1": (32, Q4_1_BLOCK),
               "Q4_K": (256, K4_BLOCK), "Q6_K": (256, K6_BLOCK)}
ONE_SCALE = ("Q8_0", "Q5_0", "Q4_0", "Q4_1")  # a scale per 32 values (Q4_1: and a min), in float steps
TILE_DTYPES = {name: np.dtype([(name, np.uint8, (size,))]) for name, (_, size) in TILE_BLOCKS.items()}
# input rows x tiles of a register block: RB * SB int32 sums and as many float accumulators, SB
# widened weight vectors and RB broadcast pairs (AVX-512: 4 x 3 -> 24 + 3 + 4 of 32 registers).
# AVX2 keeps each 16-lane vector in two registers of its 16: 5 x 1 -> 10 sums + 2 + 1, the float
# accumulators (touched once a block) spilled; cutting a tile's codes costs as much as several
# rows' vpmaddwd there, so more rows share it (Zen 1, one thread, 512 rows: Q5_0 16-17 -> 23-24
# GFLOP/s, Q4_K 21 -> 23.5, Q6_K 18 -> 21, Q8_0 17-28 -> 26-29 against 2 x 1)
RB, SB = (4, 3) if WORDS_VNNI else (5, 1)
# decode (one input row) streams its tiles one at a time, a single sequential stream of weights
# (Zen 5, 2 threads, from memory: Q4_K at 6144 x 2048 48-50 GB/s against 31 with three tiles
# interleaved; Qwen3-1.7B Q4_K_M 30.8 tok/s against 25.0)
DECODE_SB = 1


def is_tiles(w) -> bool:
    """True for weights repacked to tiles (repack)."""
    return isinstance(w, np.ndarray) and w.dtype.names is not None and w.dtype.names[0] in TILE_DTYPES \
        and w.dtype == TILE_DTYPES[w.dtype.names[0]]


def block_name(w) -> str:
    """The GGUF block type tiles hold."""
    return w.dtype.names[0]


def columns(w) -> int:
    """The depth k of tiles."""
    return TILE_BLOCKS[block_name(w)][0] * w.shape[1]


def _raw(tiles):
    """Tiles as their bytes, uint8 [T, blocks, bytes of a block]."""
    return np.ascontiguousarray(tiles).view(np.uint8).reshape(*tiles.shape, TILE_BLOCKS[block_name(tiles)][1])


def rows(w) -> int:
    """Weight rows of a matrix, tiles or not (tiles: 16 a tile, the last one's padding included)."""
    return LANES * w.shape[0] if is_tiles(w) else w.shape[0]


def tiles_name(t) -> str | None:
    """The block type of the numba type of tiles, None for another type (typing time)."""
    if not (isinstance(t, types.Array) and isinstance(t.dtype, types.Record) and len(t.dtype.fields) == 1):
        return None
    name = next(iter(t.dtype.fields))
    return name if name in TILE_DTYPES and t.dtype.size == TILE_DTYPES[name].itemsize else None


def tiles_type(t) -> bool:
    """True for the numba type of tiles (typing time)."""
    return tiles_name(t) is not None


def part_rows(w):
    """rows, inside numba code."""
    raise NotImplementedError("numba only")


@overload(part_rows, jit_options={"fastmath": False, "nogil": True})
def _part_rows_overload(w):
    if tiles_type(w):
        return lambda w: LANES * w.shape[0]
    return lambda w: w.shape[0]


def wanted(w) -> bool:
    """True when weight matrix w is best repacked to tiles at load: a block type of TILE_BLOCKS with
    rows a multiple of 16 (a fused weight's parts then start on tiles), on the int16 path alone (the
    int8 "vnni" path quantizes activations to int8). With AMX on too, the tiles beat or match its block
    prefill and keep decode's sums (Qwen3-1.7B shapes, pp512: Q8_0 145 tok/s against 107 on AMX,
    Q4_K_M 123 against 109; SmolLM2 Q4_K_M 1,071 against 1,134; Xeon with AMX)."""
    int16_only = cpu.INTEGER & cpu.ENABLED == {"int16"}
    return int16_only and quant.block_name(w) in REPACK and w.ndim == 2 and w.shape[0] % LANES == 0


def repack(w):
    """GGUF block records [m, blocks] -> their tiles [ceil(m / 16), blocks] (the layouts above)."""
    name = quant.block_name(w)
    return REPACK[name](w).view(TILE_DTYPES[name]).reshape(-(-w.shape[0] // LANES), w.shape[1])


def _by_tile(a, m):
    """[m, blocks, ...] -> [T, blocks, 16, ...]: rows padded with zeros to tiles of 16."""
    tiles = -(-m // LANES)
    padded = np.zeros((tiles * LANES, *a.shape[1:]), a.dtype)
    padded[:m] = a
    return np.ascontiguousarray(padded.reshape(tiles, LANES, *a.shape[1:]).swapaxes(1, 2))


def _repack_q8_0(w):
    """Q8_0 block records [m, nb] -> tiles uint8 [ceil(m / 16), nb, 544] (the layout above)."""
    m, nb = w.shape
    tiles = -(-m // LANES)
    raw = np.zeros((tiles * LANES, nb, 34), np.uint8)
    raw[:m] = np.ascontiguousarray(w).view(np.uint8).reshape(m, nb, 34)
    raw = raw.reshape(tiles, LANES, nb, 34)
    out = np.empty((tiles, nb, TILE_BLOCK), np.uint8)
    out[:, :, : 2 * LANES] = raw[..., :2].transpose(0, 2, 1, 3).reshape(tiles, nb, 2 * LANES)
    codes = raw[..., 2:].reshape(tiles, LANES, nb, 16, 2)  # [tile, row, block, pair, 2]
    out[:, :, 2 * LANES :] = codes.transpose(0, 2, 3, 1, 4).reshape(tiles, nb, 16 * 2 * LANES)
    return out


def k4_scales_ref(w):
    """The 6-bit scales and mins of Q4_K records [m, blocks], each uint8 [m, blocks, 8]."""
    raw = w["scales"]
    sc = np.concatenate([raw[..., 0:4] & 63, (raw[..., 8:12] & 15) | ((raw[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([raw[..., 4:8] & 63, (raw[..., 8:12] >> 4) | ((raw[..., 4:8] >> 6) << 4)], -1)
    return sc, mn


def k4_codes_ref(w):
    """The 4-bit codes of Q4_K records [m, blocks], uint8 [m, blocks, 256] in the values' order."""
    qs = w["qs"].reshape(*w.shape, 4, 1, 32)  # a byte: value 64 j + l (low nibble), 64 j + 32 + l (high)
    return np.concatenate([qs & 15, qs >> 4], -2).reshape(*w.shape, 256)


def _repack_q4_k(w):
    """Q4_K block records [m, nb] -> tiles uint8 [ceil(m / 16), nb, 2,368] (the layout above)."""
    m, nb = w.shape
    sc, mn = k4_scales_ref(w)
    out = np.empty((-(-m // LANES), nb, K4_BLOCK), np.uint8)
    tiles = out.shape[0]
    for at, field in ((K4_D, "d"), (K4_DMIN, "dmin")):
        out[..., at : at + 2 * LANES] = _by_tile(w[field], m).view(np.uint8).reshape(tiles, nb, 2 * LANES)
    for at, values in ((K4_SCALES, sc), (K4_MINS, mn)):  # [T, nb, 16, 8] -> [T, nb, 8, 16]
        out[..., at : at + 8 * LANES] = _by_tile(values, m).swapaxes(2, 3).reshape(tiles, nb, 8 * LANES)
    out[..., K4_CODES:] = _nibble_runs(_by_tile(k4_codes_ref(w), m), tiles, nb)
    return out


def k6_codes_ref(w):
    """The 6-bit codes (value + 32) of Q6_K records [m, blocks], uint8 [m, blocks, 256] in the values' order."""
    ql = w["ql"].reshape(*w.shape, 2, 1, 64)  # per 128 values: 64 bytes of low bits, 32 of high bits
    qh = w["qh"].reshape(*w.shape, 2, 1, 32)
    low = np.concatenate([ql & 15, ql >> 4], -2).reshape(*w.shape, 2, 4, 32)  # values 32 j + l of a half
    high = np.stack([(qh[..., 0, :] >> (2 * j)) & 3 for j in range(4)], -2)
    return (low | (high << 4)).reshape(*w.shape, 256)


def _nibble_runs(codes, tiles, nb, groups=8):
    """Codes [T, nb, 16, 32 groups] (low 4 bits) -> [T, nb, groups * 256]: value 32 g + 16 u + 2 c + h
    of row r in byte (g, c, 2 r + h), its low nibble for u = 0."""
    codes = (codes & 15).reshape(tiles, nb, LANES, groups, 2, 8, 2)  # [T, nb, r, g, u, c, h]
    pairs = codes[..., 0, :, :] | (codes[..., 1, :, :] << 4)  # [T, nb, r, g, c, h]
    return pairs.transpose(0, 1, 3, 4, 2, 5).reshape(tiles, nb, groups * 8 * 2 * LANES)


def _repack_q6_k(w):
    """Q6_K block records [m, nb] -> tiles uint8 [ceil(m / 16), nb, 3,360] (the layout above)."""
    m, nb = w.shape
    out = np.empty((-(-m // LANES), nb, K6_BLOCK), np.uint8)
    tiles = out.shape[0]
    out[..., K6_D:K6_SCALES] = _by_tile(w["d"], m).view(np.uint8).reshape(tiles, nb, 2 * LANES)
    out[..., K6_SCALES:K6_LOW] = _by_tile(w["scales"], m).swapaxes(2, 3).view(np.uint8).reshape(tiles, nb, 16 * LANES)
    codes = _by_tile(k6_codes_ref(w), m)  # [T, nb, r, 256]
    out[..., K6_LOW:K6_HIGH] = _nibble_runs(codes, tiles, nb)
    # the high 2 bits of nibble run c = 4 e + 2 J + h2, half u, in run J's half h2, byte 2 r + h, bit 4 e + 2 u
    high = (codes >> 4).reshape(tiles, nb, LANES, 8, 2, 2, 2, 2, 2)  # [T, nb, r, g, u, e, J, h2, h]
    bits = sum(high[:, :, :, :, u, e] << (4 * e + 2 * u) for u in (0, 1) for e in (0, 1))  # [T, nb, r, g, J, h2, h]
    out[..., K6_HIGH:] = bits.astype(np.uint8).transpose(0, 1, 3, 4, 5, 2, 6).reshape(tiles, nb, 8 * 4 * 2 * LANES)
    return out


def _k6_high(run):
    """Where a Q6_K group's nibble run `run` (0-7) finds its high 2 bits: (the byte offset of its 32
    bytes in the group's 128, the bit of its half u = 0; u = 1's is 2 higher). Runs 2P and 2P + 1 sit
    in one run of 64 bytes at the same bit."""
    return 64 * (run // 2 % 2) + 32 * (run % 2), 4 * (run // 4)


def q5_codes_ref(w):
    """The 5-bit codes (value + 16) of Q5_0 records [m, blocks], uint8 [m, blocks, 32] in the values' order."""
    qs = w["qs"][..., None, :]  # byte j: values j (low nibble) and j + 16 (high)
    fifth = np.unpackbits(w["qh"], axis=-1, bitorder="little")  # bit l of the little-endian u32: value l's
    return np.concatenate([qs & 15, qs >> 4], -2).reshape(*w.shape, 32) | (fifth << 4)


def _repack_q5_0(w):
    """Q5_0 block records [m, nb] -> tiles uint8 [ceil(m / 16), nb, 352] (the layout above)."""
    m, nb = w.shape
    out = np.empty((-(-m // LANES), nb, Q5_BLOCK), np.uint8)
    tiles = out.shape[0]
    out[..., :Q5_LOW] = _by_tile(w["d"], m).view(np.uint8).reshape(tiles, nb, 2 * LANES)
    codes = _by_tile(q5_codes_ref(w), m)  # [T, nb, r, 32]
    out[..., Q5_LOW:Q5_HIGH] = _nibble_runs(codes, tiles, nb, 1)
    # the fifth bit of nibble run c = 4 j + e, half u, in run j of byte 2 r + h at bit 2 e + u
    fifth = (codes >> 4).reshape(tiles, nb, LANES, 2, 2, 4, 2)  # [T, nb, r, u, j, e, h]
    bits = sum(fifth[:, :, :, u, :, e, :] << (2 * e + u) for u in (0, 1) for e in range(4))  # [T, nb, r, j, h]
    out[..., Q5_HIGH:] = bits.astype(np.uint8).transpose(0, 1, 3, 2, 4).reshape(tiles, nb, 2 * 2 * LANES)
    return out


def q4_codes_ref(w):
    """The 4-bit codes of Q4_0 or Q4_1 records [m, blocks], uint8 [m, blocks, 32] in the values' order."""
    qs = w["qs"][..., None, :]  # byte j: values j (low nibble) and j + 16 (high)
    return np.concatenate([qs & 15, qs >> 4], -2).reshape(*w.shape, 32)


def _repack_q4(w):
    """Q4_0 or Q4_1 block records [m, nb] -> tiles uint8 [ceil(m / 16), nb, 288 or 320]: d (and m), nibble runs."""
    m, nb = w.shape
    fields = ("d", "m") if "m" in w.dtype.names else ("d",)
    tiles = -(-m // LANES)
    parts = [_by_tile(w[f], m).view(np.uint8).reshape(tiles, nb, 2 * LANES) for f in fields]
    return np.concatenate([*parts, _nibble_runs(_by_tile(q4_codes_ref(w), m), tiles, nb, 1)], -1)


REPACK = {"Q8_0": _repack_q8_0, "Q5_0": _repack_q5_0, "Q4_0": _repack_q4, "Q4_1": _repack_q4, "Q4_K": _repack_q4_k,
          "Q6_K": _repack_q6_k}


def k6_tile_fields_ref(tiles):
    """(d [T * 16, nb] float32, scales [T * 16, nb, 16] int8, codes [T * 16, nb, 256]) of Q6_K tiles."""
    t, nb = tiles.shape
    tiles = _raw(tiles)

    def rows(a):  # [T, nb, 16, ...] -> [T * 16, nb, ...]
        return a.swapaxes(1, 2).reshape(t * LANES, nb, *a.shape[3:])

    d = rows(tiles[..., K6_D:K6_SCALES].copy().view(np.float16)).astype(np.float32)
    sc = rows(tiles[..., K6_SCALES:K6_LOW].view(np.int8).reshape(t, nb, 16, LANES).swapaxes(2, 3))
    low = _nibbles_ref(tiles[..., K6_LOW:K6_HIGH], t, nb)
    bits = tiles[..., K6_HIGH:].reshape(t, nb, 8, 2, 2, LANES, 2)  # [T, nb, g, J, h2, r, h]
    high = np.stack([np.stack([(bits >> (4 * e + 2 * u)) & 3 for e in (0, 1)], 3) for u in (0, 1)], 3)
    high = high.reshape(t, nb, 8, 2, 8, LANES, 2)  # [T, nb, g, u, c = 4 e + 2 J + h2, r, h]
    high = rows(high.transpose(0, 1, 5, 2, 3, 4, 6)).reshape(t * LANES, nb, 256)
    return d, sc, low | (high << 4)


def _nibbles_ref(runs, t, nb):
    """The inverse of _nibble_runs: [T, nb, groups * 256] -> codes [T * 16, nb, groups * 32] (4 bits)."""
    pairs = runs.reshape(t, nb, -1, 8, LANES, 2)  # [T, nb, g, c, r, h]
    codes = np.stack([pairs & 15, pairs >> 4], 3)  # [T, nb, g, u, c, r, h]
    return codes.transpose(0, 5, 1, 2, 3, 4, 6).reshape(t * LANES, nb, -1)


def q4_tile_fields_ref(tiles):
    """(d, m [T * 16, nb] float32 (m None for Q4_0), codes [T * 16, nb, 32]) of Q4_0 or Q4_1 tiles."""
    t, nb = tiles.shape
    one = block_name(tiles) == "Q4_1"
    tiles = _raw(tiles)

    def scales(at):
        return tiles[..., at : at + 2 * LANES].copy().view(np.float16).swapaxes(1, 2).reshape(t * LANES, nb).astype(np.float32)

    runs = 4 * LANES if one else 2 * LANES
    return scales(0), scales(2 * LANES) if one else None, _nibbles_ref(tiles[..., runs:], t, nb)


def q5_tile_fields_ref(tiles):
    """(d [T * 16, nb] float32, codes [T * 16, nb, 32]) of Q5_0 tiles."""
    t, nb = tiles.shape
    tiles = _raw(tiles)
    d = tiles[..., :Q5_LOW].copy().view(np.float16).swapaxes(1, 2).reshape(t * LANES, nb).astype(np.float32)
    bits = tiles[..., Q5_HIGH:].reshape(t, nb, 2, LANES, 2)  # [T, nb, j, r, h]
    fifth = np.stack([np.stack([(bits >> (2 * e + u)) & 1 for e in range(4)], 3) for u in (0, 1)], 2)  # [T, nb, u, j, e, r, h]
    fifth = fifth.transpose(0, 5, 1, 2, 3, 4, 6).reshape(t * LANES, nb, 32)
    return d, _nibbles_ref(tiles[..., Q5_LOW:Q5_HIGH], t, nb) | (fifth << 4)


def k4_tile_fields_ref(tiles):
    """(d, dmin [T * 16, nb] float32, scales, mins [T * 16, nb, 8], codes [T * 16, nb, 256]) of Q4_K tiles."""
    t, nb = tiles.shape
    tiles = _raw(tiles)

    def rows(a):  # [T, nb, 16, ...] -> [T * 16, nb, ...]
        return a.swapaxes(1, 2).reshape(t * LANES, nb, *a.shape[3:])

    d, dmin = (rows(tiles[..., at : at + 2 * LANES].copy().view(np.float16)).astype(np.float32) for at in (K4_D, K4_DMIN))
    sc, mn = (rows(tiles[..., at : at + 8 * LANES].reshape(t, nb, 8, LANES).swapaxes(2, 3)) for at in (K4_SCALES, K4_MINS))
    return d, dmin, sc, mn, _nibbles_ref(tiles[..., K4_CODES:], t, nb)


def tile_scales_ref(tiles):
    """The f16 scales of Q8_0 tiles' rows as float32 [T * 16, nb]."""
    t, nb = tiles.shape
    tiles = _raw(tiles)
    scales = np.ascontiguousarray(tiles[:, :, : 2 * LANES]).view(np.float16).astype(np.float32)
    return scales.transpose(0, 2, 1).reshape(t * LANES, nb)


def tile_codes_ref(tiles):
    """The int8 codes of Q8_0 tiles' rows as int32 [T * 16, nb * 32]."""
    t, nb = tiles.shape
    tiles = _raw(tiles)
    codes = tiles[:, :, 2 * LANES :].view(np.int8).reshape(t, nb, 16, LANES, 2)  # [tile, block, pair, row, 2]
    return codes.transpose(0, 3, 1, 2, 4).reshape(t * LANES, nb * 32).astype(np.int32)


def dequantize_ref(tiles):
    """The weights of tiles as float32 [T * 16, k]."""
    if block_name(tiles) == "Q5_0":
        d, codes = q5_tile_fields_ref(tiles)
        values = d[..., None] * (codes.astype(np.float32) - 16)
        return values.reshape(len(codes), -1).astype(np.float32)
    if block_name(tiles) in ("Q4_0", "Q4_1"):
        d, m, codes = q4_tile_fields_ref(tiles)
        values = d[..., None] * (codes.astype(np.float32) - (8 if m is None else 0)) + (0 if m is None else m[..., None])
        return values.reshape(len(codes), -1).astype(np.float32)
    if block_name(tiles) == "Q6_K":
        d, sc, codes = k6_tile_fields_ref(tiles)
        values = d[..., None, None] * sc[..., None] * (codes.reshape(*codes.shape[:2], 16, 16).astype(np.float32) - 32)
        return values.reshape(len(codes), -1).astype(np.float32)
    if block_name(tiles) == "Q4_K":
        d, dmin, sc, mn, codes = k4_tile_fields_ref(tiles)
        values = (d[..., None, None] * sc[..., None] * codes.reshape(*codes.shape[:2], 8, 32)
                  - (dmin[..., None] * mn)[..., None])
        return values.reshape(len(codes), -1).astype(np.float32)
    codes, scales = tile_codes_ref(tiles), tile_scales_ref(tiles)
    return (codes.reshape(len(codes), -1, 32) * scales[..., None]).reshape(len(codes), -1).astype(np.float32)


def lanes_rows_ref(xq, xd, tiles, out, t0, t1):
    """numpy reference of lanes_rows: dequantized activations times dequantized weights (float64)."""
    n, k = xq.shape
    x = (xq.astype(np.float64).reshape(n, -1, 32) * xd[..., None]).reshape(n, k)
    w = dequantize_ref(tiles[t0:t1]).astype(np.float64)
    j0, j1 = t0 * LANES, min(out.shape[1], t1 * LANES)
    out[:, j0:j1] = (x @ w[: j1 - j0].T).astype(np.float32)


def _store_lanes(builder, q, value, row_ptr, j, m):
    """out[row, j:j + 16] = value, lanes past m left out (the last tile of a width not a multiple of 16)."""
    intp = j.type
    f32p = q.f32.as_pointer()
    base = builder.bitcast(builder.gep(row_ptr, [builder.mul(j, ir.Constant(intp, 4))]), f32p)
    full = builder.icmp_signed("<=", builder.add(j, ir.Constant(intp, LANES)), m)
    with builder.if_else(full) as (whole, part):
        with whole:
            builder.store(value, builder.bitcast(base, value.type.as_pointer()), align=4)
        with part:
            for lane in range(LANES):
                inside = builder.icmp_signed("<", builder.add(j, ir.Constant(intp, lane)), m)
                with builder.if_then(inside):
                    builder.store(builder.extract_element(value, ir.Constant(q.i32, lane)),
                                  builder.gep(base, [ir.Constant(intp, lane)]))


# vpunpcklbw and vpunpckhbw as shuffles of 32 bytes with 32 more: each 128-bit lane's low (high)
# 8 bytes interleaved with the other vector's (_Frame.words)
_UNPACK = [[i for lane in (0, 16) for at in range(8 * h, 8 * h + 8) for i in (lane + at, 2 * LANES + lane + at)] for h in (0, 1)]
# the rows in the lanes of the two halves one after the other: rows 0-3 and 8-11, then 4-7 and 12-15;
# it swaps lanes 4-7 and 8-11, so it also puts the halves' lanes back in row order (_Frame.joined)
_HALVES_ROWS = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]


class _Frame:
    """What a register block's IR shares, rows input rows (from i0) times count tiles (from t0): the
    types, a float accumulator an output, the loop over the tiles' blocks (of `values` values and
    `size` bytes) and the store of the outputs."""

    def __init__(self, context, builder, q, arrays, i0, t0, rows, count, values, size):
        self.b, self.q, self.t0, self.rows, self.count, self.size = builder, q, t0, rows, count, size
        self.intp = context.get_value_type(types.intp)
        self.i32v, self.f32v = q.vec(q.i32, LANES), q.vec(q.f32, LANES)
        self.w16 = q.vec(ir.IntType(16), 2 * LANES)
        # AVX2 holds a tile's 16 rows as two halves of 8 lanes (words): split by LLVM, its 16-lane
        # vectors spilled most registers in decode (Zen 1: 1.1-1.4x the GB/s without); prefill at
        # the same speed with a third fewer stack accesses (Q4_1 at 5 rows)
        self.halves = not WORDS_VNNI
        self.parts = 2 if self.halves else 1
        self.part_sums = q.vec(q.i32, LANES // self.parts)
        xq_a, xd_a, xs_a, _, self.out_a = arrays
        self.xd, self.xs = xd_a.data, xs_a.data
        k = cgutils.unpack_tuple(builder, xq_a.shape)[1]
        self.k, self.nb = k, builder.udiv(k, self.c(values))
        self.rows_i = [builder.add(i0, self.c(r)) for r in range(rows)]
        code_bytes = xq_a.data.type.pointee.width // 8  # int16 or int8 activation codes
        xb = builder.bitcast(xq_a.data, q.i8.as_pointer())
        self.x_rows = [builder.gep(xb, [builder.mul(i, builder.mul(k, self.c(code_bytes)))]) for i in self.rows_i]
        self.accs = [[cgutils.alloca_once_value(builder, self.zeros(self.f32v)) for _ in range(count)] for _ in range(rows)]

    def c(self, v):
        return ir.Constant(self.intp, v)

    def zeros(self, vty):
        return ir.Constant(vty, [0] * vty.count)

    def fma(self, a, x, y):
        """a * x + y, one rounding (16 lanes)."""
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(self.f32v, [self.f32v] * 3), "llvm.fma.v16f32")
        return self.b.call(fn, [a, x, y])

    def f16s(self, at):
        """The 16 rows' f16 at byte offset at, as float32 lanes."""
        ptr = self.b.bitcast(self.q.ptr(at), self.q.vec(ir.HalfType(), LANES).as_pointer())
        return self.b.fpext(self.b.load(ptr, align=2), self.f32v)

    def x_pair(self, r, at, offset, lanes=LANES):
        """Input row r's int16 pair at value offset at + offset (an IR value, a constant), broadcast
        to `lanes` lanes; in a register block of one tile on AVX512-VNNI, where each pair meets one
        vector of codes, its address for vpdpwssd to broadcast (_dot_words; Q4_K decode from memory
        1.05x the GB/s of a broadcast instruction a pair, Zen 5, interleaved in one process)."""
        ptr = self.b.gep(self.x_rows[r], [self.b.mul(at, self.c(2))])
        if self.count == 1 and broadcasts_pairs():
            return ptr, 2 * offset
        ptr = self.b.gep(ptr, [self.c(2 * offset)])
        return self.q.splat(self.b.load(self.b.bitcast(ptr, self.q.i32.as_pointer()), align=2), lanes)

    def x_pair8(self, r, at):
        """Input row r's int8 pair at value offset `at` (an IR value), broadcast to 32 bytes."""
        ptr = self.b.bitcast(self.b.gep(self.x_rows[r], [at]), ir.IntType(16).as_pointer())
        return self.b.bitcast(self.q.splat(self.b.load(ptr, align=1), 16), self.q.vec(self.q.i8, 2 * LANES))

    def words(self, raw, signed=False):
        """A pair's 32 code bytes (16 rows x 2 depths, <32 x i8>) as words, a vector a part: whole
        (vpmovzxbw, vpmovsxbw), or, on AVX2, two halves: each 128-bit lane's low and
        high 8 bytes interleaved with zeros or their signs (vpunpcklbw, vpunpckhbw), whose int32 lanes
        hold rows 0-3 and 8-11, then 4-7 and 12-15 (joined puts them back in order). In lanes, a Q4_K
        run is cut 1.26x faster than by widening each 16 bytes across lanes (Zen 1, the inner loop in
        C); widened whole, LLVM spilled most registers."""
        b = self.b
        if not self.halves:
            return [(b.sext if signed else b.zext)(raw, self.w16)]
        high = b.sext(b.icmp_signed("<", raw, self.zeros(raw.type)), raw.type) if signed else self.zeros(raw.type)
        words = self.q.vec(ir.IntType(16), LANES)
        return [b.bitcast(b.shuffle_vector(raw, high, ir.Constant(self.q.vec(self.q.i32, 2 * LANES), mask)), words)
                for mask in _UNPACK]

    def joined(self, sums):
        """The int32 sums of the parts (words) as one vector of 16 lanes in row order."""
        if not self.halves:
            return sums[0]
        return self.b.shuffle_vector(sums[0], sums[1], ir.Constant(self.i32v, _HALVES_ROWS))

    def lanes_of(self, raw, signed):
        """The 16 rows' bytes (<16 x i8>) as int32 lanes, a vector a part, in the parts' row order."""
        extend = self.b.sext if signed else self.b.zext
        if not self.halves:
            return [extend(raw, self.i32v)]
        return [extend(self.b.shuffle_vector(raw, raw, ir.Constant(self.part_sums, _HALVES_ROWS[8 * h : 8 * h + 8])), self.part_sums)
                for h in (0, 1)]

    def dx(self, r, blk, per):
        """Input row r's activation scale at block blk (of `per` blocks of 32 values)."""
        at = self.b.add(self.b.mul(self.rows_i[r], self.b.udiv(self.k, self.c(32))), self.b.mul(blk, self.c(per)))
        return self.b.load(self.b.gep(self.xd, [at]))

    def xs_at(self, r, at, count):
        """Input row r's code sums per 16 values (exact) from value offset at (a multiple of 16) on,
        `count` of them."""
        at = self.b.add(self.b.mul(self.rows_i[r], self.b.udiv(self.k, self.c(16))), self.b.udiv(at, self.c(16)))
        return [self.b.load(self.b.gep(self.xs, [self.b.add(at, self.c(h))])) for h in range(count)]

    @contextlib.contextmanager
    def blocks(self):
        """The loop over the blocks: yields (the block index, each tile's byte offset of that block)."""
        b = self.b
        tile_bytes = b.mul(self.nb, self.c(self.size))
        with cgutils.for_range(b, self.nb) as loop:
            blk = loop.index
            at = [b.add(b.mul(b.add(self.t0, self.c(s)), tile_bytes), b.mul(blk, self.c(self.size))) for s in range(self.count)]
            yield blk, at

    def prefetch(self, at, part, parts):
        """Decode streams the tiles (prefill's strip stays in L2): ask for part `part` (an IR value) of
        the `parts` parts of each tile's block at `at`, PREFETCH bytes ahead, where that part is worked
        on. Spread so over a K-quant's sub-blocks, not asked for at once (its 37 or 53 lines), Q4_K
        decode from memory went from 5.0-5.4 to 6.8 GB/s a core on int16 codes, 5.7 to 9.1 on int8
        (Zen 1; on two cores 9.2-11 to 13.3, 10.2 to 17.7)."""
        if self.rows > 1:
            return
        per = self.size // parts
        for o in at:  # + 63: every line of the part, however it is aligned
            self.q.prefetch(self.b.add(o, self.b.mul(part, self.c(per))), per + 63)

    def store(self):
        """out[rows, the tiles' columns < m] = the accumulators."""
        b = self.b
        m, out_row = cgutils.unpack_tuple(b, self.out_a.shape)[1], cgutils.unpack_tuple(b, self.out_a.strides)[0]
        outb = b.bitcast(self.out_a.data, self.q.i8.as_pointer())
        for r in range(self.rows):
            row_ptr = b.gep(outb, [b.mul(self.rows_i[r], out_row)])
            for s in range(self.count):
                j = b.mul(b.add(self.t0, self.c(s)), self.c(LANES))
                _store_lanes(b, self.q, b.load(self.accs[r][s]), row_ptr, j, m)


def _one_scale_emit(name, rows, count, context, builder, q, arrays, i0, t0):
    """IR of a one-scale type's register block (ONE_SCALE): rows input rows (from i0) times count
    tiles (from t0), every block, into out."""
    f = _Frame(context, builder, q, arrays, i0, t0, rows, count, 32, TILE_BLOCKS[name][1])
    c = f.c

    def codes(o, p):
        """Pair p's 32 codes (16 rows x 2 depths) of the tile block at o, as signed words, a vector a
        part (_Frame.words)."""
        if name == "Q8_0":  # int8 codes widened
            return f.words(q.bytes(builder.add(o, c(2 * LANES * (1 + p))), 2 * LANES), signed=True)
        run, u = p % 8, p // 8  # 4 bits from a nibble run (Q5_0: the fifth from a bit run), less the offset
        runs = {"Q5_0": Q5_LOW, "Q4_0": 2 * LANES, "Q4_1": 4 * LANES}[name]
        code = q.field(q.bytes(builder.add(o, c(runs + 2 * LANES * run)), 2 * LANES), 4 * u, 15, 0)
        if name == "Q5_0":
            code = builder.or_(code, q.field(q.bytes(builder.add(o, c(Q5_HIGH + 2 * LANES * (run // 4))), 2 * LANES),
                                             2 * (run % 4) + u, 1, 4))
        offset = {"Q5_0": 16, "Q4_0": 8, "Q4_1": 0}[name]  # Q4_1's min is a float step (its codes' sums)
        return [builder.sub(w, ir.Constant(w.type, [offset] * w.type.count)) for w in f.words(code)]

    with f.blocks() as (blk, at):
        f.prefetch(at, c(0), 1)
        sums = [[[f.zeros(f.part_sums)] * f.parts for _ in range(count)] for _ in range(rows)]
        for p in (run + 8 * u for run in range(8) for u in (0, 1)):  # a nibble run's two pairs in turn (exact sums: any order)
            words = [[builder.bitcast(w, f.part_sums) for w in codes(o, p)] for o in at]  # shared by the rows
            for r in range(rows):
                pair = f.x_pair(r, builder.mul(blk, c(32)), 2 * p, f.part_sums.count)
                for s in range(count):
                    sums[r][s] = [_dot_words(builder, acc, w, pair) for acc, w in zip(sums[r][s], words[s])]
        sums = [[f.joined(parts_sums) for parts_sums in row_sums] for row_sums in sums]
        scales = [f.f16s(o) for o in at]
        mins = [f.f16s(builder.add(o, c(2 * LANES))) for o in at] if name == "Q4_1" else None
        for r in range(rows):
            dx = f.dx(r, blk, 1)
            if name == "Q4_1":  # its min times the row's code sums of the block, times its scale: once
                xs = q.splat(builder.fmul(builder.fadd(*f.xs_at(r, builder.mul(blk, c(32)), 2)), dx), LANES)
            dx = q.splat(dx, LANES)
            for s in range(count):
                step = builder.fmul(scales[s], dx)  # one float product, then one fma: each rounds once
                acc = f.fma(builder.sitofp(sums[r][s], f.f32v), step, builder.load(f.accs[r][s]))
                if name == "Q4_1":
                    acc = f.fma(mins[s], xs, acc)
                builder.store(acc, f.accs[r][s])
    f.store()


def _k_emit(name, rows, count, context, builder, q, arrays, i0, t0):
    """IR of a K-quant's register block (Q4_K or Q6_K): rows input rows (from i0) times count tiles
    (from t0), every super-block, into out. Per pair of depths, a tile's 16 rows of codes are cut
    from their bits, shared by the input rows, then one vpdpwssd a row; per sub-block, its scales
    times the int32 sums (Q6_K's offset 32 taken off the sums, not off every code: prefill 1.11x,
    decode 1.05-1.09x, Zen 5); per super-block, one conversion and one FMA an output, and Q4_K's
    mins (times the activations' code sums) one more."""
    k4 = name == "Q4_K"
    scales_at, d_at = (K4_SCALES, K4_D) if k4 else (K6_SCALES, K6_D)
    f = _Frame(context, builder, q, arrays, i0, t0, rows, count, 256, TILE_BLOCKS[name][1])
    c = f.c

    widened = {}  # (tile offset, group, run) -> Q4_K's run widened to words (codes)

    def run_at(o, g, run):
        """The byte offset of nibble run `run` of group g (an IR value) in the tile's block at o."""
        return builder.add(o, builder.add(builder.mul(g, c(8 * 2 * LANES)), c((K4_CODES if k4 else K6_LOW) + run * 2 * LANES)))

    def cut(o, g, run, u, runs=1):
        """The code bytes of pair half u of `runs` adjacent nibble runs from `run` on, 32 a run, of
        group g (an IR value): values 32 g + 16 u + 2 run + h."""
        size = 2 * LANES * runs
        code = q.field(q.bytes(run_at(o, g, run), size), 4 * u, 15, 0)
        if not k4:
            offset, bit = _k6_high(run)
            at = builder.add(o, builder.add(builder.mul(g, c(4 * 2 * LANES)), c(K6_HIGH + offset)))
            code = builder.or_(code, q.field(q.bytes(at, size), bit + 2 * u, 3, 4))
        return code

    def codes(o, g, run, u):
        """Pair run + 8 u's 32 code bytes as words, a vector a part (_Frame.words). Q4_K on AVX-512
        cuts its nibbles from the widened run (one vpmovzxbw for both halves u, then vpandd or
        vpsrlw: the words' high bytes are zero). Zen 5, decode one thread, tiles in cache: 31-37 ->
        35-46 GB/s against a byte-wise cut and widening a half; from memory and prefill alike."""
        if k4 and not f.halves:
            if (o, g, run) not in widened:  # opaque to LLVM, which would narrow the cut back to bytes
                widened[o, g, run] = builder.asm(ir.FunctionType(f.w16, [q.i8.as_pointer()]), "vpmovzxbw ($1), $0", "=v,r",
                                                 [q.ptr(run_at(o, g, run))], side_effect=False, name="widen")
            run_words = widened[o, g, run]
            nibble = (builder.and_ if u == 0 else builder.lshr)(run_words, ir.Constant(f.w16, [15 if u == 0 else 4] * f.w16.count))
            return [nibble]
        return f.words(cut(o, g, run, u))

    def k6_run_pair(o, g, first, u):
        """codes of Q6_K runs first and first + 1 (first even) at once, cut in 64 bytes (AVX-512):
        half the byte-wise instructions, then each half widened. Zen 5, against a run at a time:
        decode one thread, tiles in cache, 33-36 -> 40-45 GB/s; two threads from memory, best pass,
        the 151,936 x 2,048 output head 28-31 -> 36 GB/s, 6,144 x 2,048 32-36 -> 37-42; prefill of
        512 rows, one thread, 232-250 -> 252-276 GFLOP/s."""
        code = cut(o, g, first, u, 2)
        halves = [builder.shuffle_vector(code, code, ir.Constant(q.vec(q.i32, 2 * LANES), list(range(h, h + 2 * LANES))))
                  for h in (0, 2 * LANES)]
        return [f.words(half) for half in halves]

    def scaled_group(total, at, scale_at, g, group_at):
        """total + group g's code products, every input row and tile: per pair of depths one
        vpdpwssd a row and tile into int32 sums, a chain per scale (Q6_K: one per half u of the
        group), then the sums, less Q6_K's offset (32 times the activations' code sum), times their
        sub-block scales (vpmulld, one a scale of 16 rows, where scaling the codes took a vpmullw a
        pair and tile on the ports vpdpwssd needs): exact int32 sums, the same in prefill and
        decode (wrapped in between or not: the totals fit in int32)."""
        sums = [[[[f.zeros(f.part_sums)] * f.parts for _ in range(count)] for _ in range(rows)] for _ in range(1 if k4 else 2)]
        # one tile of one row alternates Q6_K's chains; its register blocks end one chain before the
        # next (its second beside the first would spill)
        pairs = [(run, u) for run in range(8) for u in (0, 1)] if k4 or rows * count == 1 else [(run, u) for u in (0, 1) for run in range(8)]
        wide = not k4 and not f.halves
        run_pairs = {}  # u -> each tile's codes of the runs cut together
        for run, u in pairs:
            if wide and run % 2 == 0:
                run_pairs[u] = [k6_run_pair(o, g, run, u) for o in at]
            words = [[builder.bitcast(w, f.part_sums) for w in (run_pairs[u][s][run % 2] if wide else codes(o, g, run, u))]
                     for s, o in enumerate(at)]  # shared by the rows
            chain = sums[0 if k4 else u]
            for r in range(rows):
                pair = f.x_pair(r, group_at, 2 * (run + 8 * u), f.part_sums.count)
                for s in range(count):
                    chain[r][s] = [_dot_words(builder, acc, w, pair) for acc, w in zip(chain[r][s], words[s])]
        for h, chain in enumerate(sums):
            if not k4:  # sum (code - 32) x = sum code x - 32 sum x
                for r in range(rows):
                    offset = builder.shl(builder.fptosi(f.xs_at(r, builder.add(group_at, c(16 * h)), 1)[0], q.i32), ir.Constant(q.i32, 5))
                    offset = q.splat(offset, f.part_sums.count)
                    chain[r] = [[builder.sub(part, offset) for part in parts] for parts in chain[r]]
            for s in range(count):
                scale = f.lanes_of(q.bytes(scale_at[s][h], LANES), signed=not k4)
                for r in range(rows):
                    total[r][s] = [builder.add(a, builder.mul(part, sc)) for a, part, sc in zip(total[r][s], chain[r][s], scale)]
        return total

    def add_up(sums, step):
        """The sums' slots (a slot a part) = step(their values)."""
        total = step([[[builder.load(slot) for slot in parts] for parts in row_sums] for row_sums in sums])
        for row_sums, row_total in zip(sums, total):
            for parts, values in zip(row_sums, row_total):
                for slot, value in zip(parts, values):
                    builder.store(value, slot)

    with f.blocks() as (blk, at):
        sums = [[[cgutils.alloca_once_value(builder, f.zeros(f.part_sums)) for _ in range(f.parts)] for _ in range(count)]
                for _ in range(rows)]  # a slot a part
        for slot in (slot for row_sums in sums for parts in row_sums for slot in parts):
            builder.store(f.zeros(f.part_sums), slot)
        # a loop over the 8 groups in prefill (8x less code to compile); unrolled in decode, where
        # the loop cost a third of the rate (Q4_K at k = 2048: 17.5 against 25 GB/s of cached tiles),
        # but for AVX2, where LLVM spilled the unrolled groups' registers
        unrolled = 8 if rows == 1 and WORDS_VNNI else 1
        with cgutils.for_range(builder, c(8 // unrolled)) as groups:
            for g_in in range(unrolled):
                g = builder.add(builder.mul(groups.index, c(unrolled)), c(g_in))
                f.prefetch(at, g, 8)
                # Q4_K: a scale per 32 values; Q6_K: per 16, one for each half u of the group
                scale_at = [[builder.add(o, builder.add(builder.mul(g, c(LANES if k4 else 2 * LANES)), c(scales_at + LANES * u)))
                             for u in ((0,) if k4 else (0, 1))] for o in at]
                group_at = builder.add(builder.mul(blk, c(256)), builder.mul(g, c(32)))
                add_up(sums, lambda total: scaled_group(total, at, scale_at, g, group_at))
        d = [f.f16s(builder.add(o, c(d_at))) for o in at]
        if k4:
            dmin = [builder.fneg(f.f16s(builder.add(o, c(K4_DMIN)))) for o in at]
            mins = [[builder.uitofp(builder.zext(q.bytes(builder.add(o, c(K4_MINS + LANES * g)), LANES), f.i32v), f.f32v)
                     for g in range(8)] for o in at]
        for r in range(rows):
            dx = q.splat(f.dx(r, blk, 8), LANES)  # one activation scale per 256 values (quant.activation_group)
            if k4:
                xs = f.xs_at(r, builder.mul(blk, c(256)), 16)
                xs = [q.splat(builder.fadd(xs[2 * g], xs[2 * g + 1]), LANES) for g in range(8)]  # exact: < 2^21
            for s in range(count):
                isum = f.joined([builder.load(slot) for slot in sums[r][s]])
                acc = f.fma(builder.sitofp(isum, f.f32v), builder.fmul(d[s], dx), builder.load(f.accs[r][s]))
                if k4:  # the mins times the codes' sums per 32, in order, then times -dmin
                    bias = builder.fmul(mins[s][0], xs[0])
                    for g in range(1, 8):
                        bias = f.fma(mins[s][g], xs[g], bias)
                    acc = f.fma(bias, builder.fmul(dmin[s], dx), acc)
                builder.store(acc, f.accs[r][s])
    f.store()


# vpunpcklwd and vpunpckhwd as shuffles of 16 words with 16 more: each 128-bit lane's low (high) 4
# words interleaved with the other vector's, so row r's two sums sit side by side in the halves' order
_UNPACK_WORDS = [[i for lane in (0, 8) for at in range(4 * h, 4 * h + 4) for i in (lane + at, LANES + lane + at)] for h in (0, 1)]


def _int8_chunks(name):
    """(scale u, chunk a's pairs, chunk b's pairs) of a group of 32 values, a pair (run, u) being
    values 16 u + 2 run + h: pairs a chunk sums in int16 (under 2^15), two chunks of one scale."""
    if name in ("Q4_0", "Q4_1", "Q4_K"):  # 8 pairs of 4-bit codes: 8 x 2 x 15 x 127
        return [(0, [(run, 0) for run in range(8)], [(run, 1) for run in range(8)])]
    per = 4 if name == "Q5_0" else 2  # 4 x 2 x 31 x 127, 2 x 2 x 63 x 127 (Q6_K: a scale per 16 values)
    return [(u if name == "Q6_K" else 0, [(run, u) for run in range(j, j + per)], [(run, u) for run in range(j + per, j + 2 * per)])
            for u in (0, 1) for j in range(0, 8, 2 * per)]


def _int8_emit(name, rows, count, context, builder, q, arrays, i0, t0):
    """IR of a register block of INT8_BLOCKS tiles on int8 activations (AVX2, the "int8" path): per
    pair of depths one vpmaddubsw a row (a tile's 16 rows x 2 depths of unsigned codes against the
    row's broadcast pair of int8 codes: 16 int16 sums of two products), a chunk of pairs summed in
    int16 (8 pairs of 4-bit codes, 4 of 5-bit, 2 of 6-bit: at most 2^15 - 1), then two chunks of one
    scale interleaved by row and times their (sub-block) scale, or 1, in one vpmaddwd per 8 rows
    (int32, exact); per 32 values (the activations' scale), one conversion and one FMA an output for
    the codes, one for Q4_K's mins, Q4_1's min or the others' offset (8, 16 or 32: taken off in
    floats, times the activations' code sums). An output's bits depend neither on n nor on its
    register block."""
    k_quant, k4 = name in ("Q4_K", "Q6_K"), name == "Q4_K"
    values = TILE_BLOCKS[name][0]
    f = _Frame(context, builder, q, arrays, i0, t0, rows, count, values, TILE_BLOCKS[name][1])
    c = f.c
    b8, w16, i32x8 = q.vec(q.i8, 2 * LANES), q.vec(ir.IntType(16), LANES), q.vec(q.i32, 8)
    maddubs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(w16, [b8, b8]), "llvm.x86.avx2.pmadd.ub.sw")
    madd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32x8, [w16, w16]), "llvm.x86.avx2.pmadd.wd")
    offset = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32}.get(name)  # taken off in floats (Q4_K, Q4_1: a min)

    def code_bytes(o, g, run, u):
        """The 32 code bytes of pair (run, u) of group g (16 rows x 2 depths, unsigned)."""
        low = {"Q4_K": K4_CODES, "Q6_K": K6_LOW, "Q5_0": Q5_LOW, "Q4_0": 2 * LANES, "Q4_1": 4 * LANES}[name]
        at = builder.add(o, builder.add(builder.mul(g, c(8 * 2 * LANES)), c(low + run * 2 * LANES)))
        code = q.field(q.bytes(at, 2 * LANES), 4 * u, 15, 0)
        if name == "Q6_K":
            offset, bit = _k6_high(run)
            at = builder.add(o, builder.add(builder.mul(g, c(4 * 2 * LANES)), c(K6_HIGH + offset)))
            return builder.or_(code, q.field(q.bytes(at, 2 * LANES), bit + 2 * u, 3, 4))
        if name == "Q5_0":
            return builder.or_(code, q.field(q.bytes(builder.add(o, c(Q5_HIGH + 2 * LANES * (run // 4))), 2 * LANES),
                                             2 * (run % 4) + u, 1, 4))
        return code

    def scale_words(at):  # the 16 rows' scale bytes as words, row r's twice, in the halves' row order
        if at is None:
            return [ir.Constant(w16, [1] * LANES)] * 2
        raw = q.bytes(at, LANES)
        doubled = builder.shuffle_vector(raw, raw, ir.Constant(q.vec(q.i32, 2 * LANES), [l // 2 for l in range(2 * LANES)]))
        return [builder.bitcast(w, w16) for w in f.words(doubled, signed=name == "Q6_K")]

    def chunk_sums(at, g, group_at, pairs):
        """Each (row, tile)'s int16 sums of the pairs' products."""
        sums = [[None] * count for _ in range(rows)]
        for run, u in pairs:
            codes = [code_bytes(o, g, run, u) for o in at]  # shared by the rows
            for r in range(rows):
                pair = f.x_pair8(r, builder.add(group_at, c(2 * (run + 8 * u))))
                for s in range(count):
                    prod = builder.call(maddubs, [codes[s], pair])
                    sums[r][s] = prod if sums[r][s] is None else builder.add(sums[r][s], prod)
        return sums

    with f.blocks() as (blk, at):
        d = [f.f16s(o) for o in at]  # every block starts with its rows' d
        if k4:
            dmin = [builder.fneg(f.f16s(builder.add(o, c(K4_DMIN)))) for o in at]
        elif name == "Q4_1":
            mins = [f.f16s(builder.add(o, c(2 * LANES))) for o in at]
        with cgutils.for_range(builder, c(values // 32)) as groups:
            g = groups.index
            f.prefetch(at, g, values // 32)
            group_at = builder.add(builder.mul(blk, c(values)), builder.mul(g, c(32)))
            scale_at = [builder.add(o, builder.add(builder.mul(g, c(LANES if k4 else 2 * LANES)), c(K4_SCALES if k4 else K6_SCALES)))
                        if k_quant else None for o in at]
            isums = [[[f.zeros(f.part_sums)] * 2 for _ in range(count)] for _ in range(rows)]
            for u, pairs_a, pairs_b in _int8_chunks(name):
                scales = [scale_words(a if a is None else builder.add(a, c(LANES * u))) for a in scale_at]
                sums_a, sums_b = chunk_sums(at, g, group_at, pairs_a), chunk_sums(at, g, group_at, pairs_b)
                for r in range(rows):
                    for s in range(count):
                        isums[r][s] = [builder.add(total, builder.call(madd, [
                            builder.shuffle_vector(sums_a[r][s], sums_b[r][s], ir.Constant(q.vec(q.i32, LANES), mask)), sc]))
                            for total, mask, sc in zip(isums[r][s], _UNPACK_WORDS, scales[s])]
            group = builder.udiv(group_at, c(32))
            if k4:  # the mins, as floats
                mins = [builder.uitofp(builder.zext(q.bytes(builder.add(a, c(K4_MINS - K4_SCALES)), LANES), f.i32v), f.f32v)
                        for a in scale_at]
            elif name == "Q6_K":  # the two scales, as floats: the offset comes off their codes' sums
                scales16 = [[builder.sitofp(builder.sext(q.bytes(builder.add(a, c(LANES * u)), LANES), f.i32v), f.f32v)
                             for u in (0, 1)] for a in scale_at]
            for r in range(rows):
                dx = f.dx(r, group, 1)
                xs = f.xs_at(r, group_at, 2)
                for s in range(count):
                    acc = f.fma(builder.sitofp(f.joined(isums[r][s]), f.f32v), builder.fmul(d[s], q.splat(dx, LANES)),
                                builder.load(f.accs[r][s]))
                    if k4:  # mins x the codes' sum (exact: < 2^21) x -dmin
                        acc = f.fma(mins[s], builder.fmul(dmin[s], q.splat(builder.fmul(builder.fadd(*xs), dx), LANES)), acc)
                    elif name == "Q4_1":  # the min x the codes' sum
                        acc = f.fma(mins[s], q.splat(builder.fmul(builder.fadd(*xs), dx), LANES), acc)
                    elif name == "Q6_K":  # the scales x the codes' sums per 16 (exact: < 2^24) x -32 d
                        bias = f.fma(scales16[s][1], q.splat(xs[1], LANES), builder.fmul(scales16[s][0], q.splat(xs[0], LANES)))
                        acc = f.fma(bias, builder.fmul(d[s], q.splat(builder.fmul(dx, ir.Constant(q.f32, -offset)), LANES)), acc)
                    else:  # d x the codes' sum x -offset
                        step = builder.fmul(builder.fadd(*xs), builder.fmul(dx, ir.Constant(q.f32, -offset)))
                        acc = f.fma(d[s], q.splat(step, LANES), acc)
                    builder.store(acc, f.accs[r][s])
    f.store()


def _make_lanes_block(name, emits, rb, sb):
    """The intrinsic lanes_block of one tile format: its register blocks dispatched at run time (every
    size <= rb x sb is generated: left-over rows and tiles run the same per-output arithmetic);
    emits: the activation codes' numba type -> (the path, the emit of a register block)."""

    def codegen(emit, context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:5], args[:5])]
        i0, rows, t0, count = args[5:9]
        q = _Ir(builder, builder.bitcast(arrays[3].data, ir.IntType(8).as_pointer()))
        intp = context.get_value_type(types.intp)
        for r in range(1, rb + 1):
            for s in range(1, sb + 1):
                this = builder.and_(builder.icmp_signed("==", rows, ir.Constant(intp, r)),
                                    builder.icmp_signed("==", count, ir.Constant(intp, s)))
                with builder.if_then(this):
                    emit(name, r, s, context, builder, q, arrays, i0, t0)
        return context.get_dummy_value()

    def lanes_block(typingctx, xq, xd, xs, tiles, out, i0, rows, t0, count):
        """out[i0:i0 + rows, 16 t0 : 16 (t0 + count)] (columns < m) = the input rows times the tiles'
        weight rows, rows <= rb, count <= sb. xq: [n, k] int16 codes (int8 on the "int8" path, for
        INT8_BLOCKS), xd: [n, k/32] float32 scales and xs: [n, k/16] code sums
        (quant.quantize_activations), tiles: [T, k / values of a block] of this block type (repack),
        all C-contiguous; out: [n, m] float32 of contiguous columns (a column slice is fine). Needs
        the features of the codes' path (cpu.py)."""
        if not (isinstance(xq, types.Array) and xq.dtype in emits and xq.layout == "C"):
            return None
        if not all(isinstance(a, types.Array) and a.layout == "C" for a in (xd, xs, tiles)) or not isinstance(out, types.Array):
            return None
        if tiles_name(tiles) != name:
            return None
        sig = types.void(xq, xd, xs, tiles, out, types.intp, types.intp, types.intp, types.intp)
        path, emit = emits[xq.dtype]
        return sig, cpu.compiled_for(path, functools.partial(codegen, emit))

    return intrinsic(lanes_block)


INT8_BLOCKS = ("Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")  # the tile formats with a kernel on int8 codes ("int8" path, AVX2)
BLOCKS = {name: _make_lanes_block(name, {types.int16: ("int16", _one_scale_emit if name in ONE_SCALE else _k_emit),
                                         **({types.int8: ("int8", _int8_emit)} if name in INT8_BLOCKS else {})}, RB, SB)
          for name in TILE_BLOCKS}  # block type -> its intrinsic lanes_block


def lanes_rows(xq, xd, xs, tiles, out, t0, t1):
    """out[:, 16 t0 : 16 t1] (columns < m) = every quantized input row times the weight rows of
    tiles [t0, t1), in register blocks of RB rows x SB tiles (a strip of SB tiles over all rows; one
    input row: DECODE_SB tiles)."""
    raise NotImplementedError("numba only")


@overload(lanes_rows, jit_options={"nogil": True, "fastmath": FASTMATH_IN_ORDER})
def _lanes_rows_overload(xq, xd, xs, tiles, out, t0, t1):
    block = BLOCKS[tiles_name(tiles)]

    def impl(xq, xd, xs, tiles, out, t0, t1):
        n = xq.shape[0]
        sb = DECODE_SB if n == 1 else SB
        for s0 in range(t0, t1, sb):
            count = min(sb, t1 - s0)
            for i0 in range(0, n, RB):
                block(xq, xd, xs, tiles, out, i0, min(RB, n - i0), s0, count)

    return impl


def tile_values(tiles):
    """The values a tile's block covers along the depth, inside numba code."""
    raise NotImplementedError("numba only")


@overload(tile_values, jit_options={"fastmath": False})
def _tile_values_overload(tiles):
    values = TILE_BLOCKS[tiles_name(tiles)][0]
    return lambda tiles: values


def takes_int8(t, codes) -> bool:
    """True when tiles of numba type t take int8 activation codes from `codes`, the numba type of a
    tuple of code buffers: six of them (int16's three, then the "int8" path's) and t of INT8_BLOCKS
    (typing time)."""
    return len(codes) == 6 and tiles_name(t) in INT8_BLOCKS


def int8_codes(tiles) -> bool:
    """True when tiles meet int8 activation codes: the "int8" path is on and their format has its
    kernel (INT8_BLOCKS); else int16."""
    return "int8" in cpu.ENABLED and block_name(tiles) in INT8_BLOCKS


def linear_lanes(x, tiles, out, workers):
    """out[n, m] = x @ w.T for weights w repacked to tiles (repack): x [n, k] float32 quantized to
    int16 codes (int8 where int8_codes; its rows split between the workers), then each worker an
    equal share of the tiles over all rows."""
    _linear_codes(x, np.empty(x.shape, np.int8 if int8_codes(tiles) else np.int16), tiles, out, workers)


@numba.njit(cache=True, nogil=True, fastmath=FASTMATH_IN_ORDER, parallel=True)
def _linear_codes(x, xq, tiles, out, workers):
    """linear_lanes with the activation codes xq [n, k] to fill (int8 or int16)."""
    n, k = x.shape
    if k != tile_values(tiles) * tiles.shape[1] or out.shape[1] > LANES * tiles.shape[0] or out.shape[0] != n:
        raise ValueError("linear_lanes: x [n, k], tiles [ceil(m/16), blocks] and out [n, m] disagree")
    xd = np.empty((n, k // 32), np.float32)
    xs = np.empty((n, k // 16), np.float32)
    for wk in prange(workers):
        r0, r1 = wk * n // workers, (wk + 1) * n // workers
        quant.quantize_activations(x[r0:r1], xq[r0:r1], xd[r0:r1], xs[r0:r1])
    t = tiles.shape[0]
    for wk in prange(workers):
        lanes_rows(xq, xd, xs, tiles, out, wk * t // workers, (wk + 1) * t // workers)


def linear_lanes_ref(x, tiles, out, workers):
    """numpy reference of linear_lanes."""
    xq, xd, _ = quant.quantize_activations_ref(x, np.int8 if int8_codes(tiles) else np.int16)
    lanes_rows_ref(xq, xd, tiles, out, 0, tiles.shape[0])
