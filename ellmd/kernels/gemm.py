"""The prefill GEMM of float weights, in the reduction order of decode's dot products.

Shape legend:
  n   input rows (tokens, or query rows of attention)
  k   depth (input features); kv = k // 32 * 32 of it go in vectors, the rest (k % 32) is the tail
  m   output features (weight rows, or keys)
  W   floats per vector: 16 with AVX-512, else 8; P = W // 8 weight rows share a vector

One arithmetic per token: decode (matmul.linear_rows) sums x[i] . w[j] in eight lanes, lane l
taking the depths d = l (mod 8) of kv in increasing order, one FMA each; the tail in one scalar
FMA chain; then the lanes in a tree (tile.lane_sum) plus the tail. This GEMM computes every output
with exactly those operations, so a token's numbers are the same bits whether its row ran in a
prefill chunk or alone in a decode step. Its register block keeps decode's eight lanes of an
output in one half of a vector (P = 2 outputs per zmm register on AVX-512: twice the lanes of
the f32 outer-product kernel it replaces), RB input rows x SB vectors of weight rows, the
weights packed to float32 once per panel (PANEL rows) in the order the block reads them.

Panel layout (float32, 1-D): block b of COLS weight rows holds, for each group c of 8 depths,
SB vectors of W floats, lane 8p + l of vector s = w[b * COLS + s * P + p, 8c + l]; after the
blocks, the tail: w[r, kv + t] at PANEL * kv + r * (k - kv) + t.
"""

import numba
import numpy as np
from llvmlite import binding, ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ellmd.kernels.formats import decode
from ellmd.kernels.tile import lane_sums4

W = 16 if binding.get_host_cpu_features().get("avx512f") else 8
P = W // 8
# input rows x weight vectors of a register block: RB * SB accumulators, RB broadcast rows of x and
# one weight vector (31 of AVX-512's 32 registers; 16 of AVX2's 16)
RB, SB = (6, 4) if W == 16 else (3, 4)
COLS = SB * P  # weight rows of a block: a multiple of 4 (tile.lane_sums4)
PANEL = 32  # weight rows packed at a time (a multiple of COLS)
LANE_SPAN = 32  # decode's step: depths in vectors are the multiples of it (matmul.STREAM_CHUNK)


@numba.njit(cache=True, nogil=True, fastmath=False, inline="always")
def vector_depth(k):
    """The depths summed in vector lanes (the rest is the scalar tail), as decode sums them."""
    return k // LANE_SPAN * LANE_SPAN


def _block_codegen(context, builder, signature, args):
    x_t, _, p_t, _, _, out_t = signature.args[:6]
    x_a, p_a, out_a = (context.make_array(t)(context, builder, v)
                       for t, v in ((x_t, args[0]), (p_t, args[2]), (out_t, args[5])))
    i0, rows, block, j_out, cols = args[1], args[3], args[4], args[6], args[7]
    intp = context.get_value_type(types.intp)
    f32, i8p, i32 = ir.FloatType(), ir.IntType(8).as_pointer(), ir.IntType(32)
    v8, vw = ir.VectorType(f32, 8), ir.VectorType(f32, W)
    fmaw = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vw, [vw] * 3), f"llvm.fma.v{W}f32")
    fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")

    def c(v):
        return ir.Constant(intp, v)

    k = cgutils.unpack_tuple(builder, x_a.shape)[1]
    kv = builder.mul(builder.udiv(k, c(LANE_SPAN)), c(LANE_SPAN))
    groups = builder.udiv(kv, c(8))
    tail = builder.sub(k, kv)
    out_strides = cgutils.unpack_tuple(builder, out_a.strides)
    last = builder.sub(rows, c(1))
    xrows = []  # rows past `rows` repeat the last one (their results are not stored)
    for r in range(RB):
        i = builder.add(i0, builder.select(builder.icmp_signed("<", c(r), rows), c(r), last))
        xrows.append((i, builder.gep(x_a.data, [builder.mul(i, k)])))
    base = builder.gep(p_a.data, [builder.mul(block, builder.mul(groups, c(SB * W)))])
    accs = [[cgutils.alloca_once_value(builder, ir.Constant(vw, [0.0] * W)) for _ in range(SB)] for _ in range(RB)]
    spread = ir.Constant(ir.VectorType(i32, W), [lane % 8 for lane in range(W)])
    with cgutils.for_range(builder, groups) as loop:
        d = builder.mul(loop.index, c(8))
        xv = []
        for _, xrow in xrows:
            part = builder.load(builder.bitcast(builder.gep(xrow, [d]), v8.as_pointer()), align=4)
            xv.append(part if W == 8 else builder.shuffle_vector(part, ir.Constant(v8, ir.Undefined), spread))
        at = builder.gep(base, [builder.mul(loop.index, c(SB * W))])
        for s in range(SB):
            wv = builder.load(builder.bitcast(builder.gep(at, [c(s * W)]), vw.as_pointer()), align=4)
            for r in range(RB):
                builder.store(builder.call(fmaw, [xv[r], wv, builder.load(accs[r][s])]), accs[r][s])
    f4 = ir.VectorType(f32, 4)
    tail_base = builder.gep(p_a.data, [builder.add(builder.mul(c(PANEL), kv),
                                                   builder.mul(builder.mul(block, c(COLS)), tail))])
    tails = [cgutils.alloca_once(builder, f32) for _ in range(COLS)]
    for r, (i, xrow) in enumerate(xrows):
        with builder.if_then(builder.icmp_signed("<", c(r), rows)):
            eights = []  # the outputs' 8 lanes, column by column
            for s in range(SB):
                acc = builder.load(accs[r][s])
                eights += [acc if W == 8 else builder.shuffle_vector(
                    acc, ir.Constant(vw, ir.Undefined), ir.Constant(ir.VectorType(i32, 8), list(range(8 * p, 8 * p + 8))))
                    for p in range(P)]
            sums = [lane_sums4(builder, eights[c0 : c0 + 4]) for c0 in range(0, COLS, 4)]
            # the tail: one scalar chain per output, as decode's (a row at a time: the other rows'
            # accumulators stay in registers)
            for slot in tails:
                builder.store(ir.Constant(f32, 0.0), slot)
            with cgutils.for_range(builder, tail) as loop:
                t = loop.index
                x = builder.load(builder.gep(xrow, [builder.add(kv, t)]))
                for col in range(COLS):
                    wv = builder.load(builder.gep(tail_base, [builder.add(builder.mul(c(col), tail), t)]))
                    builder.store(builder.call(fma1, [x, wv, builder.load(tails[col])]), tails[col])
            for c0 in range(0, COLS, 4):
                tails4 = ir.Constant(f4, ir.Undefined)
                for lane in range(4):
                    tails4 = builder.insert_element(tails4, builder.load(tails[c0 + lane]), ir.Constant(i32, lane))
                values = builder.fadd(sums[c0 // 4], tails4)
                for lane in range(4):
                    col = c0 + lane
                    with builder.if_then(builder.icmp_signed("<", c(col), cols)):
                        ptr = builder.gep(builder.bitcast(out_a.data, i8p),
                                          [builder.add(builder.mul(i, out_strides[0]),
                                                       builder.mul(builder.add(j_out, c(col)), out_strides[1]))])
                        builder.store(builder.extract_element(values, ir.Constant(i32, lane)), builder.bitcast(ptr, f32.as_pointer()))
    return context.get_dummy_value()


@intrinsic
def dot_block(typingctx, x, i0, panel, rows, block, out, j_out, cols):
    """out[i0 + r, j_out + c] = x[i0 + r] . (row block * COLS + c of the packed panel), for r < rows
    (<= RB) and c < cols (<= COLS), in decode's order. x: [n, k] float32 C-contiguous; panel: 1-D
    float32 packed by pack; out: [n, m'] float32, any strides."""
    if not (isinstance(x, types.Array) and x.ndim == 2 and x.layout == "C" and x.dtype == types.float32):
        return None
    sig = types.void(x, types.intp, panel, types.intp, types.intp, out, types.intp, types.intp)
    return sig, _block_codegen


@numba.njit(cache=True, nogil=True, fastmath=True)
def pack(w, j0, panel):
    """Rows j0..j0+PANEL of w (float storage [m, k]; rows past m as zeros) into panel, float32,
    in dot_block's layout. panel: 1-D float32 of at least PANEL * k."""
    m, k = w.shape
    kv = vector_depth(k)
    tail = k - kv
    for jj in range(PANEL):
        j = j0 + jj
        b, s, p = jj // COLS, jj % COLS // P, jj % P
        dst = panel[b * (kv // 8) * SB * W + s * W + 8 * p :]
        if j < m:
            row = w[j]
            for g in range(kv // 8):
                for lane in range(8):
                    dst[g * SB * W + lane] = decode(row[8 * g + lane])
            for t in range(tail):
                panel[PANEL * kv + jj * tail + t] = decode(row[kv + t])
        else:
            for g in range(kv // 8):
                for lane in range(8):
                    dst[g * SB * W + lane] = np.float32(0.0)
            for t in range(tail):
                panel[PANEL * kv + jj * tail + t] = np.float32(0.0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def panel_product(x, panel, out, j0, m):
    """out[:, j0:min(m, j0 + PANEL)] = x @ (the packed panel of rows j0..).T, decode's order."""
    n = x.shape[0]
    for i0 in range(0, n, RB):
        rows = min(RB, n - i0)
        for b in range(PANEL // COLS):
            jc = j0 + b * COLS
            if jc >= m:
                break
            dot_block(x, i0, panel, rows, b, out, jc, min(COLS, m - jc))


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def product(x, w, out, work):
    """out = x @ w.T in decode's order. x: [n, k] float32 C-contiguous; w: [m, k] float storage
    (float32, uint16 bf16, int16 f16); out: [n, m] float32; work: [workers, >= PANEL * k] float32,
    one panel per worker (panels dealt round-robin: equal shares)."""
    m = w.shape[0]
    workers = work.shape[0]
    panels = (m + PANEL - 1) // PANEL
    for wk in prange(workers):
        panel = work[wk]
        for t in range(wk, panels, workers):
            pack(w, t * PANEL, panel)
            panel_product(x, panel, out, t * PANEL, m)
