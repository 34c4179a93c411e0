"""The bf16 GEMM of prefill on AMX (tdpbf16ps): weights as stored, f32 accumulation.

Shape legend:
  n       input rows (tokens)
  k       input features, k % CHUNK == 0; pairs = k // 2
  m       output features (weight rows), m % TILE == 0
  tokens  tokens of a packed block of activations (TOKENS)

The weights stay as stored ([m, k] bf16 bits, the two values of a pair of depths adjacent) and
the A tiles are loaded from them in place (a copy of each group of 32 rows into rows padded out of
one L1 set, as at first, cost more than the set conflicts it avoided: without it 1.03-1.8x the
GEMM's rate, Xeon model 167). Each f32 activation x is split into
hi = bf16(x) and lo = bf16(x - hi), so x . w = hi . w + lo . w keeps ~16 bits of x (relative
error ~2**-17, the f32 kernels' figures within the alignment tolerance; bf16(x) alone moved
1,100-token prefill logits by 7e-3 of the largest, past the 1e-3 the suite allows; the opt-in
"bf16-round" path takes it, half the products: hi alone, packed into an xl of no rows). The two
halves of a block of tokens are packed per pair of depths in runs of 16 tokens
(`pack_activations`: for tokens 16 g.., pair p, 64 bytes of (hi(x[i, 2p]), hi(x[i, 2p+1]))
pairs), so a B operand of tdpbf16ps (16 pairs x 16 tokens) is 1 KiB in one piece; a block of
32 weight rows x 32 tokens is four 16 x 16 f32 tiles, fed per 32 depths by two tiles of weights
(16 rows x 32 depths) and two tiles of each half of the tokens. The depth runs in passes (about
1 MiB of packed tokens each, kept in L2) over all of a worker's groups, each group's sums kept
between passes; the sums are c[weight row, token], copied transposed into out after the last
pass. Products of bf16 values are exact in f32 and every sum is an f32 sum.

Weights in GGUF blocks (quant.py) take the same GEMM: each group of 32 weight rows is decoded to
f32 once per pass and split like the activations into hi and lo halves (`split_rows`; rows
padded by ROW_PAD values: 4 KiB apart at k = 2048, they all fell in one L1 set),
and the block adds lo(w) . hi(x) to the two products: w . x to ~2**-16 of each term (the dropped
lo(w) . lo(x) is ~2**-18), where the f32 panels of matmul.py ran at a third of the bf16 speed.

Where decode runs on AMX too (the "bf16" path: decode_tiles), bf16 weights are packed at load as
B tiles and the tokens become the A operand (`gemm_packed`, the last section): the sums land as
c[token, weight row], stored by tiles straight into out, with the same bits as `gemm`. The GEMM
above serves bf16 weights elsewhere (the "bf16-prefill" path alone) and GGUF blocks.

tile_product builds the same kind of block for operands at any offsets, pair_keys and
transpose_words lay operands out for it (attention.py's AMX attention: keys . queries and
probabilities . values).

Without AMX, the "dpbf16" path (cpu.py) takes bf16 weights packed at load in the same layout as
the "bf16" path's (pack) on vdpbf16ps, in prefill and decode alike (dpbf16.py: outputs in lanes).
The activations of both paths are split and packed here (vcvtneps2bf16, an AVX512-BF16 instruction).
"""

import ctypes

import numba
import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ellmd.kernels import aligned, cpu, quant
from ellmd.kernels.formats import BF16, to_f32, to_storage

_LANES = 16  # 32-bit lanes of a zmm register
CHUNK = 32  # depths converted per step by pack_activations (and of an AMX tile)
PATHS = ("bf16", "dpbf16")  # the paths (cpu.py) of this GEMM: AMX tiles, vdpbf16ps; both split with vcvtneps2bf16


class _BFloat(ir.Type):
    """LLVM's bfloat, which llvmlite's IR builder lacks (only its name is printed)."""

    def _to_string(self):
        return "bfloat"

    def __str__(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


_BF16X32 = ir.VectorType(_BFloat(), 2 * _LANES)
_F32X32 = ir.VectorType(ir.FloatType(), 2 * _LANES)
_I32X16 = ir.VectorType(ir.IntType(32), _LANES)


def _is_matrix(ty, dtype):
    return isinstance(ty, types.Array) and ty.dtype == dtype and ty.ndim == 2 and ty.layout == "C"


def _data(context, builder, ty, val):
    ary = context.make_array(ty)(context, builder, val)
    return ary.data, cgutils.unpack_tuple(builder, ary.shape), cgutils.unpack_tuple(builder, ary.strides)


def _transpose16(builder, rows):
    """The 16 x 16 transpose of 16 <16 x i32> rows: four stages, each swapping one bit of the
    row index with the same bit of the column index (64 two-source shuffles)."""
    i32 = ir.IntType(32)
    for bit in (1, 2, 4, 8):
        mask = ir.VectorType(i32, _LANES)
        low = ir.Constant(mask, [c if not c & bit else _LANES + (c & ~bit) for c in range(_LANES)])
        high = ir.Constant(mask, [c | bit if not c & bit else _LANES + c for c in range(_LANES)])
        out = list(rows)
        for r in range(_LANES):
            if not r & bit:
                out[r] = builder.shuffle_vector(rows[r], rows[r | bit], low)
                out[r | bit] = builder.shuffle_vector(rows[r], rows[r | bit], high)
        rows = out
    return rows


def each_variant(builder, lo, split, body):
    """body(halves, split) in a branch of its own for each value of the bools lo (the tokens' lo
    half is there) and split (None: never): a branch inside a loop of tile or vdpbf16ps products
    kept its accumulators from living in registers (LLVM stored and reloaded them every step)."""
    with builder.if_else(lo) as (two, one):
        for branch, halves in ((two, 2), (one, 1)):
            with branch:
                if split is None:
                    body(halves, False)
                    continue
                with builder.if_else(split) as (with_split, without):
                    with with_split:
                        body(halves, True)
                    with without:
                        body(halves, False)


def has_lo(builder, shape):
    """Whether packed tokens of this shape hold a lo half (rows), not activations rounded once (none)."""
    return builder.icmp_signed(">", shape[0], ir.Constant(shape[0].type, 0))


def _halves(builder, vals):
    """(hi, lo) of <32 x float> as <32 x bfloat>: hi = bf16(x), lo = bf16(x - hi), rounded to
    nearest even (vcvtneps2bf16)."""
    hi = builder.fptrunc(vals, _BF16X32)
    return hi, builder.fptrunc(builder.fsub(vals, builder.fpext(hi, _F32X32)), _BF16X32)


@intrinsic
def pack_activations(typingctx, x, i0, nb, nbp, xh, xl):
    """xh, xl as uint32 [tokens // 16, pairs, 16]: the bf16 pairs of hi and lo of x[i0+i, 2p:2p+2],
    i < nbp, each 16 tokens' pairs a run of 64-byte rows (a B tile of AMX: 1 KiB in one piece).

    x: [n, k] float32, k % CHUNK == 0; xh, xl: [tokens // 16, pairs * 32] uint16; nbp % 16 == 0;
    tokens from nb on repeat token nb - 1 (padding that stays finite). hi = bf16(x),
    lo = bf16(x - hi), rounded to nearest even (vcvtneps2bf16); an xl of no rows takes no lo half
    (activations rounded once: rounded()). Per 16 tokens x 16 pairs: 16 row loads, two transposes
    in registers, 32 row stores (16 without lo).
    """
    if not (_is_matrix(x, types.float32) and _is_matrix(xh, types.uint16) and _is_matrix(xl, types.uint16)):
        return None
    sig = types.void(x, types.intp, types.intp, types.intp, xh, xl)

    def codegen(context, builder, signature, args):
        x_p, (_, k), _ = _data(context, builder, signature.args[0], args[0])
        xh_p, (_, ld2), _ = _data(context, builder, signature.args[4], args[4])
        xl_p, xl_shape, _ = _data(context, builder, signature.args[5], args[5])
        i0, nb, nbp = args[1], args[2], args[3]
        intp = context.get_value_type(types.intp)
        with_lo = has_lo(builder, xl_shape)

        def const(v):
            return ir.Constant(intp, v)

        halves = [builder.bitcast(ptr, ir.IntType(32).as_pointer()) for ptr in (xh_p, xl_p)]
        run = builder.udiv(ld2, const(2))  # u32 elements of a group of 16 tokens
        last = builder.sub(nb, const(1))
        with cgutils.for_range(builder, builder.udiv(nbp, const(_LANES))) as groups:
            t0 = builder.mul(groups.index, const(_LANES))
            run0 = builder.mul(groups.index, run)
            starts = []
            for r in range(_LANES):
                t = builder.add(t0, const(r))
                t = builder.select(builder.icmp_signed(">", t, last), last, t)
                starts.append(builder.gep(x_p, [builder.mul(builder.add(i0, t), k)]))
            with cgutils.for_range(builder, builder.udiv(k, const(CHUNK))) as chunks:
                c = builder.mul(chunks.index, const(CHUNK))
                his, los = [], []
                for row in starts:
                    vals = builder.load(builder.bitcast(builder.gep(row, [c]), _F32X32.as_pointer()), align=4)
                    hi, lo = _halves(builder, vals)
                    his.append(builder.bitcast(hi, _I32X16))
                    los.append(builder.bitcast(lo, _I32X16))
                p0 = builder.udiv(c, const(2))

                def store(dst, words):
                    for lane, col in enumerate(_transpose16(builder, words)):
                        at = builder.add(run0, builder.mul(builder.add(p0, const(lane)), const(_LANES)))
                        builder.store(col, builder.bitcast(builder.gep(dst, [at]), _I32X16.as_pointer()), align=4)

                store(halves[0], his)
                with builder.if_then(with_lo):
                    store(halves[1], los)
        return context.get_dummy_value()

    return sig, cpu.compiled_for(PATHS, codegen)


class _Tile(ir.Type):
    """LLVM's x86_amx (an AMX tile register), which llvmlite lacks."""

    def _to_string(self):
        return "x86_amx"

    def __str__(self):
        return "x86_amx"

    def __eq__(self, other):
        return isinstance(other, _Tile)

    def __hash__(self):
        return hash("x86_amx")


_TILE = _Tile()
_TILE_VEC = ir.VectorType(ir.IntType(32), 256)  # a tile's 1 KiB as a value that can live in a phi
TILE = 16  # rows of a tile; also tokens of a tile of B and of C (16 f32 = 64 bytes)
AMX_ROWS = 2 * TILE  # weight rows of an AMX block
AMX_TOKENS = 2 * TILE  # tokens of an AMX block


def _amx_functions(builder):
    i16, i64, ptr = ir.IntType(16), ir.IntType(64), ir.IntType(8).as_pointer()
    mod = builder.module

    def fn(name, ret, params):
        return cgutils.get_or_insert_function(mod, ir.FunctionType(ret, params), name)

    return {
        "load": fn("llvm.x86.tileloadd64.internal", _TILE, [i16, i16, ptr, i64]),
        "store": fn("llvm.x86.tilestored64.internal", ir.VoidType(), [i16, i16, ptr, i64, _TILE]),
        "zero": fn("llvm.x86.tilezero.internal", _TILE, [i16, i16]),
        "dp": fn("llvm.x86.tdpbf16ps.internal", _TILE, [i16, i16, i16, _TILE, _TILE, _TILE]),
        "vec": fn("llvm.x86.cast.tile.to.vector.v256i32", _TILE_VEC, [_TILE]),
        "tile": fn("llvm.x86.cast.vector.to.tile.v256i32", _TILE, [_TILE_VEC]),
    }


def _make_amx_block(row_tiles, accumulate):
    """An intrinsic for one AMX block: row_tiles x 2 tiles of c (+)= w[j0 + 16 a rows] . tokens
    t0 + 16 b (xh + xl, or xh where xl has no rows), over `pairs` pairs of depths from p0
    (pairs % TILE == 0), accumulated or not.
    When split (a bool), w is the hi half of the weights and wl their lo half: c += wl . xh too
    (else wl is not read)."""

    @intrinsic
    def amx_block(typingctx, w, wl, split, j0, xh, xl, t0, c, p0, pairs):
        u16 = types.uint16
        if not (_is_matrix(w, u16) and _is_matrix(wl, u16) and _is_matrix(xh, u16) and _is_matrix(xl, u16)
                and _is_matrix(c, types.float32)):
            return None
        sig = types.void(w, wl, types.boolean, types.intp, xh, xl, types.intp, c, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            w_p, (_, k), _ = _data(context, builder, signature.args[0], args[0])
            wl_p, _, _ = _data(context, builder, signature.args[1], args[1])
            xh_p, (_, ld2), _ = _data(context, builder, signature.args[4], args[4])
            xl_p, xl_shape, _ = _data(context, builder, signature.args[5], args[5])
            c_p, (_, ldc), _ = _data(context, builder, signature.args[7], args[7])
            _, _, split, j0, _, _, t0, _, p0, pairs = args
            f = _amx_functions(builder)
            i8p = ir.IntType(8).as_pointer()
            intp = context.get_value_type(types.intp)

            def const(v):
                return ir.Constant(intp, v)

            rows, width = ir.Constant(ir.IntType(16), TILE), ir.Constant(ir.IntType(16), 4 * TILE)
            w_stride, x_stride, run = builder.mul(k, const(2)), const(4 * TILE), builder.mul(ld2, const(2))
            c_stride = builder.mul(ldc, const(4))
            x_halves = [builder.bitcast(ptr, i8p) for ptr in (xh_p, xl_p)]
            c_bytes = builder.bitcast(c_p, i8p)
            a_base = [builder.add(builder.mul(builder.add(j0, const(TILE * a)), w_stride), builder.mul(p0, const(4)))
                      for a in range(row_tiles)]
            b_base = [builder.add(builder.mul(p0, x_stride), builder.mul(builder.add(builder.udiv(t0, const(TILE)), const(b)), run))
                      for b in range(2)]
            c_at = [[builder.add(builder.mul(const(TILE * a), c_stride), builder.mul(builder.add(t0, const(TILE * b)),
                                                                                    const(4)))
                     for b in range(2)] for a in range(row_tiles)]
            accs = []
            for a in range(row_tiles):
                for b in range(2):
                    if accumulate:
                        start = builder.call(f["load"], [rows, width, builder.gep(c_bytes, [c_at[a][b]]), c_stride])
                    else:
                        start = builder.call(f["zero"], [rows, width])
                    accs.append(cgutils.alloca_once_value(builder, builder.call(f["vec"], [start])))
            def products(s, weights, halves):  # c += weights . each half of the tokens, 16 pairs at s
                step = builder.mul(s, builder.mul(x_stride, const(TILE)))
                w_bytes = builder.bitcast(weights, i8p)
                a_tiles = [builder.call(f["load"], [rows, width, builder.gep(w_bytes, [builder.add(base, builder.mul(
                    s, const(4 * TILE)))]), w_stride]) for base in a_base]
                for half in halves:
                    b_tiles = [builder.call(f["load"], [rows, width, builder.gep(half, [builder.add(b_base[b], step)]),
                                                        x_stride]) for b in range(2)]
                    for b in range(2):
                        for a in range(row_tiles):
                            slot = accs[2 * a + b]
                            acc = builder.call(f["tile"], [builder.load(slot)])
                            acc = builder.call(f["dp"], [rows, width, width, acc, a_tiles[a], b_tiles[b]])
                            builder.store(builder.call(f["vec"], [acc]), slot)

            def steps(halves, with_wl):
                with cgutils.for_range(builder, builder.udiv(pairs, const(TILE))) as loop:
                    products(loop.index, w_p, x_halves[:halves])  # x . w = hi . w (+ lo . w)
                    if with_wl:
                        products(loop.index, wl_p, x_halves[:1])  # + hi . wl, its tiles loaded after w's

            each_variant(builder, has_lo(builder, xl_shape), split, steps)
            for a in range(row_tiles):
                for b in range(2):
                    tile = builder.call(f["tile"], [builder.load(accs[2 * a + b])])
                    builder.call(f["store"], [rows, width, builder.gep(c_bytes, [c_at[a][b]]), c_stride, tile])
            return context.get_dummy_value()

        return sig, cpu.compiled_for("bf16", codegen)

    return amx_block


def tile_product(row_tiles, col_tiles, halves, accumulate):
    """An intrinsic c (+)= a . b over row_tiles x col_tiles AMX tiles of c, for operands at offsets.

    product(a, ar, ac, b, b2, br, bc, c, cr, cc, pairs), all matrices C-contiguous:
      a: [*, *] bf16 bits, rows ar + 16 i, values ac.. (the A operand: values along its rows);
      b, b2: [*, 2 * cols] uint16 packed pairs (row p holds the pairs (x[2p, t], x[2p + 1, t])
        of columns t), rows br.., columns bc + 16 j; with halves == 2, b . a + b2 . a (hi + lo);
      c: [*, *] float32, tile (i, j) at rows cr + 16 i, columns cc + 16 j;
      pairs: the contracted pairs of values, a multiple of 16 (32 values of a per step).
    """

    @intrinsic
    def product(typingctx, a, ar, ac, b, b2, br, bc, c, cr, cc, pairs):
        u16 = types.uint16
        if not (_is_matrix(a, u16) and _is_matrix(b, u16) and _is_matrix(b2, u16) and _is_matrix(c, types.float32)):
            return None
        ip = types.intp
        sig = types.void(a, ip, ip, b, b2, ip, ip, c, ip, ip, ip)

        def codegen(context, builder, signature, args):
            a_p, (_, lda), _ = _data(context, builder, signature.args[0], args[0])
            b_p, (_, ldb), _ = _data(context, builder, signature.args[3], args[3])
            b2_p, _, _ = _data(context, builder, signature.args[4], args[4])
            c_p, (_, ldc), _ = _data(context, builder, signature.args[7], args[7])
            ar, ac, br, bc, cr, cc, pairs = (args[i] for i in (1, 2, 5, 6, 8, 9, 10))
            f = _amx_functions(builder)
            i8p = ir.IntType(8).as_pointer()
            intp = context.get_value_type(types.intp)

            def const(v):
                return ir.Constant(intp, v)

            def offset(row, col, ld, size):  # byte offset of element (row, col)
                return builder.mul(builder.add(builder.mul(row, ld), col), const(size))

            rows, width = ir.Constant(ir.IntType(16), TILE), ir.Constant(ir.IntType(16), 4 * TILE)
            a_stride, b_stride, c_stride = (builder.mul(ld, const(n)) for ld, n in ((lda, 2), (ldb, 2), (ldc, 4)))
            a_bytes = builder.bitcast(a_p, i8p)
            b_halves = [builder.bitcast(ptr, i8p) for ptr in (b_p, b2_p)[:halves]]
            c_bytes = builder.bitcast(c_p, i8p)
            a_at = [offset(builder.add(ar, const(TILE * i)), ac, lda, 2) for i in range(row_tiles)]
            b_at = [offset(br, builder.mul(builder.add(bc, const(TILE * j)), const(2)), ldb, 2)
                    for j in range(col_tiles)]
            c_at = [[offset(builder.add(cr, const(TILE * i)), builder.add(cc, const(TILE * j)), ldc, 4)
                     for j in range(col_tiles)] for i in range(row_tiles)]
            accs = []
            for i in range(row_tiles):
                for j in range(col_tiles):
                    if accumulate:
                        start = builder.call(f["load"], [rows, width, builder.gep(c_bytes, [c_at[i][j]]), c_stride])
                    else:
                        start = builder.call(f["zero"], [rows, width])
                    accs.append(cgutils.alloca_once_value(builder, builder.call(f["vec"], [start])))
            with cgutils.for_range(builder, builder.udiv(pairs, const(TILE))) as loop:
                s = loop.index
                a_step, b_step = builder.mul(s, const(4 * TILE)), builder.mul(s, builder.mul(b_stride, const(TILE)))
                a_tiles = [builder.call(f["load"], [rows, width, builder.gep(a_bytes, [builder.add(at, a_step)]),
                                                    a_stride]) for at in a_at]
                for j in range(col_tiles):
                    for half in b_halves:
                        at = builder.gep(half, [builder.add(b_at[j], b_step)])
                        b_tile = builder.call(f["load"], [rows, width, at, b_stride])
                        for i in range(row_tiles):
                            slot = accs[i * col_tiles + j]
                            acc = builder.call(f["tile"], [builder.load(slot)])
                            acc = builder.call(f["dp"], [rows, width, width, acc, a_tiles[i], b_tile])
                            builder.store(builder.call(f["vec"], [acc]), slot)
            for i in range(row_tiles):
                for j in range(col_tiles):
                    tile = builder.call(f["tile"], [builder.load(accs[i * col_tiles + j])])
                    builder.call(f["store"], [rows, width, builder.gep(c_bytes, [c_at[i][j]]), c_stride, tile])
            return context.get_dummy_value()

        return sig, cpu.compiled_for("bf16", codegen)

    return product


@intrinsic
def pair_keys(typingctx, v, t0, nk, vp):
    """vp[p, 2 d + i] = v[t0 + min(2 p + i, nk - 1), d] for d < hd, p < len(vp): the values of
    keys 2p and 2p + 1 interleaved, the B operand of tile_product (pairs of keys, dimensions as
    its columns), keys past nk repeating the last (finite, and met by zero probabilities).

    v: [*, hd] bf16 bits, hd % 16 == 0; vp: [pairs, >= 2 hd] uint16; both C-contiguous. Per pair
    and 16 dimensions: two loads, one interleave, one store."""
    u16 = types.uint16
    if not (_is_matrix(v, u16) and _is_matrix(vp, u16)):
        return None
    sig = types.void(v, types.intp, types.intp, vp)

    def codegen(context, builder, signature, args):
        v_p, (_, hd), _ = _data(context, builder, signature.args[0], args[0])
        vp_p, (pairs, ld), _ = _data(context, builder, signature.args[3], args[3])
        t0, nk = args[1], args[2]
        intp = context.get_value_type(types.intp)

        def const(x):
            return ir.Constant(intp, x)

        i16x16, i16x32 = ir.VectorType(ir.IntType(16), _LANES), ir.VectorType(ir.IntType(16), 2 * _LANES)
        interleave = ir.Constant(ir.VectorType(ir.IntType(32), 2 * _LANES),
                                 [i // 2 + (_LANES if i % 2 else 0) for i in range(2 * _LANES)])
        last = builder.sub(nk, const(1))
        with cgutils.for_range(builder, pairs) as loop:
            rows = []
            for i in range(2):
                key = builder.add(builder.mul(loop.index, const(2)), const(i))
                key = builder.select(builder.icmp_signed(">", key, last), last, key)
                rows.append(builder.gep(v_p, [builder.mul(builder.add(t0, key), hd)]))
            dst = builder.gep(vp_p, [builder.mul(loop.index, ld)])
            with cgutils.for_range(builder, builder.udiv(hd, const(_LANES))) as dims:
                d0 = builder.mul(dims.index, const(_LANES))
                a, b = (builder.load(builder.bitcast(builder.gep(row, [d0]), i16x16.as_pointer()), align=2)
                        for row in rows)
                at = builder.gep(dst, [builder.mul(d0, const(2))])
                builder.store(builder.shuffle_vector(a, b, interleave), builder.bitcast(at, i16x32.as_pointer()),
                              align=2)
        return context.get_dummy_value()

    return sig, cpu.compiled_for(PATHS, codegen)


@intrinsic
def transpose_words(typingctx, src, dst, i0, j0, rows, cols):
    """dst[i0 + c, j0 + r] = src[r, c] for r < rows, c < cols, 32-bit words (float32 or uint32, one
    dtype both), 16 x 16 at a time through a transpose in registers: the bf16 pairs of exp_pairs
    (keys in rows) as rows of an A operand of tile_product (attention), a group's sums kept weight
    row by token into the output's token rows (gemm).

    src: [>= rows, >= cols rounded up to 16], C-contiguous, rows % 16 == 0; dst: 2-D, its words
    along a row adjacent (any row stride)."""
    if not (isinstance(src, types.Array) and src.dtype in (types.float32, types.uint32) and _is_matrix(src, src.dtype)
            and isinstance(dst, types.Array) and dst.dtype == src.dtype and dst.ndim == 2):
        return None
    sig = types.void(src, dst, types.intp, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        s_p, (_, lds), _ = _data(context, builder, signature.args[0], args[0])
        d_p, _, (row_bytes, _) = _data(context, builder, signature.args[1], args[1])
        i0, j0, rows, cols = args[2:]
        intp = context.get_value_type(types.intp)

        def const(v):
            return ir.Constant(intp, v)

        d_bytes = builder.bitcast(d_p, ir.IntType(8).as_pointer())
        with cgutils.for_range(builder, builder.udiv(builder.add(cols, const(_LANES - 1)), const(_LANES))) as blocks:
            c0 = builder.mul(blocks.index, const(_LANES))
            count = builder.sub(cols, c0)  # columns of this block (more than 16 for all but the last)
            with cgutils.for_range(builder, builder.udiv(rows, const(_LANES))) as bands:
                r0 = builder.mul(bands.index, const(_LANES))
                block = [builder.load(builder.bitcast(builder.gep(s_p, [builder.add(builder.mul(builder.add(r0, const(r)), lds),
                                                                                     c0)]), _I32X16.as_pointer()), align=4)
                         for r in range(_LANES)]
                for i, column in enumerate(_transpose16(builder, block)):
                    with builder.if_then(builder.icmp_signed(">", count, const(i))):
                        row = builder.mul(builder.add(i0, builder.add(c0, const(i))), row_bytes)
                        at = builder.add(row, builder.mul(builder.add(j0, r0), const(4)))
                        builder.store(column, builder.bitcast(builder.gep(d_bytes, [at]), _I32X16.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, cpu.compiled_for(PATHS, codegen)


_F32X16 = ir.VectorType(ir.FloatType(), _LANES)


def _exp16(builder, x):
    """e**x of <16 x float>: exp_f32's Cephes polynomial (activations.py), written as vectors."""
    mod = builder.module
    floor = cgutils.get_or_insert_function(mod, ir.FunctionType(_F32X16, [_F32X16]), "llvm.floor.v16f32")
    fma = cgutils.get_or_insert_function(mod, ir.FunctionType(_F32X16, [_F32X16] * 3), "llvm.fma.v16f32")

    def c(v):
        return ir.Constant(_F32X16, [v] * _LANES)

    low, high = c(-87.33654), c(88.37626)
    xc = builder.select(builder.fcmp_ordered("<", x, low), low, x)
    xc = builder.select(builder.fcmp_ordered(">", xc, high), high, xc)
    k = builder.call(floor, [builder.call(fma, [xc, c(1.4426950408889634), c(0.5)])])
    r = builder.call(fma, [k, c(-0.693359375), xc])
    r = builder.call(fma, [k, c(2.12194440e-4), r])
    p = c(1.9875691500e-4)
    for coef in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = builder.call(fma, [p, r, c(coef)])
    y = builder.fadd(builder.call(fma, [p, builder.fmul(r, r), r]), c(1.0))
    i32x16 = ir.VectorType(ir.IntType(32), _LANES)
    bits = builder.shl(builder.add(builder.fptosi(k, i32x16), ir.Constant(i32x16, [127] * _LANES)),
                       ir.Constant(i32x16, [23] * _LANES))
    e = builder.fmul(y, builder.bitcast(bits, _F32X16))
    return builder.select(builder.fcmp_ordered("<", x, low), c(0.0), e)


def _vec_at(builder, base, index):
    return builder.bitcast(builder.gep(base, [index]), _F32X16.as_pointer())


@intrinsic
def column_max(typingctx, s, m, m0, out, cols):
    """out[c] = max(m[m0 + c], max_j s[j, c]) for c < cols (a multiple of 16).

    s: [rows, *] float32; m, out: 1-D float32, C-contiguous. 16 columns a vector, every row of
    s in one pass down the columns."""
    f32 = types.float32
    if not (_is_matrix(s, f32) and isinstance(m, types.Array) and m.ndim == 1 and m.layout == "C"
            and isinstance(out, types.Array) and out.ndim == 1 and out.layout == "C"):
        return None
    sig = types.void(s, m, types.intp, out, types.intp)

    def codegen(context, builder, signature, args):
        s_p, (rows, ld), _ = _data(context, builder, signature.args[0], args[0])
        m_p = context.make_array(signature.args[1])(context, builder, args[1]).data
        out_p = context.make_array(signature.args[3])(context, builder, args[3]).data
        m0, cols = args[2], args[4]
        intp = context.get_value_type(types.intp)
        with cgutils.for_range(builder, builder.udiv(cols, ir.Constant(intp, _LANES))) as blocks:
            col = builder.mul(blocks.index, ir.Constant(intp, _LANES))
            best = cgutils.alloca_once_value(builder, builder.load(_vec_at(builder, m_p, builder.add(m0, col)), align=4))
            with cgutils.for_range(builder, rows) as loop:
                v = builder.load(_vec_at(builder, s_p, builder.add(builder.mul(loop.index, ld), col)), align=4)
                old = builder.load(best)
                builder.store(builder.select(builder.fcmp_ordered(">", v, old), v, old), best)
            builder.store(builder.load(best), _vec_at(builder, out_p, col), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def exp_pairs(typingctx, s, m, total, p, cols):
    """p[j, c] = the bf16 pair (bf16(e[2j, c]), bf16(e[2j + 1, c])), e = exp(s - m[c]) by column,
    and total[c] = the sum of those bf16 values down column c, for c < cols (a multiple of 16).

    s: [rows, *] float32, rows even; m, total: 1-D float32; p: [rows // 2, *] uint32 (the B operand
    layout of tile_product); all C-contiguous. bf16 rounds to nearest even (vcvtneps2bf16)."""
    f32 = types.float32
    if not (_is_matrix(s, f32) and _is_matrix(p, types.uint32)):
        return None
    for v in (m, total):
        if not (isinstance(v, types.Array) and v.ndim == 1 and v.layout == "C" and v.dtype == f32):
            return None
    sig = types.void(s, m, total, p, types.intp)

    def codegen(context, builder, signature, args):
        s_p, (rows, ld), _ = _data(context, builder, signature.args[0], args[0])
        m_p = context.make_array(signature.args[1])(context, builder, args[1]).data
        t_p = context.make_array(signature.args[2])(context, builder, args[2]).data
        p_p, (_, ldp), _ = _data(context, builder, signature.args[3], args[3])
        cols = args[4]
        intp = context.get_value_type(types.intp)
        bf16x16 = ir.VectorType(_BFloat(), _LANES)
        interleave = ir.Constant(ir.VectorType(ir.IntType(32), 2 * _LANES),
                                 [i // 2 + (_LANES if i % 2 else 0) for i in range(2 * _LANES)])
        two = ir.Constant(intp, 2)
        with cgutils.for_range(builder, builder.udiv(cols, ir.Constant(intp, _LANES))) as blocks:
            col = builder.mul(blocks.index, ir.Constant(intp, _LANES))
            mv = builder.load(_vec_at(builder, m_p, col), align=4)
            acc = cgutils.alloca_once_value(builder, ir.Constant(_F32X16, [0.0] * _LANES))
            with cgutils.for_range(builder, builder.udiv(rows, two)) as loop:
                row0 = builder.mul(loop.index, two)
                halves = []
                for dr in range(2):
                    at = builder.add(builder.mul(builder.add(row0, ir.Constant(intp, dr)), ld), col)
                    e = _exp16(builder, builder.fsub(builder.load(_vec_at(builder, s_p, at), align=4), mv))
                    b = builder.fptrunc(e, bf16x16)
                    builder.store(builder.fadd(builder.load(acc), builder.fpext(b, _F32X16)), acc)
                    halves.append(b)
                pair = builder.shuffle_vector(halves[0], halves[1], interleave)
                dst = builder.gep(p_p, [builder.add(builder.mul(loop.index, ldp), col)])
                builder.store(pair, builder.bitcast(dst, _BF16X32.as_pointer()), align=4)
            builder.store(builder.load(acc), _vec_at(builder, t_p, col), align=4)
        return context.get_dummy_value()

    return sig, cpu.compiled_for("bf16", codegen)


def _across(builder, v, op):
    """<16 x float> folded to one value by op (fadd, max) in a fixed tree: halves, quarters, ..."""
    for width in (8, 4, 2, 1):
        mask = ir.Constant(ir.VectorType(ir.IntType(32), _LANES), [(i + width) % _LANES for i in range(_LANES)])
        v = op(v, builder.shuffle_vector(v, v, mask))
    return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))


@intrinsic
def exp_row(typingctx, s, m, p):
    """p[j] = bf16(exp(s[j] - m)) and the sum of those bf16 values, j < len(s) (a multiple of 16),
    16 at a time, summed as vectors then across lanes in a fixed order; the largest of s first
    (row_max): a softmax row's probabilities as rows of bf16 (dpbf16.py's activations: pairs of
    keys adjacent). s: 1-D float32, p: 1-D uint16 (len(s) values), C-contiguous."""
    if not (isinstance(s, types.Array) and s.ndim == 1 and s.layout == "C" and s.dtype == types.float32
            and isinstance(p, types.Array) and p.ndim == 1 and p.layout == "C" and p.dtype == types.uint16):
        return None
    sig = types.float32(s, types.float32, p)

    def codegen(context, builder, signature, args):
        s_a = context.make_array(signature.args[0])(context, builder, args[0])
        p_p = context.make_array(signature.args[2])(context, builder, args[2]).data
        (n,) = cgutils.unpack_tuple(builder, s_a.shape)
        intp = context.get_value_type(types.intp)
        bf16x16 = ir.VectorType(_BFloat(), _LANES)
        mv = builder.shuffle_vector(builder.insert_element(ir.Constant(_F32X16, None), args[1], ir.Constant(ir.IntType(32), 0)),
                                    ir.Constant(_F32X16, None), ir.Constant(_I32X16, [0] * _LANES))
        acc = cgutils.alloca_once_value(builder, ir.Constant(_F32X16, [0.0] * _LANES))
        with cgutils.for_range(builder, builder.udiv(n, ir.Constant(intp, _LANES))) as loop:
            at = builder.mul(loop.index, ir.Constant(intp, _LANES))
            b = builder.fptrunc(_exp16(builder, builder.fsub(builder.load(_vec_at(builder, s_a.data, at), align=4), mv)),
                                bf16x16)
            builder.store(b, builder.bitcast(builder.gep(p_p, [at]), bf16x16.as_pointer()), align=2)
            builder.store(builder.fadd(builder.load(acc), builder.fpext(b, _F32X16)), acc)
        return _across(builder, builder.load(acc), builder.fadd)

    return sig, cpu.compiled_for(PATHS, codegen)


@intrinsic
def row_max(typingctx, s):
    """The largest of s (1-D float32, C-contiguous, len(s) a multiple of 16), 16 at a time."""
    if not (isinstance(s, types.Array) and s.ndim == 1 and s.layout == "C" and s.dtype == types.float32):
        return None
    sig = types.float32(s)

    def codegen(context, builder, signature, args):
        s_a = context.make_array(signature.args[0])(context, builder, args[0])
        (n,) = cgutils.unpack_tuple(builder, s_a.shape)
        intp = context.get_value_type(types.intp)

        def larger(a, b):
            return builder.select(builder.fcmp_ordered(">", a, b), a, b)

        best = cgutils.alloca_once_value(builder, builder.load(_vec_at(builder, s_a.data, ir.Constant(intp, 0)), align=4))
        with cgutils.for_range(builder, builder.udiv(n, ir.Constant(intp, _LANES))) as loop:
            v = builder.load(_vec_at(builder, s_a.data, builder.mul(loop.index, ir.Constant(intp, _LANES))), align=4)
            builder.store(larger(v, builder.load(best)), best)
        return _across(builder, builder.load(best), larger)

    return sig, codegen


_amx_2 = _make_amx_block(2, False)
_amx_2_acc = _make_amx_block(2, True)
_amx_1 = _make_amx_block(1, False)
_amx_1_acc = _make_amx_block(1, True)


def _request_amx():
    """True when this CPU has AMX-BF16 and Linux lets the process use the tile state.

    Linux hands out the 8 KiB of tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
    XTILEDATA); without it the first tile instruction kills the process with SIGILL.
    """
    features = binding.get_host_cpu_features()
    if not (features.get("amx-bf16") and features.get("amx-tile")):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    except (OSError, AttributeError):
        return False


AMX = _request_amx()  # tests set it False to run the f32 kernels in its place
TOKENS = 256  # tokens per packed block of activations (a multiple of AMX_TOKENS)
PASS_BYTES = 1 << 20  # the packed pairs of both halves a pass over a worker's rows reads (in L2)
# The halves of a group of block weights go to rows of k + ROW_PAD values: at k a multiple of 2048
# the 32 rows of a tile block, 4 KiB apart, all fell in one L1 set and evicted each other
ROW_PAD = 32


@numba.njit(cache=True, nogil=True, fastmath=False)
def groups_of(m, workers):
    """Groups of AMX_ROWS weight rows of one worker (dealt round-robin) at most."""
    return ((m + AMX_ROWS - 1) // AMX_ROWS + workers - 1) // workers


def tiles(paths=None):
    """Whether gemm runs on AMX tiles with these paths on (cpu.ENABLED when None): "bf16" or
    "bf16-prefill", and AMX granted."""
    return AMX and bool({"bf16", "bf16-prefill"} & (cpu.ENABLED if paths is None else paths))


def decode_tiles(paths=None):
    """Whether decode's matmuls of bf16 weights run on AMX tiles as prefill's do (rows_amx): "bf16"."""
    return AMX and "bf16" in (cpu.ENABLED if paths is None else paths)


def rounded(paths=None):
    """Whether these paths round activations once to bf16 ("bf16-round"), not into two halves."""
    return "bf16-round" in (cpu.ENABLED if paths is None else paths)


def vdpbf16ps(paths=None):
    """Whether bf16 weights run on vdpbf16ps (dpbf16.py) in decode and prefill: "dpbf16" on, and not
    AMX's "bf16" (which wins where both are)."""
    return "dpbf16" in (cpu.ENABLED if paths is None else paths) and not decode_tiles(paths)


def usable(m, k):
    """Whether gemm and rows_amx take a [m, k] weight."""
    return k % CHUNK == 0 and m % TILE == 0


@intrinsic
def split_rows(typingctx, w, wh, wl, c0, width):
    """wh, wl[:, c0:c0+width] = the bf16 bits of the halves of w[:, c0:c0+width] (_halves, as
    pack_activations splits x).

    w: [rows, k] float32; wh, wl: [rows, >= k] uint16; all C-contiguous; c0, width % CHUNK == 0.
    """
    if not (_is_matrix(w, types.float32) and _is_matrix(wh, types.uint16) and _is_matrix(wl, types.uint16)):
        return None
    sig = types.void(w, wh, wl, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        w_p, (rows, k), _ = _data(context, builder, signature.args[0], args[0])
        (wh_p, (_, ld), _), (wl_p, _, _) = (_data(context, builder, t, v) for t, v in zip(signature.args[1:3], args[1:3]))
        c0, width = args[3], args[4]
        intp = context.get_value_type(types.intp)
        with cgutils.for_range(builder, rows) as row:
            src, dst = builder.add(builder.mul(row.index, k), c0), builder.add(builder.mul(row.index, ld), c0)
            with cgutils.for_range(builder, builder.udiv(width, ir.Constant(intp, CHUNK))) as chunks:
                at = builder.mul(chunks.index, ir.Constant(intp, CHUNK))
                vals = builder.load(builder.bitcast(builder.gep(w_p, [builder.add(src, at)]), _F32X32.as_pointer()),
                                    align=4)
                for half, value in zip((wh_p, wl_p), _halves(builder, vals)):
                    builder.store(value, builder.bitcast(builder.gep(half, [builder.add(dst, at)]),
                                                         _BF16X32.as_pointer()), align=2)
        return context.get_dummy_value()

    return sig, cpu.compiled_for(PATHS, codegen)


def group_operands(w, j0, p0, pairs, wf, wh, wl):
    """(a, a0, split): the weight rows j0.. (32, fewer at w's end) for the pairs p0 .. p0 + pairs
    as operands of AMX blocks, rows a0.. of a, inside kernels. bf16 weights: w itself at j0, read
    in place (False). Weights in GGUF blocks (whose blocks the columns align with): decoded into
    wf and split into the padded rows of wh, wl, at the same columns (wh at 0, True)."""
    raise NotImplementedError("numba only")


@overload(group_operands, jit_options={"fastmath": True, "nogil": True})
def _group_operands_overload(w, j0, p0, pairs, wf, wh, wl):
    if quant.record_name(w.dtype) is None:
        return lambda w, j0, p0, pairs, wf, wh, wl: (w, j0, False)

    def impl(w, j0, p0, pairs, wf, wh, wl):
        rows = min(wf.shape[0], w.shape[0] - j0)
        per_block = wf.shape[1] // w.shape[1]
        c0, width = 2 * p0, 2 * pairs
        for r in range(rows):
            quant.decode_row(w[j0 + r, c0 // per_block : (c0 + width) // per_block], wf[r, c0 : c0 + width])
        split_rows(wf[:rows], wh[:rows], wl[:rows], c0, width)
        return wh, 0, True

    return impl


@numba.njit(cache=True, nogil=True, fastmath=True)
def _rows_product(w, wl, split, j0, rows, xh, xl, p0, pairs, nbp, cb, accumulate):
    """cb[:rows, :nbp] (+)= w[j0:j0+rows] (+ wl, when split) . the packed tokens, over pairs p0.. of both;
    rows = 32 or 16, by AMX blocks."""
    for t in range(0, nbp, AMX_TOKENS):
        if rows == AMX_ROWS:
            if accumulate:
                _amx_2_acc(w, wl, split, j0, xh, xl, t, cb, p0, pairs)
            else:
                _amx_2(w, wl, split, j0, xh, xl, t, cb, p0, pairs)
        elif accumulate:
            _amx_1_acc(w, wl, split, j0, xh, xl, t, cb, p0, pairs)
        else:
            _amx_1(w, wl, split, j0, xh, xl, t, cb, p0, pairs)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _block_product(w, out, i0, nb, xh, xl, cb, wf, wh, wl, wk, workers):
    """out[i0:i0+nb, this worker's groups of rows] from the packed tokens; cb: [groups, AMX_ROWS,
    TOKENS], the sums of each group. In passes over a range of depths, each over all the worker's
    groups: a pass's packed tokens stay in L2 (PASS_BYTES), a group's rows of it in L1, and the
    weights are read once per block of tokens (a group at a time over all depths streamed the
    tokens from L3 or the weights from memory once per 32 tokens)."""
    m, pairs = w.shape[0], xh.shape[1] // (2 * TILE)
    nbp = (nb + AMX_TOKENS - 1) // AMX_TOKENS * AMX_TOKENS
    groups = (m + AMX_ROWS - 1) // AMX_ROWS
    passes = (pairs * nbp * 8 + PASS_BYTES - 1) // PASS_BYTES
    depth = ((pairs + passes - 1) // passes + TILE - 1) // TILE * TILE
    for p0 in range(0, pairs, depth):
        d = min(depth, pairs - p0)
        for g in range(wk, groups, workers):  # dealt round-robin: equal shares
            j0 = g * AMX_ROWS
            rows = min(AMX_ROWS, m - j0)
            sums = cb[g // workers]
            a, a0, split = group_operands(w, j0, p0, d, wf, wh, wl)
            _rows_product(a, wl, split, a0, rows, xh, xl, p0, d, nbp, sums, p0 > 0)
            if p0 + d == pairs:
                transpose_words(sums, out, i0, j0, rows, nb)


def _worker_floats(m, k, workers):
    """float32 elements of one worker's area in gemm: the sums of its rows for a block of tokens,
    and a group of rows decoded to f32 (block weights) and its two bf16 halves at padded rows."""
    return groups_of(m, workers) * AMX_ROWS * TOKENS + AMX_ROWS * k + AMX_ROWS * (k + ROW_PAD)


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _gemm(x, w, out, shared, work, rounded):
    """gemm over work's workers: each block of tokens packed into `shared` (both halves, or hi
    alone when rounded) by all of them, a share of its groups of 16 tokens each, then multiplied
    by each worker's rows."""
    n, k = x.shape
    workers = work.shape[0]
    half = shared.size // 2
    lo_groups = 0 if rounded else TOKENS // TILE
    xh = shared[:half].view(np.uint16).reshape((TOKENS // TILE, k * TILE))
    xl = shared[half : half + lo_groups * k * TILE // 2].view(np.uint16).reshape((lo_groups, k * TILE))
    groups = groups_of(w.shape[0], workers)
    padded = AMX_ROWS * (k + ROW_PAD) // 2
    for i0 in range(0, n, TOKENS):
        nb = min(TOKENS, n - i0)
        runs = (nb + AMX_TOKENS - 1) // AMX_TOKENS * AMX_TOKENS // TILE  # groups of 16 tokens, padded
        for wk in numba.prange(workers):
            g0, g1 = wk * runs // workers, (wk + 1) * runs // workers
            if g1 > g0:  # tokens from nb on repeat token nb - 1, as one call over the block would
                first = min(g0 * TILE, nb - 1)
                pack_activations(x, i0 + first, min(nb - first, (g1 - g0) * TILE), (g1 - g0) * TILE, xh[g0:g1], xl[g0:g1])
        for wk in numba.prange(workers):
            area = work[wk]
            at = groups * AMX_ROWS * TOKENS
            cb = area[:at].reshape((groups, AMX_ROWS, TOKENS))
            wf = area[at : at + AMX_ROWS * k].reshape((AMX_ROWS, k))
            at += AMX_ROWS * k
            wh = area[at : at + padded].view(np.uint16).reshape((AMX_ROWS, k + ROW_PAD))
            wl = area[at + padded : at + 2 * padded].view(np.uint16).reshape((AMX_ROWS, k + ROW_PAD))
            _block_product(w, out, i0, nb, xh, xl, cb, wf, wh, wl, wk, workers)


def _shared_floats(k):
    """float32 elements of both halves of a block of packed tokens (all workers read them)."""
    return k * TOKENS


def scratch_floats(m, k, workers=None):
    """float32 elements of the scratch gemm needs for a [m, k] weight: a block of packed tokens,
    shared, and a work area per worker (numba's threads when None)."""
    workers = workers or numba.get_num_threads()
    return _shared_floats(k) + workers * _worker_floats(m, k, workers)


def gemm(x, w, out, scratch, paths=None):
    """out = x @ w.T on AMX tiles (tiles(paths)), else on vdpbf16ps, x as the sum of two bf16 halves
    (or rounded once to bf16 where rounded(paths)), products and sums in f32.

    x: [n, k] float32 (C-contiguous); w: [m, k] bf16 bits, or [m, k // 32 or 256] blocks of a GGUF
    type (quant.py; their values split in two halves as well), with usable(m, k); out: [n, m]
    float32, its values along a row adjacent (any row stride); scratch: 1-D float32,
    scratch_floats(m, k) elements (room for fewer threads only lowers the parallelism).
    """
    m, k = w.shape[0], x.shape[1]
    workers = numba.get_num_threads()
    while workers > 1 and scratch_floats(m, k, workers) > scratch.size:
        workers -= 1
    per = _worker_floats(m, k, workers)
    shared = _shared_floats(k)
    _gemm(x, w, out, scratch[:shared], scratch[shared : shared + workers * per].reshape(workers, per), rounded(paths))


def split(x):
    """(hi, lo) of float32 x as float32 arrays of bf16 values: hi = bf16(x), lo = bf16(x - hi)."""
    hi = to_f32(to_storage(x, BF16), BF16)
    return hi, to_f32(to_storage(x - hi, BF16), BF16)


def gemm_ref(x, w, out, scratch, paths=None):
    """numpy reference of gemm: the products of the halves (split; hi alone where rounded(paths))
    in float64; of block weights, (hi + lo) . wh + hi . wl, the halves of their values."""
    hi, lo = split(x)
    if rounded(paths):
        lo = np.zeros_like(lo)
    if quant.is_blocks(w):
        wh, wl = split(quant.dequantize(w))
        product = (hi.astype(np.float64) + lo) @ wh.T.astype(np.float64) + hi.astype(np.float64) @ wl.T
    else:
        product = (hi.astype(np.float64) + lo) @ to_f32(w, BF16).T.astype(np.float64)
    out[:] = product.astype(np.float32)


@intrinsic
def _amx_rows(typingctx, w, j0, xh, xl, g, c, ahead):
    """c[16 rows, 16 tokens] = w[j0:j0+16] . the group g of packed tokens (xh + xl, or xh where xl
    has no rows): every sum the chain of _make_amx_block's (per 16 pairs, the hi product, then the
    lo), the A tiles loaded straight from w. When ahead, the next 16 rows are prefetched to L2 over
    the steps, a linear run of 16 lines a step (their k // 2 lines in k // 32 steps).

    w: [m, k] bf16 bits, m >= j0 + 16; xh, xl: [groups, k * 16] uint16 (pack_activations); c: [16, 16]
    float32; all C-contiguous."""
    u16 = types.uint16
    if not (_is_matrix(w, u16) and _is_matrix(xh, u16) and _is_matrix(xl, u16) and _is_matrix(c, types.float32)):
        return None
    sig = types.void(w, types.intp, xh, xl, types.intp, c, types.boolean)

    def codegen(context, builder, signature, args):
        w_p, (_, k), _ = _data(context, builder, signature.args[0], args[0])
        xh_p, (_, ld2), _ = _data(context, builder, signature.args[2], args[2])
        xl_p, xl_shape, _ = _data(context, builder, signature.args[3], args[3])
        c_p, _, _ = _data(context, builder, signature.args[5], args[5])
        j0, g, ahead = args[1], args[4], args[6]
        f = _amx_functions(builder)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        intp = context.get_value_type(types.intp)
        prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                                  "llvm.prefetch.p0")

        def const(v):
            return ir.Constant(intp, v)

        rows, width = ir.Constant(ir.IntType(16), TILE), ir.Constant(ir.IntType(16), 4 * TILE)
        w_stride, x_stride = builder.mul(k, const(2)), const(4 * TILE)
        w_bytes = builder.gep(builder.bitcast(w_p, i8p), [builder.mul(j0, w_stride)])
        after = builder.gep(w_bytes, [builder.mul(w_stride, const(TILE))])
        b_at = builder.mul(g, builder.mul(ld2, const(2)))
        halves = [builder.gep(builder.bitcast(ptr, i8p), [b_at]) for ptr in (xh_p, xl_p)]
        acc = cgutils.alloca_once_value(builder, builder.call(f["vec"], [builder.call(f["zero"], [rows, width])]))

        def steps(count, _):
            with cgutils.for_range(builder, builder.udiv(k, const(2 * TILE))) as loop:
                s = loop.index
                with builder.if_then(ahead):
                    run = builder.gep(after, [builder.mul(s, const(64 * TILE))])
                    for line in range(TILE):  # locality 2: prefetcht1, to L2
                        builder.call(prefetch, [builder.gep(run, [const(64 * line)]), i32(0), i32(2), i32(1)])
                a_tile = builder.call(f["load"], [rows, width, builder.gep(w_bytes, [builder.mul(s, const(4 * TILE))]),
                                                  w_stride])
                step = builder.mul(s, builder.mul(x_stride, const(TILE)))
                for half in halves[:count]:
                    b_tile = builder.call(f["load"], [rows, width, builder.gep(half, [step]), x_stride])
                    tile = builder.call(f["dp"], [rows, width, width, builder.call(f["tile"], [builder.load(acc)]),
                                                  a_tile, b_tile])
                    builder.store(builder.call(f["vec"], [tile]), acc)

        each_variant(builder, has_lo(builder, xl_shape), None, steps)
        tile = builder.call(f["tile"], [builder.load(acc)])
        builder.call(f["store"], [rows, width, builder.bitcast(c_p, i8p), x_stride, tile])
        return context.get_dummy_value()

    return sig, cpu.compiled_for("bf16", codegen)


def packed_shape(n, k):
    """The shape of each half pack_tokens fills for n tokens of k values."""
    return (n + TILE - 1) // TILE, k * TILE


@numba.njit(cache=True, nogil=True, fastmath=False)
def pack_tokens(x, xh, xl):
    """x's n rows as rows_amx takes them: xh, xl of packed_shape(n, k), uint16."""
    pack_activations(x, 0, x.shape[0], xh.shape[0] * TILE, xh, xl)


# Rows shorter than a 4 KiB page share pages, and the hardware streamer, which follows the 16 rows of
# a tile one page each, loses them: prefetch the next 16 rows then (SmolLM2's k = 576: 17-20 GB/s
# without, 21-25 with; at k = 2,048 the streamer alone is faster, 24-26 against 20-22; 2 threads,
# Xeon model 167)
PREFETCH_BELOW_K = 2048


@numba.njit(cache=True, nogil=True, fastmath=True)
def rows_amx(xh, xl, n, w, out, j0, j1, c):
    """out[:n, j0:j1] = x @ w[j0:j1].T on AMX tiles for few tokens (decode), x packed by pack_tokens;
    usable(*w.shape); c: a [16, 16] float32 work area. A token's sums are gemm's, to the bit: the
    same tiles of w (16 rows from a multiple of 16) and of its halves, summed in the same order,
    whatever tokens are beside it."""
    ahead = w.shape[1] < PREFETCH_BELOW_K
    first, end = j0 // TILE * TILE, (j1 + TILE - 1) // TILE * TILE
    for j in range(first, end, TILE):
        r0, r1 = max(j0 - j, 0), min(j1 - j, TILE)  # rows of this tile inside j0:j1
        for g in range(xh.shape[0]):
            _amx_rows(w, j, xh, xl, g, c, ahead and g == 0 and j + TILE < end)
            for i in range(min(TILE, n - g * TILE)):
                dst = out[g * TILE + i]
                for r in range(r0, r1):
                    dst[j + r] = c[r, i]


# ---- bf16 weights packed at load: tokens as the A operand, weights as B --------------------------
#
# Where decode and prefill both run on AMX ("bf16"), bf16 weight matrices are packed once at load
# (pack) into the B operand's layout, 1 KiB a tile: tile (j, s) holds weight rows 16 j.. by the 16
# pairs of depths from 32 s, row p the pairs (w[16 j + r, 32 s + 2 p], w[16 j + r, 32 s + 2 p + 1])
# of its 16 rows r. The tokens are the A operand, 32 depths of a token a 64-byte row (pack_rows),
# so a block's sums are c[token, weight row], stored by tiles straight into the output's rows: the
# GEMM above keeps c[weight row, token] and turns it through registers into the output, a second
# pass over every output. Each sum is the same chain of products as the GEMM above (the same tiles
# met in the same order: the bits agree), and decode (rows_packed) takes the same tiles. A block
# of 256 tokens is packed once, then each worker takes every other pair of weight tiles over all
# its tokens, in passes over the depths whose tokens stay in L2 (a pass resumes the sums the one
# before stored: f32 either way, the same chain). 1.05-1.45x the GEMM above on the Xeon, 1,000-1,990
# GFLOP/s on 2 cores (docs/engine.md). Without AMX, dpbf16.py takes the same packed weights.

PACKED = np.dtype([("bf16_tiles", np.uint16, (2 * TILE * TILE,))])  # one B tile: 16 pairs x 16 weight rows
PACKED_PASS_BYTES = 1 << 20  # the packed tokens a pass reads: 1,024 depths of 256 tokens' two halves


def packs(w, fmt, paths=None):
    """Whether weight w is packed at load: a bf16 [m, k] matrix with usable(m, k), where decode and
    prefill run on AMX tiles (decode_tiles) or on vdpbf16ps (vdpbf16ps)."""
    return ((decode_tiles(paths) or vdpbf16ps(paths)) and fmt == BF16 and isinstance(w, np.ndarray) and w.dtype == np.uint16 and w.ndim == 2
            and usable(*w.shape))


def pack(w):
    """bf16 bits [m, k] -> PACKED tiles [m // 16, k // 32] (the layout above), on a cache line."""
    m, k = w.shape
    tiles = aligned.empty((m // TILE, k // CHUNK, TILE, TILE, 2), np.uint16)
    tiles[...] = w.reshape(m // TILE, TILE, k // CHUNK, TILE, 2).transpose(0, 2, 3, 1, 4)
    return tiles.reshape(m // TILE, k // CHUNK, 2 * TILE * TILE).view(PACKED)[..., 0]


def unpack(w):
    """PACKED tiles -> the bf16 bits [m, k] they were packed from."""
    mt, steps = w.shape
    tiles = w.view(np.uint16).reshape(mt, steps, TILE, TILE, 2).transpose(0, 3, 1, 2, 4)
    return np.ascontiguousarray(tiles).reshape(mt * TILE, steps * CHUNK)


def is_packed(w) -> bool:
    return isinstance(w, np.ndarray) and w.dtype == PACKED


def packed_type(t) -> bool:
    """True for the numba type of PACKED tiles (typing time)."""
    return (isinstance(t, types.Array) and isinstance(t.dtype, types.Record) and t.dtype.size == PACKED.itemsize
            and "bf16_tiles" in t.dtype.fields)


def _make_pack_rows(tiled):
    """An intrinsic pack(x, i0, nb, nbp, xa, xal): hi(x[i0 + t]) for tokens t < nbp (from nb on, token
    nb - 1 repeated), 32 values (64 bytes) at a time; xal the same of lo when it has rows. tiled:
    as AMX's A tiles, xa[t // 16, 512 s + 32 (t % 16) ..] = hi(x[.., 32 s ..]) (the tile (g, s) 1 KiB
    in one piece; xa: [>= nbp // 16, k * 16]); else as rows, xa[t, :k] (xa: [>= nbp, k]).
    x: [n, k] float32, k % 32 == 0; xa, xal uint16 (xal: or no rows), all C-contiguous."""

    @intrinsic
    def pack(typingctx, x, i0, nb, nbp, xa, xal):
        if not (_is_matrix(x, types.float32) and _is_matrix(xa, types.uint16) and _is_matrix(xal, types.uint16)):
            return None
        sig = types.void(x, types.intp, types.intp, types.intp, xa, xal)

        def codegen(context, builder, signature, args):
            x_p, (_, k), _ = _data(context, builder, signature.args[0], args[0])
            a_p, (_, lda), _ = _data(context, builder, signature.args[4], args[4])
            l_p, l_shape, _ = _data(context, builder, signature.args[5], args[5])
            i0, nb, nbp = args[1], args[2], args[3]
            intp = context.get_value_type(types.intp)
            with_lo = has_lo(builder, l_shape)

            def const(v):
                return ir.Constant(intp, v)

            last = builder.sub(nb, const(1))
            with cgutils.for_range(builder, nbp) as token:
                t = builder.select(builder.icmp_signed(">", token.index, last), last, token.index)
                src = builder.gep(x_p, [builder.mul(builder.add(i0, t), k)])
                if tiled:
                    at = builder.add(builder.mul(builder.udiv(token.index, const(TILE)), lda),
                                     builder.mul(builder.urem(token.index, const(TILE)), const(CHUNK)))
                else:
                    at = builder.mul(token.index, lda)
                with cgutils.for_range(builder, builder.udiv(k, const(CHUNK))) as chunks:
                    vals = builder.load(builder.bitcast(builder.gep(src, [builder.mul(chunks.index, const(CHUNK))]),
                                                        _F32X32.as_pointer()), align=4)
                    hi, lo = _halves(builder, vals)
                    dst = builder.add(at, builder.mul(chunks.index, const(2 * TILE * TILE if tiled else CHUNK)))
                    builder.store(hi, builder.bitcast(builder.gep(a_p, [dst]), _BF16X32.as_pointer()), align=2)
                    with builder.if_then(with_lo):
                        builder.store(lo, builder.bitcast(builder.gep(l_p, [dst]), _BF16X32.as_pointer()), align=2)
            return context.get_dummy_value()

        return sig, cpu.compiled_for(PATHS, codegen)

    return pack


pack_rows = _make_pack_rows(True)  # tokens as AMX's A operand
pack_token_halves = _make_pack_rows(False)  # tokens as rows: dpbf16.py's broadcasts


def _make_packed_block(token_tiles, row_tiles, accumulate):
    """An intrinsic c[r0 + T i + t, c0 + 16 b + row] (+)= token t of block i (A tiles g +
    token_tiles i ..; xa, plus xal where it has rows) . weight tiles j + b, over the `count` steps
    of 32 depths from s0, for the `blocks` blocks i of T = 16 token_tiles tokens, b < row_tiles;
    c any float32 matrix whose rows hold adjacent values. Accumulating, the sums start from c's
    (f32 both in tiles and in c: the chain of products is the one a single pass makes). One call
    takes a weight pair's whole run of tokens: a call per block paid numba's reference counts and
    the tile configuration each time (2x slower in all)."""

    @intrinsic
    def block(typingctx, w, j, xa, xal, g, blocks, c, r0, c0, s0, count):
        if not (packed_type(w) and _is_matrix(xa, types.uint16) and _is_matrix(xal, types.uint16)
                and isinstance(c, types.Array) and c.dtype == types.float32 and c.ndim == 2):
            return None
        ip = types.intp
        sig = types.void(w, ip, xa, xal, ip, ip, c, ip, ip, ip, ip)

        def codegen(context, builder, signature, args):
            w_p, (_, steps), _ = _data(context, builder, signature.args[0], args[0])
            a_p, (_, lda), _ = _data(context, builder, signature.args[2], args[2])
            l_p, l_shape, _ = _data(context, builder, signature.args[3], args[3])
            c_p, _, (c_stride, _) = _data(context, builder, signature.args[6], args[6])
            _, j, _, _, g, blocks, _, r0, c0, s0, count = args
            f = _amx_functions(builder)
            i8p = ir.IntType(8).as_pointer()
            intp = context.get_value_type(types.intp)

            def const(v):
                return ir.Constant(intp, v)

            rows, width, run = ir.Constant(ir.IntType(16), TILE), ir.Constant(ir.IntType(16), 4 * TILE), const(4 * TILE)
            tile_bytes = const(4 * TILE * TILE)
            w_bytes, c_bytes = builder.bitcast(w_p, i8p), builder.bitcast(c_p, i8p)
            x_halves = [builder.bitcast(ptr, i8p) for ptr in (a_p, l_p)]
            b_at = [builder.mul(builder.mul(builder.add(j, const(b)), steps), tile_bytes) for b in range(row_tiles)]
            accs = [cgutils.alloca_once(builder, _TILE_VEC) for _ in range(token_tiles * row_tiles)]

            def token_blocks(halves, _):
                with cgutils.for_range(builder, blocks) as block_loop:
                    first = builder.add(g, builder.mul(block_loop.index, const(token_tiles)))
                    row0 = builder.add(r0, builder.mul(block_loop.index, const(TILE * token_tiles)))
                    a_at = [builder.mul(builder.add(first, const(a)), builder.mul(lda, const(2)))
                            for a in range(token_tiles)]
                    c_at = [[builder.add(builder.mul(builder.add(row0, const(TILE * a)), c_stride),
                                         builder.mul(builder.add(c0, const(TILE * b)), const(4)))
                             for b in range(row_tiles)] for a in range(token_tiles)]
                    for a in range(token_tiles):
                        for b in range(row_tiles):
                            start = (builder.call(f["load"], [rows, width, builder.gep(c_bytes, [c_at[a][b]]), c_stride])
                                     if accumulate else builder.call(f["zero"], [rows, width]))
                            builder.store(builder.call(f["vec"], [start]), accs[a * row_tiles + b])
                    with cgutils.for_range(builder, count) as loop:
                        step = builder.mul(builder.add(s0, loop.index), tile_bytes)
                        b_tiles = [builder.call(f["load"], [rows, width, builder.gep(w_bytes, [builder.add(at, step)]), run])
                                   for at in b_at]
                        for half in x_halves[:halves]:  # per step the hi products, then the lo: the GEMM's chain
                            for a in range(token_tiles):
                                a_tile = builder.call(f["load"], [rows, width,
                                                                  builder.gep(half, [builder.add(a_at[a], step)]), run])
                                for b in range(row_tiles):
                                    slot = accs[a * row_tiles + b]
                                    acc = builder.call(f["tile"], [builder.load(slot)])
                                    acc = builder.call(f["dp"], [rows, width, width, acc, a_tile, b_tiles[b]])
                                    builder.store(builder.call(f["vec"], [acc]), slot)
                    for a in range(token_tiles):
                        for b in range(row_tiles):
                            tile = builder.call(f["tile"], [builder.load(accs[a * row_tiles + b])])
                            builder.call(f["store"], [rows, width, builder.gep(c_bytes, [c_at[a][b]]), c_stride, tile])

            each_variant(builder, has_lo(builder, l_shape), None, token_blocks)
            return context.get_dummy_value()

        return sig, cpu.compiled_for("bf16", codegen)

    return block


_packed_2x2, _packed_2x1 = _make_packed_block(2, 2, False), _make_packed_block(2, 1, False)
_onto_2x2, _onto_2x1 = _make_packed_block(2, 2, True), _make_packed_block(2, 1, True)
_packed_1x1 = _make_packed_block(1, 1, False)


def packed_scratch_floats(k, workers=None):
    """float32 elements of gemm_packed's scratch: a block of packed tokens, a 32 x 32 block a worker."""
    return TOKENS * k + (workers or numba.get_num_threads()) * AMX_TOKENS * AMX_ROWS


@numba.njit(cache=True, nogil=True, fastmath=True)
def _pair_block(w, j, xa, xal, g, blocks, c, r0, c0, s0, count):
    """The block of weight tiles j (and j + 1 where w has it) and `blocks` pairs of A tiles from g,
    over steps s0 .. s0 + count, onto c's sums where s0 > 0."""
    if j + 1 < w.shape[0]:
        if s0:
            _onto_2x2(w, j, xa, xal, g, blocks, c, r0, c0, s0, count)
        else:
            _packed_2x2(w, j, xa, xal, g, blocks, c, r0, c0, s0, count)
    elif s0:
        _onto_2x1(w, j, xa, xal, g, blocks, c, r0, c0, s0, count)
    else:
        _packed_2x1(w, j, xa, xal, g, blocks, c, r0, c0, s0, count)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _packed_pair(w, j, xa, xal, out, r0, c0, nb, edge, s0, count):
    """out[r0 .. r0 + nb, c0 .. c0 + 16 tiles] (+)= the nb tokens of xa, xal (from A tile 0) .
    weight tiles j (and j + 1 where w has it) over steps s0 .. s0 + count; the tokens past a
    multiple of 32 through edge ([32, 32])."""
    whole = nb // AMX_TOKENS
    if whole:
        _pair_block(w, j, xa, xal, 0, whole, out, r0, c0, s0, count)
    rest = nb - whole * AMX_TOKENS
    if rest == 0:
        return
    cols = TILE * min(2, w.shape[0] - j)
    first = r0 + whole * AMX_TOKENS
    if s0:
        edge[:rest, :cols] = out[first : first + rest, c0 : c0 + cols]
    _pair_block(w, j, xa, xal, whole * AMX_TOKENS // TILE, 1, edge, 0, 0, s0, count)
    out[first : first + rest, c0 : c0 + cols] = edge[:rest, :cols]


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _gemm_packed(x, w, out, scratch, workers, rounded):
    n, k = x.shape
    groups = TOKENS // TILE
    halves = scratch[: TOKENS * k].view(np.uint16)
    xa = halves[: groups * k * TILE].reshape((groups, k * TILE))
    lo = 0 if rounded else groups
    xal = halves[groups * k * TILE : (groups + lo) * k * TILE].reshape((lo, k * TILE))
    edges = scratch[TOKENS * k : TOKENS * k + workers * AMX_TOKENS * AMX_ROWS].reshape((workers, AMX_TOKENS, AMX_ROWS))
    pairs = (w.shape[0] + 1) // 2  # of weight tiles
    steps = w.shape[1]
    depth = PACKED_PASS_BYTES // (TOKENS * 2 * CHUNK * (1 if rounded else 2))  # steps of a pass
    for i0 in range(0, n, TOKENS):
        nb = min(TOKENS, n - i0)
        runs = (nb + AMX_TOKENS - 1) // AMX_TOKENS * AMX_TOKENS // TILE  # groups of 16 tokens, padded
        for wk in numba.prange(workers):
            g0, g1 = wk * runs // workers, (wk + 1) * runs // workers
            if g1 > g0:  # tokens from nb on repeat token nb - 1, as one call over the block would
                first = min(g0 * TILE, nb - 1)
                pack_rows(x, i0 + first, min(nb - first, (g1 - g0) * TILE), (g1 - g0) * TILE, xa[g0:g1],
                          xal[g0:g1])
        for wk in numba.prange(workers):
            for s0 in range(0, steps, depth):  # a pass's tokens stay in L2
                for p in range(wk, pairs, workers):  # dealt round-robin: equal shares
                    _packed_pair(w, 2 * p, xa, xal, out, i0, 2 * p * TILE, nb, edges[wk], s0, min(depth, steps - s0))


def gemm_packed(x, w, out, scratch, paths=None):
    """out = x @ w.T for PACKED weights on AMX tiles, x as two bf16 halves (or rounded once where
    rounded(paths)); the same bits as gemm on the weights unpacked.

    x: [n, k] float32 (C-contiguous); w: PACKED [m // 16, k // 32]; out: [n, m] float32, its values
    along a row adjacent (any row stride); scratch: 1-D float32, packed_scratch_floats(k) elements
    (room for fewer threads only lowers the parallelism)."""
    k = x.shape[1]
    workers = numba.get_num_threads()
    while workers > 1 and packed_scratch_floats(k, workers) > scratch.size:
        workers -= 1
    _gemm_packed(x, w, out, scratch, workers, rounded(paths))


def gemm_packed_ref(x, w, out, paths=None):
    """numpy reference of gemm_packed: gemm_ref on the weights unpacked."""
    gemm_ref(x, unpack(w), out, None, paths)


@numba.njit(cache=True, nogil=True, fastmath=False)
def pack_token_rows(x, xa, xal):
    """x's n rows as rows_packed takes them: xa, xal of packed_shape(n, k) (xal: or no rows), uint16."""
    pack_rows(x, 0, x.shape[0], xa.shape[0] * TILE, xa, xal)


@numba.njit(cache=True, nogil=True, fastmath=True)
def rows_packed(xa, xal, n, w, out, j0, j1, c):
    """out[:n, j0:j1] = x @ w.T for PACKED w on AMX tiles for few tokens (decode), x packed by
    pack_token_rows; c: a [16, 16] float32 work area. A token's sums are gemm_packed's, to the bit:
    the same tiles of w and of its halves, summed in the same order, whatever tokens are beside it."""
    for j in range(j0 // TILE, (j1 + TILE - 1) // TILE):
        r0, r1 = max(j0 - j * TILE, 0), min(j1 - j * TILE, TILE)  # rows of this tile inside j0:j1
        for g in range(xa.shape[0]):
            _packed_1x1(w, j, xa, xal, g, 1, c, 0, 0, 0, w.shape[1])
            for i in range(min(TILE, n - g * TILE)):
                out[g * TILE + i, j * TILE + r0 : j * TILE + r1] = c[i, r0:r1]
