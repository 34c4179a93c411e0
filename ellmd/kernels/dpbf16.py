"""The bf16 GEMM block of prefill on vdpbf16ps (AVX512-BF16), for CPUs without AMX (Zen 4/5,
Xeons from Cooper Lake): the AMX block of bf16.py, the same operands and the same c.

Shape legend:
  k       the row stride of the weights in bf16 values (even; rows may be padded past 2 * pairs)
  pairs   pairs of depths of one call, counted from p0 (any number: a step is one pair)
  rows    weight rows of a block, 16 * row_tiles (16 or 32), at j0 in w and at 0 in c
  tokens  the packed tokens (xh, xl: [tokens // 16, pairs * 32] uint16; c: [32, tokens] float32);
          a block takes the 32 from t0

The operands are bf16.py's, unchanged: activations x split into hi = bf16(x) and lo = bf16(x - hi),
packed per group of 16 tokens and pair of depths (bf16.pack_activations: the group's 32-bit pairs
(hi(x[t, 2p]), hi(x[t, 2p + 1])) 64 contiguous bytes, a group's pairs one after another), and the
weights as stored ([rows, k] bf16 bits, the two values of a pair adjacent). So one zmm load of a
group's pair p is the operand of vdpbf16ps with tokens in lanes, and a weight row's pair at p, one
32-bit word, is the other operand broadcast to the 16 lanes: the AMX path's pack serves this one
(its vcvtneps2bf16 is an AVX512-BF16 instruction), and the weights need no packing at load.

A step (one pair) of a register block of 8 weight rows x 2 groups of 16 tokens: 4 loads of the
tokens (2 groups x hi, lo), and per row one broadcast of its pair and 4 vdpbf16ps into its 2
accumulators (c += w . hi, then c += w . lo: x . w = hi . w + lo . w); with split (weights from
GGUF blocks as their halves wh, wl) 2 more, c += wl . hi. 16 accumulators, 4 token registers and
the broadcasts fit the 32 zmm registers; the accumulators stay in registers over all the call's
pairs and reach c once (stored, or added to it when accumulate). As compiled, a step is 4 zmm
loads, 8 vbroadcastss (one a row, shared by its vdpbf16ps) and 32 vdpbf16ps; with split 4, 16
and 48, plus 8 reloads of row addresses from the stack (16 weight rows' addresses outnumber the
general registers; scalar loads beside 48 vdpbf16ps). The 32 rows of c are 4 such blocks, each
one pass over the call's pairs of the 32 tokens (a pass of bf16's GEMM, in L2).

Every lane is one token and runs the same instructions in the same order, so a token's numbers
do not depend on the other tokens of its block, nor on its lane: one arithmetic whatever the
chunking. Products of bf16 values are exact in f32, summed in f32: per pair, the hi product then
the lo (then wl's) into each lane's accumulator (the AMX block sums 16 pairs of hi, then of lo: the
two agree to f32 summation order, not to the bit). Like AMX, vdpbf16ps flushes subnormal inputs
and results to zero.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ellmd.kernels import bf16, cpu  # bf16 imports this module too: its names are read when blocks compile

_LANES = 16  # 32-bit lanes of a zmm register
_F32X16 = ir.VectorType(ir.FloatType(), _LANES)
_I32X16 = ir.VectorType(ir.IntType(32), _LANES)
ROWS = 8  # weight rows of a register block: 8 x GROUPS accumulators + 2 x GROUPS token registers
GROUPS = 2  # groups of 16 tokens (lanes): the 32 tokens of the AMX block


def _broadcast(builder, word):
    """<32 x bfloat> of a 32-bit pair repeated in the 16 lanes: one vbroadcastss from memory (or
    an embedded {1to16} where it has one use)."""
    lanes = builder.insert_element(ir.Constant(_I32X16, None), word, ir.Constant(ir.IntType(32), 0))
    splat = builder.shuffle_vector(lanes, ir.Constant(_I32X16, None), ir.Constant(_I32X16, [0] * _LANES))
    return builder.bitcast(splat, bf16._BF16X32)


def _vector_at(builder, base, index, vector):
    return builder.bitcast(builder.gep(base, [index]), vector.as_pointer())


def _steps(builder, dp, accs, pairs, x_rows, x_at, w_rows, w_at):
    """The loop over the call's pairs: accs[r][g] += each weight row's pair . the tokens of group
    g, for the halves of the tokens (x_rows: hi, lo, or hi alone) and of the weights (w_rows: w, or
    w and wl)."""
    with cgutils.for_range(builder, pairs) as loop:
        p = loop.index
        step = builder.mul(p, ir.Constant(p.type, _LANES))  # a group's pairs: 16 words each
        xs = [[builder.load(_vector_at(builder, half, builder.add(at, step), bf16._BF16X32), align=4) for at in x_at]
              for half in x_rows]  # [half][group]
        for at, row_accs in zip(w_at, accs):
            ws = [_broadcast(builder, builder.load(builder.gep(half, [builder.add(at, p)]))) for half in w_rows]
            for g, slot in enumerate(row_accs):
                acc = builder.load(slot)
                for w, x in (*((ws[0], half[g]) for half in xs), *((wl, xs[0][g]) for wl in ws[1:])):
                    acc = builder.call(dp, [acc, w, x])  # w . hi, w . lo, then wl . hi (lo . lo dropped)
                builder.store(acc, slot)


def make_block(row_tiles, accumulate):
    """An intrinsic for one block on vdpbf16ps, the signature and meaning of bf16._make_amx_block's:

    block(w, wl, split, j0, xh, xl, t0, c, p0, pairs): c[:16 row_tiles, t0:t0 + 32] (+)= w[j0 + rows,
    2 p0:2 (p0 + pairs)] . (xh + xl)[p0:p0 + pairs, tokens t0..t0 + 32] (xh alone where xl has no
    rows), accumulated into c or not;
    when split (a bool), w is the hi half of the weights and wl (same rows, same stride) their lo
    half: c += wl . xh too (else wl is not read). w, wl, xh, xl: uint16, c: float32, all 2-D and
    C-contiguous; pairs >= 0, any number.
    """
    rows = 16 * row_tiles
    assert rows % ROWS == 0

    @intrinsic
    def dpbf16_block(typingctx, w, wl, split, j0, xh, xl, t0, c, p0, pairs):
        u16 = types.uint16
        if not (all(bf16._is_matrix(a, u16) for a in (w, wl, xh, xl)) and bf16._is_matrix(c, types.float32)):
            return None
        sig = types.void(w, wl, types.boolean, types.intp, xh, xl, types.intp, c, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            w_p, (_, k), _ = bf16._data(context, builder, signature.args[0], args[0])
            wl_p, _, _ = bf16._data(context, builder, signature.args[1], args[1])
            xh_p, (_, ld2), _ = bf16._data(context, builder, signature.args[4], args[4])
            xl_p, xl_shape, _ = bf16._data(context, builder, signature.args[5], args[5])
            c_p, (_, ldc), _ = bf16._data(context, builder, signature.args[7], args[7])
            _, _, split, j0, _, _, t0, _, p0, pairs = args
            intp = context.get_value_type(types.intp)
            i32p = ir.IntType(32).as_pointer()
            dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32X16, [
                _F32X16, bf16._BF16X32, bf16._BF16X32]), "llvm.x86.avx512bf16.dpbf16ps.512")  # acc, w pairs, x pairs

            def const(v):
                return ir.Constant(intp, v)

            # pairs as 32-bit words: a weight row is k // 2 words, a group of 16 packed tokens ld2 // 2
            w_words = [builder.bitcast(ptr, i32p) for ptr in (w_p, wl_p)]
            x_words = [builder.bitcast(ptr, i32p) for ptr in (xh_p, xl_p)]
            ldw, run = builder.udiv(k, const(2)), builder.udiv(ld2, const(2))
            accs = [[cgutils.alloca_once(builder, _F32X16) for _ in range(GROUPS)] for _ in range(ROWS)]  # registers
            zero = ir.Constant(_F32X16, [0.0] * _LANES)
            with cgutils.for_range(builder, const(rows // ROWS)) as blocks:
                r0 = builder.mul(blocks.index, const(ROWS))
                c_at = [[_vector_at(builder, c_p, builder.add(builder.mul(builder.add(r0, const(r)), ldc),
                                                              builder.add(t0, const(_LANES * g))), _F32X16)
                         for g in range(GROUPS)] for r in range(ROWS)]
                for at, row_accs in zip(c_at, accs):
                    for c_g, slot in zip(at, row_accs):
                        builder.store(builder.load(c_g, align=4) if accumulate else zero, slot)
                w_at = [builder.add(builder.mul(builder.add(j0, builder.add(r0, const(r))), ldw), p0)
                        for r in range(ROWS)]
                x_at = [builder.add(builder.mul(builder.add(builder.udiv(t0, const(_LANES)), const(g)), run),
                                    builder.mul(p0, const(_LANES))) for g in range(GROUPS)]
                bf16.each_variant(builder, bf16.has_lo(builder, xl_shape), split, lambda halves, with_wl: _steps(
                    builder, dp, accs, pairs, x_words[:halves], x_at, w_words[: 1 + with_wl], w_at))
                for at, row_accs in zip(c_at, accs):
                    for c_g, slot in zip(at, row_accs):
                        builder.store(builder.load(slot), c_g, align=4)
            return context.get_dummy_value()

        return sig, cpu.compiled_for("dpbf16", codegen)

    return dpbf16_block


# the blocks of bf16._rows_product on this path, beside its AMX blocks
block_2, block_2_acc = make_block(2, False), make_block(2, True)
block_1, block_1_acc = make_block(1, False), make_block(1, True)
