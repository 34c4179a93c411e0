"""Q8_0 weights with their outputs in lanes: an int16 GEMM/GEMV on vpdpwssd (vpmaddwd on AVX2).

Shape legend:
  n   input rows (tokens)
  k   depth, a multiple of 32; nb = k / 32 blocks
  m   output features (weight rows); T = ceil(m / 16) tiles of 16 weight rows

rows_vnni (quant_int.py) sums a weight row's block in the lanes of one vector, then pays a lane
fold, a conversion and an FMA per (input row, weight row, block): the float steps cost as much as
the products. Here the 16 weight rows of a tile sit in the 16 int32 lanes of a vector: a block
costs 16 vpdpwssd (one per pair of depths, the input's pair of int16 codes broadcast), then one
conversion and one FMA for 16 outputs, and no horizontal sum remains.

Tile layout (repack_q8_0; the GGUF's bytes rearranged, 544 = 16 x 34 a tile's block): for tile t
and block b, the 16 rows' f16 scales (32 bytes), then for each pair p of depths (16 pairs) 32
bytes, row r's codes at depths 32b + 2p and 32b + 2p + 1 at bytes 2r and 2r + 1. Rows past m are
zero (scale 0).

One arithmetic: every output is, block by block in increasing order from acc = 0,
  acc = fma(float(isum), w_scale[j, b] * xd[i, b], acc)
with isum the exact int32 sum of the block's 32 code products: an output's bits depend neither on
n nor on the rows or tiles that share its register block, so decode (n = 1) and prefill give a
token the same numbers.

Measured (scripts/lanes_bench.py; Xeon with AVX512-VNNI, no AMX, shared: directional; one thread,
CPU time, 512 rows, GFLOP/s): lanes 120-220 against rows_vnni's 35-78 (2.3-3.5x) and the f32
GEMM's 73-120 (1.3-1.9x), the most at k = 2,048-6,144; decode (1 row) 27-32 GB/s of cached weights
against 9-14, 13-16 GB/s from memory against 8-9. The register block: 4 x 3, 3 x 4, 5 x 2 and
6 x 2 within the noise; 4 x 3 kept. The model families repack Q8_0 matrices at load where
`wanted` says (model/llama.py), and matmul's linear, linear_prefill and path_rows run the tiles.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ellmd.kernels import cpu, quant
from ellmd.kernels.quant_int import FASTMATH_IN_ORDER, WORDS_VNNI, _dot_words, _Ir

LANES = 16  # weight rows of a tile: vpdpwssd's int32 lanes
TILE_BLOCK = 2 * LANES + 16 * 2 * LANES  # bytes of a tile's block: 16 scales, 16 pairs of 16 x 2 codes
# input rows x tiles of a register block: RB * SB int32 sums and as many float accumulators, SB
# widened weight vectors and RB broadcast pairs (AVX-512: 4 x 3 -> 24 + 3 + 4 of 32 registers;
# AVX2 keeps each 16-lane vector in two registers of its 16)
RB, SB = (4, 3) if WORDS_VNNI else (2, 1)


def is_tiles(w) -> bool:
    """True for Q8_0 weights repacked to tiles (repack_q8_0)."""
    return isinstance(w, np.ndarray) and w.dtype == np.uint8 and w.ndim == 3 and w.shape[2] == TILE_BLOCK


def rows(w) -> int:
    """Weight rows of a matrix, tiles or not (tiles: 16 a tile, the last one's padding included)."""
    return LANES * w.shape[0] if is_tiles(w) else w.shape[0]


def tiles_type(t) -> bool:
    """True for the numba type of tiles (typing time)."""
    return isinstance(t, types.Array) and t.dtype == types.uint8 and t.ndim == 3


def part_rows(w):
    """rows, inside numba code."""
    raise NotImplementedError("numba only")


@overload(part_rows, jit_options={"nogil": True})
def _part_rows_overload(w):
    if tiles_type(w):
        return lambda w: LANES * w.shape[0]
    return lambda w: w.shape[0]


def wanted(w) -> bool:
    """True when weight matrix w is best repacked to tiles at load: Q8_0 with rows a multiple of 16
    (a fused weight's parts then start on tiles), on the int16 path alone (the int8 "vnni" path
    quantizes activations to int8). With AMX on too, the tiles still beat its block prefill and keep
    decode's sums (Qwen3-1.7B shapes, pp512: 145 tok/s against 107 on AMX, Xeon with AMX)."""
    int16_only = cpu.INTEGER & cpu.ENABLED == {"int16"}
    return int16_only and quant.block_name(w) == "Q8_0" and w.ndim == 2 and w.shape[0] % LANES == 0


def repack_q8_0(w):
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


def tile_scales_ref(tiles):
    """The f16 scales of the tiles' rows as float32 [T * 16, nb]."""
    t, nb = tiles.shape[:2]
    scales = np.ascontiguousarray(tiles[:, :, : 2 * LANES]).view(np.float16).astype(np.float32)
    return scales.transpose(0, 2, 1).reshape(t * LANES, nb)


def tile_codes_ref(tiles):
    """The int8 codes of the tiles' rows as int32 [T * 16, nb * 32]."""
    t, nb = tiles.shape[:2]
    codes = tiles[:, :, 2 * LANES :].view(np.int8).reshape(t, nb, 16, LANES, 2)  # [tile, block, pair, row, 2]
    return codes.transpose(0, 3, 1, 2, 4).reshape(t * LANES, nb * 32).astype(np.int32)


def dequantize_ref(tiles):
    """The weights of tiles as float32 [T * 16, k]."""
    codes, scales = tile_codes_ref(tiles), tile_scales_ref(tiles)
    return (codes.reshape(len(codes), -1, 32) * scales[..., None]).reshape(len(codes), -1).astype(np.float32)


def lanes_rows_ref(xq, xd, tiles, out, t0, t1):
    """numpy reference of lanes_rows: dequantized activations times dequantized weights (float64)."""
    n, k = xq.shape
    x = (xq.astype(np.float64).reshape(n, -1, 32) * xd[..., None]).reshape(n, k)
    w = dequantize_ref(tiles[t0:t1]).astype(np.float64)
    j0, j1 = t0 * LANES, min(out.shape[1], t1 * LANES)
    out[:, j0:j1] = (x @ w[: j1 - j0].T).astype(np.float32)


def _block_codegen(rows, count):
    """IR of rows input rows (from i0) times count tiles (from t0), every block, into out."""

    def emit(context, builder, q, arrays, i0, t0):
        xq_a, xd_a, tiles_a, out_a = arrays
        intp = context.get_value_type(types.intp)
        i32v, f32v, w16 = q.vec(q.i32, LANES), q.vec(q.f32, LANES), q.vec(ir.IntType(16), 2 * LANES)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32v, [f32v] * 3), "llvm.fma.v16f32")

        def c(v):
            return ir.Constant(intp, v)

        n, k = cgutils.unpack_tuple(builder, xq_a.shape)
        nb = builder.udiv(k, c(32))
        tile_bytes = builder.mul(nb, c(TILE_BLOCK))
        m = cgutils.unpack_tuple(builder, out_a.shape)[1]
        out_row = cgutils.unpack_tuple(builder, out_a.strides)[0]
        xb, outb = (builder.bitcast(a.data, q.i8.as_pointer()) for a in (xq_a, out_a))
        x_rows = [builder.gep(xb, [builder.mul(builder.add(i0, c(r)), builder.mul(k, c(2)))]) for r in range(rows)]
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(f32v, [0.0] * LANES)) for _ in range(count)]
                for _ in range(rows)]
        with cgutils.for_range(builder, nb) as blocks:
            blk = blocks.index
            at = [builder.add(builder.mul(builder.add(t0, c(s)), tile_bytes), builder.mul(blk, c(TILE_BLOCK)))
                  for s in range(count)]
            for o in at if rows == 1 else ():  # decode streams the tiles; prefill's strip stays in L2
                q.prefetch(o, TILE_BLOCK)
            sums = [[ir.Constant(i32v, [0] * LANES)] * count for _ in range(rows)]
            for p in range(16):
                # the pair's 32 code bytes of each tile, widened to int16 (vpmovsxbw), shared by the rows
                codes = [builder.bitcast(builder.sext(q.bytes(builder.add(o, c(2 * LANES * (1 + p))), 2 * LANES), w16),
                                         i32v) for o in at]
                for r in range(rows):
                    pair = builder.gep(x_rows[r], [builder.add(builder.mul(blk, c(64)), c(4 * p))])
                    pair = q.splat(builder.load(builder.bitcast(pair, q.i32.as_pointer()), align=2), LANES)
                    for s in range(count):
                        sums[r][s] = _dot_words(builder, sums[r][s], codes[s], pair)
            scales = [builder.fpext(builder.load(builder.bitcast(q.ptr(o), q.vec(ir.HalfType(), LANES).as_pointer()),
                                                 align=2), f32v) for o in at]
            for r in range(rows):
                dx = builder.load(builder.gep(xd_a.data, [builder.add(builder.mul(builder.add(i0, c(r)), nb), blk)]))
                dx = q.splat(dx, LANES)
                for s in range(count):
                    step = builder.fmul(scales[s], dx)  # one float product, then one fma: each rounds once
                    builder.store(builder.call(fma, [builder.sitofp(sums[r][s], f32v), step, builder.load(accs[r][s])]),
                                  accs[r][s])
        for r in range(rows):
            row_ptr = builder.gep(outb, [builder.mul(builder.add(i0, c(r)), out_row)])
            for s in range(count):
                j = builder.mul(builder.add(t0, c(s)), c(LANES))
                _store_lanes(builder, q, builder.load(accs[r][s]), row_ptr, j, m)

    return emit


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


def _lanes_block_codegen(context, builder, signature, args):
    """Dispatch (rows, count) at run time to the register block of that size (every size <= RB x SB
    is generated: left-over rows and tiles run the same per-output arithmetic)."""
    arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:4], args[:4])]
    i0, rows, t0, count = args[4:8]
    q = _Ir(builder, builder.bitcast(arrays[2].data, ir.IntType(8).as_pointer()))
    intp = context.get_value_type(types.intp)
    for r in range(1, RB + 1):
        for s in range(1, SB + 1):
            this = builder.and_(builder.icmp_signed("==", rows, ir.Constant(intp, r)),
                                builder.icmp_signed("==", count, ir.Constant(intp, s)))
            with builder.if_then(this):
                _block_codegen(r, s)(context, builder, q, arrays, i0, t0)
    return context.get_dummy_value()


@intrinsic
def lanes_block(typingctx, xq, xd, tiles, out, i0, rows, t0, count):
    """out[i0:i0 + rows, 16 t0 : 16 (t0 + count)] (columns < m) = the input rows times the tiles'
    weight rows, rows <= RB, count <= SB. xq: [n, k] int16 codes and xd: [n, k/32] float32 scales
    (quant.quantize_activations), tiles: [T, k/32, 544] uint8 (repack_q8_0), all C-contiguous;
    out: [n, m] float32 of contiguous columns (a column slice is fine). Needs the "int16" path's
    features (cpu.py)."""
    if not (isinstance(xq, types.Array) and xq.dtype == types.int16 and xq.layout == "C"):
        return None
    if not all(isinstance(a, types.Array) and a.layout == "C" for a in (xd, tiles)) or not isinstance(out, types.Array):
        return None
    sig = types.void(xq, xd, tiles, out, types.intp, types.intp, types.intp, types.intp)
    return sig, cpu.compiled_for("int16", _lanes_block_codegen)


@numba.njit(cache=True, nogil=True, fastmath=FASTMATH_IN_ORDER)
def lanes_rows(xq, xd, tiles, out, t0, t1):
    """out[:, 16 t0 : 16 t1] (columns < m) = every quantized input row times the weight rows of
    tiles [t0, t1), in register blocks of RB rows x SB tiles (a strip of SB tiles over all rows)."""
    n = xq.shape[0]
    for s0 in range(t0, t1, SB):
        count = min(SB, t1 - s0)
        for i0 in range(0, n, RB):
            lanes_block(xq, xd, tiles, out, i0, min(RB, n - i0), s0, count)


@numba.njit(cache=True, nogil=True, fastmath=FASTMATH_IN_ORDER, parallel=True)
def linear_lanes(x, tiles, out, workers):
    """out[n, m] = x @ w.T for Q8_0 weights w repacked to tiles (repack_q8_0): x [n, k] float32
    quantized to int16 (its rows split between the workers), then each worker an equal share of
    the tiles over all rows."""
    n, k = x.shape
    if k != 32 * tiles.shape[1] or out.shape[1] > LANES * tiles.shape[0] or out.shape[0] != n:
        raise ValueError("linear_lanes: x [n, k], tiles [ceil(m/16), k/32, 544] and out [n, m] disagree")
    xq = np.empty((n, k), np.int16)
    xd = np.empty((n, k // 32), np.float32)
    xs = np.empty((n, k // 16), np.float32)
    for wk in prange(workers):
        r0, r1 = wk * n // workers, (wk + 1) * n // workers
        quant.quantize_activations(x[r0:r1], xq[r0:r1], xd[r0:r1], xs[r0:r1])
    t = tiles.shape[0]
    for wk in prange(workers):
        lanes_rows(xq, xd, tiles, out, wk * t // workers, (wk + 1) * t // workers)


def linear_lanes_ref(x, tiles, out, workers):
    """numpy reference of linear_lanes."""
    xq, xd, _ = quant.quantize_activations_ref(x, np.int16)
    lanes_rows_ref(xq, xd, tiles, out, 0, tiles.shape[0])
