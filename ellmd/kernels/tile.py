"""The SIMD micro-kernel of attention tiles and of prefill matmuls, and a tile product on it.

Shape legend:
  rows  rows of the product c and of a (a multiple of MR)
  cols  columns of c and bt (a multiple of NR)
  depth the contracted dimension: columns of a, rows of bt; a may be stored transposed

LLVM does not register-block a numba loop nest (it vectorizes only the innermost loop, so the
accumulators go through memory or need horizontal sums), which caps such a product near half
of peak. A micro-kernel keeps an mr x nr block of c in 8-wide registers across the whole depth
loop, loading one row of bt and broadcasting one value of a per row, as BLAS kernels do; it runs
near the FMA peak of a core. make_micro_kernel builds one per block shape: MR x NR (8
accumulators) for decode's small groups of query rows, TALL_MR x NR for the prefill products
(matmuls and attention). bt may be storage (bf16 as uint16, f16 viewed
as int16, see formats.py): its rows are converted in registers, so a stored tile of values
needs no float32 copy.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

MR = 4  # rows of a block
NR = 16  # columns of a block: two 8-float vectors
_VEC = 8


def _is_matrix(ty, dtypes):
    return isinstance(ty, types.Array) and ty.dtype in dtypes and ty.ndim == 2 and ty.layout == "C"


def storage_to_f32(builder, v, dtype):
    """A vector of storage values (the bits of bt's dtype) -> float32: bf16 bits to the high half
    of an f32, f16 through vcvtph2ps where the CPU has F16C, float32 as it is."""
    count = v.type.count
    if dtype == types.uint16:
        i32s = ir.VectorType(ir.IntType(32), count)
        return builder.bitcast(builder.shl(builder.zext(v, i32s), ir.Constant(i32s, [16] * count)),
                               ir.VectorType(ir.FloatType(), count))
    if dtype == types.int16:
        return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), count)),
                             ir.VectorType(ir.FloatType(), count))
    return v


def fold(builder, v):
    """The sum of a vector's two halves (a vector of half the lanes)."""
    half = v.type.count // 2
    lanes = ir.VectorType(ir.IntType(32), half)
    lo, hi = (builder.shuffle_vector(v, v, ir.Constant(lanes, list(range(a, a + half)))) for a in (0, half))
    return builder.add(lo, hi) if isinstance(v.type.element, ir.IntType) else builder.fadd(lo, hi)


def lane_sum(builder, v):
    """The sum of a vector's lanes, halving it (a tree, not a chain of scalar adds): one order of
    the sums for every kernel that reduces a row this way."""
    while v.type.count > 1:
        v = fold(builder, v)
    return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))


def lane_sums4(builder, vectors):
    """lane_sum of four 8-lane float vectors as one <4 x float>, with the very same adds (lanes
    i + 4, then i + 2, then i + 1) four vectors at a time: 7 vector adds where four lane_sum take 12
    (gemm.py's epilogue, as costly as its products at depth 64: the attention scores of hd 64)."""
    i32 = ir.IntType(32)

    def pick(a, b, lanes):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, len(lanes)), lanes))

    fours = [fold(builder, v) for v in vectors]
    twos = [builder.fadd(pick(a, b, [0, 1, 4, 5]), pick(a, b, [2, 3, 6, 7])) for a, b in (fours[:2], fours[2:])]
    return builder.fadd(pick(*twos, [0, 2, 4, 6]), pick(*twos, [1, 3, 5, 7]))


def _load_vec(builder, ptr, dtype):
    """Load 8 values of bt at ptr as <8 x float>, converting storage formats."""
    if dtype == types.float32:
        return builder.load(builder.bitcast(ptr, ir.VectorType(ir.FloatType(), _VEC).as_pointer()), align=4)
    bits = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(16), _VEC).as_pointer()), align=2)
    return storage_to_f32(builder, bits, dtype)


def make_micro_kernel(mr, nr):
    """The micro-kernel of an mr x nr block of c (nr a multiple of 8): mr * nr / 8 accumulators,
    nr / 8 rows of bt and one broadcast in ymm registers (AVX2 has 16)."""

    @intrinsic
    def kernel(typingctx, a, a_off, a_row, a_depth, bt, b_off, c, c_off, depth, accumulate):
        """c[mr, nr] block (+)= a[mr, depth] @ bt[depth, nr] on C-contiguous matrices.

        Element (i, d) of a (float32) is a.flat[a_off + i * a_row + d * a_depth]; the block of bt
        (float32 or storage) starts at bt.flat[b_off] and that of c (float32) at c.flat[c_off],
        their rows one matrix row apart.
        """
        f32 = (types.float32,)
        if not (_is_matrix(a, f32) and _is_matrix(c, f32)):
            return None
        if not _is_matrix(bt, (types.float32, types.uint16, types.int16)):
            return None
        sig = types.void(
            a, types.intp, types.intp, types.intp, bt, types.intp, c, types.intp, types.intp, types.boolean
        )

        def codegen(context, builder, signature, args):
            a_val, a_off, a_row, a_depth, bt_val, b_off, c_val, c_off, depth, acc_flag = args
            i64 = ir.IntType(64)
            vec = ir.VectorType(ir.FloatType(), _VEC)
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vec, [vec, vec, vec]), "llvm.fma.v8f32"
            )

            def base_and_ld(ty, val, off):
                ary = context.make_array(ty)(context, builder, val)
                return builder.gep(ary.data, [off]), cgutils.unpack_tuple(builder, ary.shape)[1]

            a_ptr, _ = base_and_ld(signature.args[0], a_val, a_off)
            b_ptr, ldb = base_and_ld(signature.args[4], bt_val, b_off)
            c_ptr, ldc = base_and_ld(signature.args[6], c_val, c_off)
            b_dtype = signature.args[4].dtype

            def at(ptr, i):
                return builder.gep(ptr, [ir.Constant(i64, i)])

            nv = nr // _VEC
            # allocas become registers after mem2reg
            accs = [cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * _VEC)) for _ in range(mr * nv)]
            splat = ir.Constant(ir.VectorType(ir.IntType(32), _VEC), [0] * _VEC)
            with cgutils.for_range(builder, depth) as loop:
                d = loop.index
                b_row = builder.gep(b_ptr, [builder.mul(d, ldb)])
                b_vecs = [_load_vec(builder, at(b_row, _VEC * v), b_dtype) for v in range(nv)]
                a_col = builder.gep(a_ptr, [builder.mul(d, a_depth)])
                for i in range(mr):
                    a_elt = builder.load(builder.gep(a_col, [builder.mul(ir.Constant(i64, i), a_row)]))
                    a_vec = builder.insert_element(ir.Constant(vec, ir.Undefined), a_elt, ir.Constant(ir.IntType(32), 0))
                    a_vec = builder.shuffle_vector(a_vec, ir.Constant(vec, ir.Undefined), splat)
                    for v in range(nv):
                        slot = accs[i * nv + v]
                        builder.store(builder.call(fma, [a_vec, b_vecs[v], builder.load(slot)]), slot)
            for i in range(mr):
                c_row = builder.gep(c_ptr, [builder.mul(ir.Constant(i64, i), ldc)])
                for v in range(nv):
                    ptr = builder.bitcast(at(c_row, _VEC * v), vec.as_pointer())
                    total = builder.load(accs[i * nv + v])
                    with builder.if_else(acc_flag) as (then, otherwise):
                        with then:
                            builder.store(builder.fadd(total, builder.load(ptr, align=4)), ptr, align=4)
                        with otherwise:
                            builder.store(total, ptr, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return kernel


micro_kernel = make_micro_kernel(MR, NR)
# The taller block of the prefill products: 12 accumulators + 2 rows of bt + 1 broadcast = 15 of
# AVX2's 16 ymm registers; 4 x 16's 8 accumulators leave the FMA latency exposed there
# (~15% slower prefill matmuls on Qwen3-1.7B shapes, Zen 3).
TALL_MR = 6
tall_kernel = make_micro_kernel(TALL_MR, NR)


@numba.njit(cache=True, nogil=True, fastmath=True)
def gemm_tile(a, transpose_a, bt, c, rows, cols, depth, accumulate, tall):
    """c[:rows, :cols] (+)= A[:rows, :depth] @ bt[:depth, :cols].

    A is a, or a.T when transpose_a (a is then [depth, rows]); a, c: float32, bt: float32 or
    storage (uint16 bf16, int16 f16); all C-contiguous. Blocks of TALL_MR x NR when tall, else
    MR x NR: rows is a multiple of that height and cols of NR (callers pad their scratch);
    accumulate adds to c instead of overwriting it.
    """
    ld = a.shape[1]
    a_row, a_depth = (1, ld) if transpose_a else (ld, 1)
    ldc = c.shape[1]
    for r in range(0, rows, TALL_MR if tall else MR):
        for j in range(0, cols, NR):
            if tall:
                tall_kernel(a, r * a_row, a_row, a_depth, bt, j, c, r * ldc + j, depth, accumulate)
            else:
                micro_kernel(a, r * a_row, a_row, a_depth, bt, j, c, r * ldc + j, depth, accumulate)


def gemm_tile_ref(a, transpose_a, bt, c, rows, cols, depth, accumulate):
    """numpy reference of gemm_tile (bt given as float32)."""
    a = a.T if transpose_a else a
    product = a[:rows, :depth].astype(np.float64) @ bt[:depth, :cols]
    if accumulate:
        product += c[:rows, :cols]
    c[:rows, :cols] = product.astype(np.float32)
