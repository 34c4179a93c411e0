"""bf16 weights on vdpbf16ps (AVX512-BF16), in prefill and decode alike, for CPUs without AMX (Zen 4/5,
Xeons from Cooper Lake): outputs in lanes, over the weights bf16.pack lays out at load.

Shape legend:
  n       tokens; nbp: n padded to the register block's tokens (rows of the packed halves)
  k       input features; pairs = k // 2
  tiles   weight tiles of 16 rows (w: bf16.PACKED [tiles, k // 32]); m = 16 tiles outputs

The weights are AMX's B tiles (bf16.pack): row p of tile (j, s) is the pair of depths 16 s + p of
weight rows 16 j .. 16 j + 15, 64 bytes, so one zmm load is a pair of 16 weight rows, one row a
lane, and a row tile's whole depth is one contiguous stream. The activations are rows of bf16
values (bf16.pack_token_halves: hi = bf16(x), and lo = bf16(x - hi) unless rounded once), and a
token's pair of depths, one 32-bit word, is the other operand broadcast to the 16 lanes. So
acc[token, 16 rows] += w pair . x pair per vdpbf16ps, per pair the hi product then the lo one.

Register blocks: 4 row tiles x 6 tokens (24 accumulators, 4 weight registers, the broadcasts) for
prefill and for decode steps of several tokens; 4 row tiles x 2, 3 or 4 tokens for that many
(attention's query rows of a decode step); 8 row tiles x 1 token for a decode step of one (8
weight streams from memory, a chain each). Every lane is one (token, weight row) and runs the
same chain of vdpbf16ps whatever the block, the tokens beside it, its lane or the depth passes (c
keeps the f32 sums between passes): a token's numbers are the same to the bit in a prefill chunk
of any size and alone in a decode step. Products of bf16 values are exact in f32; vdpbf16ps
flushes subnormal inputs and results to zero, as AMX does.

Activations as two halves keep ~16 bits of each (the alignment tolerances), two vdpbf16ps per
pair: on Zen 5 (two vdpbf16ps or two f32 FMA a cycle) their peak is f32 FMA's. Rounded once
("bf16-round": transformers' and llama.cpp's precision) the products halve.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ellmd.kernels import bf16, cpu
from ellmd.kernels.activations import PARALLEL_MIN

_LANES = 16  # 32-bit lanes of a zmm register
_F32X16 = ir.VectorType(ir.FloatType(), _LANES)
ROW_TILES = 4  # row tiles of the prefill block: 4 x BLOCK_TOKENS accumulators
BLOCK_TOKENS = 6  # tokens of the prefill block
DECODE_ROW_TILES = 8  # row tiles of the one-token block: weight streams side by side
TOKENS = 42 * BLOCK_TOKENS  # tokens of a chunk of prefill packed at once (252)
PASS_BYTES = 1 << 20  # packed tokens a pass over the depths reads, kept in L2 while its rows run (Zen 5: 512 KiB no faster)


def _broadcast(builder, word):
    """<32 x bfloat> of a 32-bit pair repeated in the 16 lanes (vpbroadcastd from memory)."""
    i32x16 = ir.VectorType(ir.IntType(32), _LANES)
    lanes = builder.insert_element(ir.Constant(i32x16, None), word, ir.Constant(ir.IntType(32), 0))
    splat = builder.shuffle_vector(lanes, ir.Constant(i32x16, None), ir.Constant(i32x16, [0] * _LANES))
    return builder.bitcast(splat, bf16._BF16X32)


def make_block(row_tiles, tokens):
    """An intrinsic block(w, j, xh, xl, nb, out, r0, q0, count, onto): out[r0 + t, 16 (j + b) + r] (+)=
    the pairs q0 .. q0 + count of weight row r of tile j + b . those of token t (xh + xl, xh alone
    where xl has no rows), for t < nb, b < row_tiles; added to out's sums where onto (a later pass
    over the depths), else stored. The tokens run in blocks of `tokens` (xh, xl hold nb rounded up
    to them; rows past nb are computed, not stored). w: bf16.PACKED, or pairs as uint16 [pairs,
    2 width] (row p the pairs (x[2p, c], x[2p + 1, c]) of its width columns, tile j the columns
    16 j..: tile_product's B operand, as attention lays out keys and values); xh, xl: [>= nbp, k]
    uint16, C-contiguous; out: float32 [.., >= 16 (j + row_tiles)], its values along a row adjacent."""

    @intrinsic
    def block(typingctx, w, j, xh, xl, nb, out, r0, q0, count, onto):
        u16 = types.uint16
        if not ((bf16.packed_type(w) or bf16._is_matrix(w, u16)) and bf16._is_matrix(xh, u16)
                and bf16._is_matrix(xl, u16) and isinstance(out, types.Array) and out.dtype == types.float32
                and out.ndim == 2):
            return None
        ip = types.intp
        sig = types.void(w, ip, xh, xl, ip, out, ip, ip, ip, types.boolean)
        packed = bf16.packed_type(w)

        def codegen(context, builder, signature, args):
            w_p, (_, w_cols), _ = bf16._data(context, builder, signature.args[0], args[0])
            h_p, (_, k), _ = bf16._data(context, builder, signature.args[2], args[2])
            l_p, l_shape, _ = bf16._data(context, builder, signature.args[3], args[3])
            o_p, _, (o_stride, _) = bf16._data(context, builder, signature.args[5], args[5])
            _, j, _, _, nb, _, r0, q0, count, onto = args
            intp = context.get_value_type(types.intp)
            dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32X16, [
                _F32X16, bf16._BF16X32, bf16._BF16X32]), "llvm.x86.avx512bf16.dpbf16ps.512")  # acc, w pairs, x pairs

            def const(v):
                return ir.Constant(intp, v)

            lines = builder.bitcast(w_p, bf16._BF16X32.as_pointer())  # a line: one pair of a tile's 16 rows
            # lines from a tile to the next, and from a pair to the next: PACKED's 1 KiB steps (w_cols of
            # them a tile), or a pairs matrix's rows of w_cols uint16 (a tile the next 64 bytes)
            tile_lines, pair_lines = ((builder.mul(w_cols, const(_LANES)), const(1)) if packed
                                      else (const(1), builder.udiv(w_cols, const(2 * _LANES))))
            x_words = [builder.bitcast(p, ir.IntType(32).as_pointer()) for p in (h_p, l_p)]
            ldx = builder.udiv(k, const(2))  # words of a token's row
            out_bytes = builder.bitcast(o_p, ir.IntType(8).as_pointer())
            accs = [[cgutils.alloca_once(builder, _F32X16) for _ in range(tokens)] for _ in range(row_tiles)]
            zero = ir.Constant(_F32X16, [0.0] * _LANES)
            w_at = [builder.add(builder.mul(builder.add(j, const(b)), tile_lines), builder.mul(q0, pair_lines))
                    for b in range(row_tiles)]
            blocks = builder.udiv(builder.add(nb, const(tokens - 1)), const(tokens))
            with cgutils.for_range(builder, blocks) as block_loop:
                t0 = builder.mul(block_loop.index, const(tokens))
                stored = [builder.icmp_signed("<", builder.add(t0, const(t)), nb) for t in range(tokens)]
                at = [[builder.bitcast(builder.gep(out_bytes, [builder.add(
                    builder.mul(builder.add(r0, builder.add(t0, const(t))), o_stride),
                    builder.mul(builder.add(j, const(b)), const(4 * _LANES)))]), _F32X16.as_pointer())
                    for t in range(tokens)] for b in range(row_tiles)]
                for t in range(tokens):
                    with builder.if_else(builder.and_(onto, stored[t])) as (resume, start):
                        with resume:
                            for b in range(row_tiles):
                                builder.store(builder.load(at[b][t], align=4), accs[b][t])
                        with start:
                            for b in range(row_tiles):
                                builder.store(zero, accs[b][t])
                x_at = [builder.add(builder.mul(builder.add(t0, const(t)), ldx), q0) for t in range(tokens)]

                def steps_loop(halves, _):
                    with cgutils.for_range(builder, count) as loop:
                        q = loop.index
                        step = builder.mul(q, pair_lines)
                        ws = [builder.load(builder.gep(lines, [builder.add(a, step)]), align=4) for a in w_at]
                        for t in range(tokens):
                            xs = [_broadcast(builder, builder.load(builder.gep(words, [builder.add(x_at[t], q)])))
                                  for words in x_words[:halves]]
                            for b in range(row_tiles):
                                acc = builder.load(accs[b][t])
                                for x in xs:  # the hi product, then the lo
                                    acc = builder.call(dp, [acc, ws[b], x])
                                builder.store(acc, accs[b][t])

                bf16.each_variant(builder, bf16.has_lo(builder, l_shape), None, steps_loop)
                for t in range(tokens):
                    with builder.if_then(stored[t]):
                        for b in range(row_tiles):
                            builder.store(builder.load(accs[b][t]), at[b][t], align=4)
            return context.get_dummy_value()

        return sig, cpu.compiled_for("dpbf16", codegen)

    return block


def _row_tiles(wide, wide_tiles, narrow):
    """A product over row tiles j0 .. j1 in blocks of `wide` (wide_tiles row tiles), the rest in
    `narrow` (one): blocks of the same tokens, so the same chain in every lane."""

    @numba.njit(nogil=True, fastmath=True)
    def run(w, xh, xl, nb, out, r0, j0, j1, q0, count, onto):
        j = j0
        while j + wide_tiles <= j1:
            wide(w, j, xh, xl, nb, out, r0, q0, count, onto)
            j += wide_tiles
        for j in range(j, j1):
            narrow(w, j, xh, xl, nb, out, r0, q0, count, onto)

    return run


_one_token = _row_tiles(make_block(DECODE_ROW_TILES, 1), DECODE_ROW_TILES, make_block(1, 1))
# a few tokens (attention's g query rows of a decode step, a small batch) in blocks of exactly
# that many: padded to BLOCK_TOKENS, a decode step's 2 rows would compute 6
_two_tokens = _row_tiles(make_block(ROW_TILES, 2), ROW_TILES, make_block(1, 2))
_three_tokens = _row_tiles(make_block(ROW_TILES, 3), ROW_TILES, make_block(1, 3))
_four_tokens = _row_tiles(make_block(ROW_TILES, 4), ROW_TILES, make_block(1, 4))
_block_tokens = _row_tiles(make_block(ROW_TILES, BLOCK_TOKENS), ROW_TILES, make_block(1, BLOCK_TOKENS))


@numba.njit(cache=True, nogil=True, fastmath=False)
def token_rows(n):
    """Rows of the packed halves for n tokens: n rounded up to the register block's tokens."""
    return n if n == 1 else -(-n // BLOCK_TOKENS) * BLOCK_TOKENS


@numba.njit(cache=True, nogil=True, fastmath=True)
def product(w, xh, xl, nb, out, r0, j0, j1, q0, count, onto):
    """out[r0 .. r0 + nb, 16 j0 .. 16 j1] (+)= the nb tokens of xh, xl . weight tiles j0 .. j1, over
    pairs q0 .. q0 + count (onto out's sums where onto); operands as make_block's."""
    if nb == 1:
        _one_token(w, xh, xl, nb, out, r0, j0, j1, q0, count, onto)
    elif nb == 2:
        _two_tokens(w, xh, xl, nb, out, r0, j0, j1, q0, count, onto)
    elif nb == 3:
        _three_tokens(w, xh, xl, nb, out, r0, j0, j1, q0, count, onto)
    elif nb == 4:
        _four_tokens(w, xh, xl, nb, out, r0, j0, j1, q0, count, onto)
    else:
        _block_tokens(w, xh, xl, nb, out, r0, j0, j1, q0, count, onto)


def scratch_floats(k):
    """float32 elements of gemm's scratch: both halves of a chunk of TOKENS tokens."""
    return TOKENS * k


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _gemm(x, w, out, scratch, workers, rounded):
    n, k = x.shape
    halves = scratch[: TOKENS * k].view(np.uint16)
    xh = halves[: TOKENS * k].reshape((TOKENS, k))
    xl = halves[TOKENS * k :].reshape((TOKENS, k))[: 0 if rounded else TOKENS]
    tiles, pairs = w.shape[0], k // 2
    for i0 in range(0, n, TOKENS):
        nb = min(TOKENS, n - i0)
        nbp = token_rows(nb)
        for wk in prange(workers):
            t0, t1 = wk * nbp // workers, (wk + 1) * nbp // workers
            if t1 > t0:  # tokens from nb on repeat token nb - 1, as one call over the chunk would
                first = min(t0, nb - 1)
                bf16.pack_token_halves(x, i0 + first, min(nb - first, t1 - t0), t1 - t0, xh[t0:t1], xl[t0:t1])
        depth = max(_LANES, PASS_BYTES // (nbp * 4 * (2 if xl.shape[0] else 1)))  # pairs of a pass
        for wk in prange(workers):  # each a run of row tiles, in passes whose tokens stay in L2
            j0, j1 = wk * tiles // workers, (wk + 1) * tiles // workers
            for q0 in range(0, pairs, depth):
                product(w, xh, xl, nb, out, i0, j0, j1, q0, min(depth, pairs - q0), q0 > 0)


def gemm(x, w, out, scratch, rounded):
    """out = x @ w.T for bf16.PACKED w on vdpbf16ps (prefill), x as two bf16 halves or rounded once.

    x: [n, k] float32 (C-contiguous); out: [n, m] float32, its values along a row adjacent (any row
    stride); scratch: 1-D float32 of scratch_floats(k) elements."""
    _gemm(x, w, out, scratch, numba.get_num_threads(), rounded)


@numba.njit(cache=True, nogil=True, fastmath=True)
def rows(xh, xl, n, w, out, j0, j1):
    """out[:n, j0:j1] = x @ w.T for few tokens (decode), x packed by pack_tokens; j0 and j1 on tiles
    (multiples of 16, or j1 = m). A token's sums are gemm's, to the bit."""
    product(w, xh, xl, n, out, 0, j0 // bf16.TILE, (j1 + bf16.TILE - 1) // bf16.TILE, 0, xh.shape[1] // 2, False)


@numba.njit(cache=True, nogil=True, fastmath=False)
def pack_tokens(x, xh, xl):
    """x's n rows as rows takes them: xh, xl [token_rows(n), k] uint16 (xl: or no rows)."""
    bf16.pack_token_halves(x, 0, x.shape[0], xh.shape[0], xh, xl)


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def linear(x, w, out, workers, rounded):
    """out = x @ w.T for few tokens (decode) and PACKED w: x packed once, then each worker an equal
    run of row tiles."""
    n, k = x.shape
    xh = np.empty((token_rows(n), k), np.uint16)
    xl = np.empty((0 if rounded else xh.shape[0], k), np.uint16)
    pack_tokens(x, xh, xl)
    tiles = w.shape[0]
    if n * tiles * bf16.TILE * k < 8 * PARALLEL_MIN:
        product(w, xh, xl, n, out, 0, 0, tiles, 0, k // 2, False)
        return
    for wk in prange(workers):
        product(w, xh, xl, n, out, 0, wk * tiles // workers, (wk + 1) * tiles // workers, 0, k // 2, False)
