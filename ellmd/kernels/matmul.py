"""Linear layers (x @ w.T) with weights in storage precision, and the embedding gather.

Shape legend:
  n   input rows (tokens; the decode batch is 1..16)
  k   input features (w's columns)
  m   output features (w's rows)
  V   vocabulary size, d embedding width

Decode (small n) is memory-bound: `linear` streams each weight row once for all n inputs,
converting bf16/f16 in registers, two rows x four inputs per pass so that the vector FMAs are
not starved by loads; inputs left over from the fours (all of them at n = 1) go four weight
rows side by side, with software prefetches a few passes ahead. Both passes sum a row in one
order, so an input row's result does not depend on the rows beside it (a session decodes the
same alone or in a batch). Prefill (large n) is compute-bound: float weights go to the GEMM of
gemm.py, which sums every output in exactly decode's order; weights in GGUF blocks on an integer
path (cpu.py) take the integer kernel in prefill as in decode, a GEMM over tiles of rows. Either
way a token's numbers are the same to the bit whatever the chunk it comes in, or alone in a
decode step. On the "bf16" path (cpu.py), where the CPU has AMX, bf16 weights go to the AMX
GEMM of bf16.py instead (activations split into two bf16 halves), in decode as well (rows_amx:
the same tiles summed in the same order, so the chunk still does not matter); on the
"bf16-prefill" path, prefill alone, GGUF blocks too (decoded per group of rows, their values
split as well; opt-in, cpu.DEFAULT); on the "dpbf16" path, where AMX is not on, bf16 weights
packed at load go to vdpbf16ps (dpbf16.py) in prefill and decode alike, one chain of sums. A call may
narrow the paths (`paths`: MoE's experts, whose decode is moe.py's f32 kernels, leave "bf16" out);
without an integer path, blocks are packed in panels of PANEL rows decoded to float32
(transposed) for the SIMD micro-kernel of tile.py. `matmul` picks one by n.

Why not numpy's BLAS for prefill: OpenBLAS keeps its own thread pool, whose threads spin after
each call while numba's workers poll for the next parallel region; on a machine with as many
cores as threads the two pools steal cores from each other, and a prefill layer measured 2-3x
slower than BLAS alone. One pool (numba's) for every kernel avoids that.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ellmd.kernels import bf16, cpu, dpbf16, gemm, lanes, quant, quant_f32, quant_int
from ellmd.kernels.activations import PARALLEL_MIN
from ellmd.kernels.formats import BF16, kernel_view, to_f32
from ellmd.kernels.quant import decode_row
from ellmd.kernels.tile import NR, TALL_MR, lane_sum, storage_to_f32, tall_kernel

ROW_BLOCK = 16  # weight rows per parallel task of linear
PREFILL_MIN_ROWS = 64  # from this many input rows linear_prefill wins (packing amortized)
PANEL = 32  # weight rows packed by a linear_prefill task (a multiple of NR)
INPUT_BLOCK = 120  # input rows multiplied per packed panel pass (stay in L2; a multiple of TALL_MR)
# input rows an integer prefill task runs a weight row block over (see _linear_int): one pass of
# rows_vnni, whose inputs (8 x 2,048 int16: 32 KB) then stay in L1 across the block's weight rows;
# over 64 inputs each weight row streamed them all from L2 (Xeon model 207, one-scale and
# K-quant GEMMs at k = 2048: 1.2-1.5x; scripts/kernel_bench.py --prefill)
INT_INPUT_BLOCK = quant_int.ROW_PASSES[0]
# bytes of activation codes an integer prefill task keeps in L2 while it runs its weight rows over
# them (a panel of input rows): over all 512 rows of a prompt (2 MB at k = 2,048, 6 MB at 6,144)
# each block of weight rows streamed the codes from L3 (Xeon model 207: 256 KB-1 MB measured alike,
# 1.1-1.15x at n = 512); the weight rows are streamed once per panel instead, a small cost
INT_PANEL_BYTES = 1 << 19
DEPTH_BLOCK = 128  # depth of one micro-kernel call: its panel slice (16 KiB) and rows of x stay in L1


STREAM_CHUNK = 32  # values of a row per step: 64 bytes of bf16, one cache line
STREAM_AHEAD = 2  # passes ahead that the weight rows are prefetched (1 and 4 measured 5-15% slower on Zen 3)
# input rows of a pass -> weight rows read side by side: eight vector accumulators either way
FLOAT_PASSES = {4: 2, 1: 4}


def _float_rows_codegen(inputs, side):
    """Codegen of out[i0:i1, j0:j1] = x[i0:i1] @ w[j0:j1].T, `inputs` input rows (i1 - i0 a multiple
    of it) times `side` weight rows at a time, the weight rows outside (in L1 for every input group).
    Every (input, weight) pair sums in one order, whatever the pass: one vector accumulator over the
    whole STREAM_CHUNK steps, the scalar rest in its own chain, a tree over the lanes, then the rest."""

    def codegen(context, builder, signature, args):
        x_t, w_t, out_t = signature.args[:3]
        x_a, w_a, out_a = (context.make_array(t)(context, builder, v) for t, v in zip((x_t, w_t, out_t), args[:3]))
        i0, i1, j0, j1 = args[3:7]
        intp = context.get_value_type(types.intp)
        f32, i8p, i32 = ir.FloatType(), ir.IntType(8).as_pointer(), ir.IntType(32)
        elem = context.get_data_type(w_t.dtype)
        size = context.get_abi_sizeof(elem)
        f8 = ir.VectorType(f32, 8)
        fma8 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f8, [f8] * 3), "llvm.fma.v8f32")
        fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
        prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                                  "llvm.prefetch.p0")

        def c(v):
            return ir.Constant(intp, v)

        k = cgutils.unpack_tuple(builder, x_a.shape)[1]
        w_stride = cgutils.unpack_tuple(builder, w_a.strides)[0]
        out_strides = cgutils.unpack_tuple(builder, out_a.strides)
        wbytes = builder.bitcast(w_a.data, i8p)
        chunks = builder.udiv(k, c(STREAM_CHUNK))
        ahead = builder.mul(w_stride, c(side * STREAM_AHEAD))  # the same place STREAM_AHEAD passes on
        accs = [[cgutils.alloca_once(builder, f8) for _ in range(side)] for _ in range(inputs)]
        tails = [[cgutils.alloca_once(builder, f32) for _ in range(side)] for _ in range(inputs)]
        count = builder.udiv(builder.add(builder.sub(j1, j0), c(side - 1)), c(side))
        groups = builder.udiv(builder.sub(i1, i0), c(inputs))
        with cgutils.for_range(builder, count) as passes:
            j = builder.add(j0, builder.mul(passes.index, c(side)))
            last = builder.sub(j1, c(1))
            rows = []
            for s in range(side):  # rows past j1 repeat the last one
                jr = builder.add(j, c(s))
                jr = builder.select(builder.icmp_signed("<", jr, j1), jr, last)
                rows.append((jr, builder.gep(wbytes, [builder.mul(jr, w_stride)])))
            with cgutils.for_range(builder, groups) as group:
                i = builder.add(i0, builder.mul(group.index, c(inputs)))
                xrows = [builder.gep(x_a.data, [builder.mul(builder.add(i, c(r)), k)]) for r in range(inputs)]
                for r in range(inputs):
                    for s in range(side):
                        builder.store(ir.Constant(f8, [0.0] * 8), accs[r][s])
                        builder.store(ir.Constant(f32, 0.0), tails[r][s])
                with cgutils.for_range(builder, chunks) as steps:
                    c0 = builder.mul(steps.index, c(STREAM_CHUNK))
                    ats = [builder.gep(base, [builder.mul(c0, c(size))]) for _, base in rows]
                    with builder.if_then(builder.icmp_unsigned("==", group.index, c(0))):  # once a pass
                        for at in ats:
                            for line in range(0, STREAM_CHUNK * size, 64):
                                builder.call(prefetch, [builder.gep(at, [builder.add(ahead, c(line))]), ir.Constant(i32, 0),
                                                        ir.Constant(i32, 3), ir.Constant(i32, 1)])
                    for h in range(STREAM_CHUNK // 8):
                        xv = [builder.load(builder.bitcast(builder.gep(xrow, [builder.add(c0, c(8 * h))]), f8.as_pointer()),
                                           align=4) for xrow in xrows]
                        for s, at in enumerate(ats):
                            ptr = builder.bitcast(builder.gep(at, [c(8 * h * size)]), ir.VectorType(elem, 8).as_pointer())
                            wv = storage_to_f32(builder, builder.load(ptr, align=size), w_t.dtype)
                            for r in range(inputs):
                                acc = accs[r][s]
                                builder.store(builder.call(fma8, [xv[r], wv, builder.load(acc)]), acc)
                with cgutils.for_range_slice(builder, builder.mul(chunks, c(STREAM_CHUNK)), k, c(1)) as (col, _):
                    xs = [builder.load(builder.gep(xrow, [col])) for xrow in xrows]
                    one = ir.VectorType(elem, 1)
                    for s, (_, base) in enumerate(rows):
                        ptr = builder.bitcast(builder.gep(base, [builder.mul(col, c(size))]), elem.as_pointer())
                        wv = storage_to_f32(builder, builder.insert_element(ir.Constant(one, ir.Undefined), builder.load(ptr),
                                                                            ir.Constant(i32, 0)), w_t.dtype)
                        wv = builder.extract_element(wv, ir.Constant(i32, 0))
                        for r in range(inputs):
                            builder.store(builder.call(fma1, [xs[r], wv, builder.load(tails[r][s])]), tails[r][s])
                for r in range(inputs):
                    for s, (jr, _) in enumerate(rows):
                        value = builder.fadd(lane_sum(builder, builder.load(accs[r][s])), builder.load(tails[r][s]))
                        ptr = builder.gep(builder.bitcast(out_a.data, i8p),
                                          [builder.add(builder.mul(builder.add(i, c(r)), out_strides[0]),
                                                       builder.mul(jr, out_strides[1]))])
                        builder.store(value, builder.bitcast(ptr, f32.as_pointer()))
        return context.get_dummy_value()

    return codegen


def _make_float_rows(inputs):
    @intrinsic
    def float_rows(typingctx, x, w, out, i0, i1, j0, j1):
        """out[i0:i1, j0:j1] = x[i0:i1] @ w[j0:j1].T for float storage w [m, k] (C-contiguous; float32,
        uint16 bf16 or int16 f16), x [n, k] float32 C-contiguous, in steps of one cache line of each
        weight row, each line asked for STREAM_AHEAD passes ahead: on Zen 3 the hardware prefetcher
        alone left 1-row bf16 decode at 5-8 GB/s (k = 576 to 6144) of the ~20 a core reads from L2;
        this reaches 7.5-13 (fixed distances of 1-64 KiB measured no better)."""
        if not (isinstance(w, types.Array) and w.ndim == 2 and w.layout == "C"
                and w.dtype in (types.float32, types.uint16, types.int16)):
            return None
        return types.void(x, w, out, i0, i1, j0, j1), _float_rows_codegen(inputs, FLOAT_PASSES[inputs])

    return float_rows


_rows_of_four, _rows_of_one = (_make_float_rows(inputs) for inputs in FLOAT_PASSES)


def linear_rows(x, w, out, j0, j1, acc=None):
    """out[:, j0:j1] = x @ w[j0:j1].T inside numba code, for every weight format.

    x: [n, k] float32; w: [m, k] storage (float32, uint16 bf16, int16 f16) or [m, blocks] of a
    block dtype (quant.py); out: [n, m] float32 (any layout). Serial: callers split the rows.
    x must be C-contiguous, float w too. Float weight rows go two (four inputs at a time) or four
    (the inputs left over) side by side, a last odd one computed twice; block rows are unpacked in
    registers once for all n inputs (quant_f32.dot_rows, whose accumulator is acc, 1-D float32 of
    quant_f32.acc_floats(n), or allocated when acc is None).
    """
    raise NotImplementedError("numba only")


@overload(linear_rows, jit_options={"fastmath": True, "nogil": True})
def _linear_rows_overload(x, w, out, j0, j1, acc=None):
    if quant.record_name(w.dtype) is None:
        if w.layout != "C":
            raise numba.errors.TypingError("linear_rows takes float weights C-contiguous")

        def impl_float(x, w, out, j0, j1, acc=None):
            n = x.shape[0]
            fours = n - n % 4
            _rows_of_four(x, w, out, 0, fours, j0, j1)
            _rows_of_one(x, w, out, fours, n, j0, j1)

        return impl_float

    def impl_blocks(x, w, out, j0, j1, acc=None):
        quant_f32.dot_rows(x, w, out, j0, j1, acc)

    return impl_blocks


def path_rows(x, q, halves, w, out, j0, j1, acc, integer):
    """out[:, j0:j1] = x @ w[j0:j1].T: from q = (xq, xd, xs), x quantized, when integer and w is in a
    block type of the integer paths (q = (xq, xd, xs, xq8, xd8, xs8) on the "int8" path: tiles of
    lanes.INT8_BLOCKS take the int8 codes); from halves = (xh, xl, on_tiles), x packed for bf16 weights
    on AMX tiles (on_tiles) or for packed ones on vdpbf16ps (dpbf16.py) (halves is () where bf16
    weights decode on neither); else from x on the float kernels (acc: dot_rows' accumulator)."""
    raise NotImplementedError("numba only")


@overload(path_rows, jit_options={"fastmath": True, "nogil": True})
def _path_rows_overload(x, q, halves, w, out, j0, j1, acc, integer):
    if lanes.tiles_type(w):  # tiles (lanes.py): from the int16 codes, whatever `integer` says (lanes.wanted)
        if q[0].dtype != types.int16:
            raise numba.errors.TypingError("lanes tiles take int16 activation codes: the int16 path, not vnni")
        if lanes.takes_int8(w, q):  # the int8 codes

            def impl_tiles8(x, q, halves, w, out, j0, j1, acc, integer):
                lanes.lanes_rows(q[3], q[4], q[5], w, out, j0 // lanes.LANES, (j1 + lanes.LANES - 1) // lanes.LANES)

            return impl_tiles8

        def impl_tiles(x, q, halves, w, out, j0, j1, acc, integer):
            lanes.lanes_rows(q[0], q[1], q[2], w, out, j0 // lanes.LANES, (j1 + lanes.LANES - 1) // lanes.LANES)

        return impl_tiles
    if bf16.packed_type(w):  # bf16 packed at load: halves packed by bf16.pack_token_rows or dpbf16.pack_tokens

        def impl_packed(x, q, halves, w, out, j0, j1, acc, integer):
            if halves[2]:
                c = acc[: bf16.TILE * bf16.TILE].reshape((bf16.TILE, bf16.TILE))  # the workspace: acc_floats(D) >= 256
                bf16.rows_packed(halves[0], halves[1], x.shape[0], w, out, j0, j1, c)
            else:
                dpbf16.rows(halves[0], halves[1], x.shape[0], w, out, j0, j1)

        return impl_packed
    if len(halves) == 3 and w.dtype == types.uint16 and w.layout == "C":  # bf16 (f16 views are int16)

        def impl_amx(x, q, halves, w, out, j0, j1, acc, integer):
            if halves[2] and w.shape[0] % bf16.TILE == 0 and w.shape[1] % bf16.CHUNK == 0:  # bf16.usable, as linear
                c = acc[: bf16.TILE * bf16.TILE].reshape((bf16.TILE, bf16.TILE))  # the workspace: acc_floats(D) >= 256
                bf16.rows_amx(halves[0], halves[1], x.shape[0], w, out, j0, j1, c)
            else:
                linear_rows(x, w, out, j0, j1, acc)

        return impl_amx
    if quant.record_name(w.dtype) in quant.VNNI_BLOCKS:

        def impl_integer(x, q, halves, w, out, j0, j1, acc, integer):
            if integer:
                quant_int.rows_vnni(q[0], q[1], q[2], w, out, j0, j1)
            else:
                linear_rows(x, w, out, j0, j1, acc)

        return impl_integer

    def impl(x, q, halves, w, out, j0, j1, acc, integer):
        linear_rows(x, w, out, j0, j1, acc)

    return impl


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _linear(x, w, out):
    m = w.shape[0]
    if x.shape[0] * m * x.shape[1] < 8 * PARALLEL_MIN:
        linear_rows(x, w, out, 0, m)
        return
    for b in prange((m + ROW_BLOCK - 1) // ROW_BLOCK):
        linear_rows(x, w, out, b * ROW_BLOCK, min(m, b * ROW_BLOCK + ROW_BLOCK))


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _linear_int(x, w, out, xq, workers):
    """out = x @ w.T on the integer path, decode and prefill: x quantized once (its rows split between
    the workers), then each worker an equal run of ROW_BLOCK weight rows, over one panel of input
    rows (INT_PANEL_BYTES of codes, in L2) at a time, each block over INT_INPUT_BLOCK rows of the
    panel at a time, so that those inputs stay in L1 across the block's rows while rows_vnni's
    pass unpacks each weight row once for them. A row is computed alike whatever rows come with
    it (rows_vnni sums a row in one order whatever its pass)."""
    n, k = x.shape
    m = w.shape[0]
    xd = np.empty((n, k // 32), np.float32)
    xs = np.empty((n, k // 16), np.float32)
    if n * m * k < 8 * PARALLEL_MIN:
        quant.quantize_activations(x, xq, xd, xs)
        quant_int.rows_vnni(xq, xd, xs, w, out, 0, m)
        return
    for wk in prange(workers):
        r0, r1 = wk * n // workers, (wk + 1) * n // workers
        quant.quantize_activations(x[r0:r1], xq[r0:r1], xd[r0:r1], xs[r0:r1])
    blocks = (m + ROW_BLOCK - 1) // ROW_BLOCK
    panel = max(1, INT_PANEL_BYTES // (k * xq.itemsize * INT_INPUT_BLOCK)) * INT_INPUT_BLOCK
    for wk in prange(workers):  # even shares of weight rows: each worker writes its own columns
        for p0 in range(0, n, panel):
            p1 = min(n, p0 + panel)
            for b in range(wk * blocks // workers, (wk + 1) * blocks // workers):
                j0, j1 = b * ROW_BLOCK, min(m, b * ROW_BLOCK + ROW_BLOCK)
                for i0 in range(p0, p1, INT_INPUT_BLOCK):
                    i1 = min(p1, i0 + INT_INPUT_BLOCK)
                    quant_int.rows_vnni_depth_first(xq[i0:i1], xd[i0:i1], xs[i0:i1], w, out[i0:i1], j0, j1)


@numba.njit(cache=True, nogil=True, fastmath=False)
def _linear_vnni(x, w, out, workers):
    _linear_int(x, w, out, np.empty(x.shape, np.int8), workers)


@numba.njit(cache=True, nogil=True, fastmath=False)
def _linear_int16(x, w, out, workers):
    _linear_int(x, w, out, np.empty(x.shape, np.int16), workers)


def _linear_integer(x, w, out):
    """out = x @ w.T for block weight w on the integer path cpu.ENABLED names ("vnni" before "int16")."""
    (_linear_vnni if "vnni" in cpu.ENABLED else _linear_int16)(x, w, out, numba.get_num_threads())


def _integer(w):
    """True when block weight w runs on an integer path (cpu.py) of this call."""
    return quant.block_name(w) in quant.VNNI_BLOCKS and bool(cpu.INTEGER & cpu.ENABLED)


def linear(x, w, fmt, out, paths=None):
    """out = x @ w.T for small n (decode): reads each weight row once, converts on the fly.

    x: [n, k] float32; w: [m, k] storage (float32 for F32, uint16 bits for BF16/F16), or
    [m, blocks] of a block dtype (fmt is then ignored), or a tuple of such matrices whose rows
    follow one another (a fusion of tensors of different formats); out: [n, m] float32,
    written in place; paths as in linear_prefill. Parallel over blocks of weight rows. On the
    integer paths (cpu.py), blocks meet x quantized per 32 values (as llama.cpp does): to int8 on
    "vnni", to int16 on "int16" ("vnni" wins when both are on). On "bf16", bf16 weights take AMX
    tiles, as in prefill.
    """
    paths = cpu.ENABLED if paths is None else paths
    for part, cols in _parts(w, out):
        if lanes.is_tiles(part):
            lanes.linear_lanes(x, part, cols, numba.get_num_threads())
        elif bf16.is_packed(part) and bf16.vdpbf16ps(paths):
            dpbf16.linear(x, part, cols, numba.get_num_threads(), bf16.rounded(paths))
        elif bf16.is_packed(part):
            _linear_packed(x, part, cols, numba.get_num_threads(), bf16.rounded(paths))
        elif _integer(part):
            _linear_integer(x, part, cols)
        elif _decodes_on_tiles(x, part, fmt, paths):
            _linear_tiles(x, part, cols, numba.get_num_threads(), bf16.rounded(paths))
        else:
            _linear(x, kernel_view(part, fmt), cols)


@numba.njit(cache=True, nogil=True, fastmath=False, parallel=True)
def _linear_tiles(x, w, out, workers, rounded):
    """out = x @ w.T for few rows on AMX tiles (bf16.rows_amx): x packed once (in two halves, or
    rounded once), then each worker an equal run of 16-row tiles."""
    n, k = x.shape
    m = w.shape[0]
    xh = np.empty(((n + bf16.TILE - 1) // bf16.TILE, k * bf16.TILE), np.uint16)
    xl = np.empty((0 if rounded else xh.shape[0], xh.shape[1]), np.uint16)
    bf16.pack_tokens(x, xh, xl)
    if n * m * k < 8 * PARALLEL_MIN:
        bf16.rows_amx(xh, xl, n, w, out, 0, m, np.empty((bf16.TILE, bf16.TILE), np.float32))
        return
    tiles = m // bf16.TILE
    for wk in prange(workers):
        c = np.empty((bf16.TILE, bf16.TILE), np.float32)
        bf16.rows_amx(xh, xl, n, w, out, wk * tiles // workers * bf16.TILE, (wk + 1) * tiles // workers * bf16.TILE, c)


@numba.njit(cache=True, nogil=True, fastmath=False, parallel=True)
def _linear_packed(x, w, out, workers, rounded):
    """out = x @ w.T for few rows and PACKED w (bf16.rows_packed): x packed once (in two halves, or
    rounded once), then each worker an equal run of the weight's tiles."""
    n, k = x.shape
    xa = np.empty(((n + bf16.TILE - 1) // bf16.TILE, k * bf16.TILE), np.uint16)
    xal = np.empty((0 if rounded else xa.shape[0], xa.shape[1]), np.uint16)
    bf16.pack_token_rows(x, xa, xal)
    tiles = w.shape[0]
    if n * tiles * bf16.TILE * k < 8 * PARALLEL_MIN:
        bf16.rows_packed(xa, xal, n, w, out, 0, tiles * bf16.TILE, np.empty((bf16.TILE, bf16.TILE), np.float32))
        return
    for wk in prange(workers):
        c = np.empty((bf16.TILE, bf16.TILE), np.float32)
        bf16.rows_packed(xa, xal, n, w, out, wk * tiles // workers * bf16.TILE, (wk + 1) * tiles // workers * bf16.TILE, c)


def rows(w) -> int:
    """Weight rows of a matrix as it is held: lanes' tiles and AMX's packed tiles hold 16 a tile."""
    return bf16.TILE * w.shape[0] if bf16.is_packed(w) else lanes.rows(w)


def part_rows(w):
    """rows, inside numba code."""
    raise NotImplementedError("numba only")


@overload(part_rows, jit_options={"fastmath": False, "nogil": True})
def _part_rows_overload(w):
    if bf16.packed_type(w):
        return lambda w: bf16.TILE * w.shape[0]
    return lambda w: lanes.part_rows(w)


def _parts(w, out):
    """(matrix, out columns) of a weight or of each part of a tuple of weights."""
    if not isinstance(w, tuple):
        return ((w, out),)
    bounds = np.cumsum([0] + [rows(p) for p in w])
    return tuple((p, out[:, a:b]) for p, a, b in zip(w, bounds[:-1], bounds[1:]))


def linear_ref(x, w, fmt, out, paths=None):
    """numpy reference of linear."""
    paths = cpu.ENABLED if paths is None else paths
    for part, cols in _parts(w, out):
        packed = bf16.is_packed(part)  # on AMX tiles or vdpbf16ps: the GEMM's halves
        part = bf16.unpack(part) if packed else part
        if packed or _decodes_on_tiles(x, part, fmt, paths):
            bf16.gemm_ref(x, part, cols, None, paths)
            continue
        w32 = lanes.dequantize_ref(part)[: cols.shape[1]] if lanes.is_tiles(part) else to_f32(part, fmt)
        cols[:] = (x.astype(np.float64) @ w32.T.astype(np.float64)).astype(np.float32)


def _worker_floats(k):
    return max(k * PANEL + INPUT_BLOCK * PANEL + INPUT_BLOCK * k, gemm.PANEL * k)


def prefill_scratch_size(m, k):
    """float32 elements of the scratch linear_prefill needs for a [m, k] weight.

    One work area per numba thread (the count at the time of the call).
    """
    return max(numba.get_num_threads() * _worker_floats(k), bf16.scratch_floats(m, k) if bf16.AMX else 0,
               dpbf16.scratch_floats(k) if "dpbf16" in cpu.host_paths() else 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _pack(w, j0, rows, panel, row):
    """panel[d, c] = w[j0 + c, d] as float32, zero columns past rows. panel: [k, PANEL]; row: [k]."""
    k = panel.shape[0]
    for c in range(rows):
        decode_row(w[j0 + c], row)  # blocks are decoded once per row here
        for d in range(k):
            panel[d, c] = row[d]
    for c in range(rows, PANEL):
        for d in range(k):
            panel[d, c] = np.float32(0.0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _panel_product(x, w, out, j0, panel, block, xpad):
    """out[:, j0:j0+PANEL] = x @ w[j0:j0+PANEL].T, INPUT_BLOCK rows of x at a time.

    panel: [k, PANEL]; block: [INPUT_BLOCK, PANEL]; xpad: [INPUT_BLOCK, k] (a last partial
    block of x, padded to TALL_MR rows).
    """
    n, k = x.shape
    rows = min(PANEL, w.shape[0] - j0)
    _pack(w, j0, rows, panel, xpad[0])  # xpad is free until the products below
    for i0 in range(0, n, INPUT_BLOCK):
        nb = min(INPUT_BLOCK, n - i0)
        nbp = (nb + TALL_MR - 1) // TALL_MR * TALL_MR
        xa = x[i0 : i0 + nb]
        if nbp != nb:
            for r in range(nbp):
                for d in range(k):
                    xpad[r, d] = x[i0 + r, d] if r < nb else np.float32(0.0)
            xa = xpad[:nbp]
        for kb in range(0, k, DEPTH_BLOCK):
            depth = min(DEPTH_BLOCK, k - kb)
            for r in range(0, nbp, TALL_MR):
                for c in range(0, PANEL, NR):
                    tall_kernel(xa, r * k + kb, k, 1, panel, kb * PANEL + c, block, r * PANEL + c, depth, kb > 0)
        for r in range(nb):
            dst = out[i0 + r]
            src = block[r]
            for c in range(rows):
                dst[j0 + c] = src[c]


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _prefill_product(x, w, out, work):
    m, k = w.shape[0], x.shape[1]
    workers = work.shape[0]
    panels = (m + PANEL - 1) // PANEL
    for wk in prange(workers):
        area = work[wk]
        panel = area[: k * PANEL].reshape((k, PANEL))
        block = area[k * PANEL : (k + INPUT_BLOCK) * PANEL].reshape((INPUT_BLOCK, PANEL))
        xpad = area[(k + INPUT_BLOCK) * PANEL : (k + INPUT_BLOCK) * PANEL + INPUT_BLOCK * k].reshape((INPUT_BLOCK, k))
        # panels dealt round-robin: equal shares, and each worker owns its work area
        for t in range(wk, panels, workers):
            _panel_product(x, w, out, t * PANEL, panel, block, xpad)


def linear_prefill(x, w, fmt, out, scratch, paths=None):
    """out = x @ w.T for large n (prefill): packed weight panels on a SIMD micro-kernel.

    x: [n, k] float32; w: as in linear; out: [n, m] float32; scratch: 1-D float32 of
    prefill_scratch_size(m, k) elements (room for fewer threads only lowers the parallelism);
    paths: the kernel paths this call may take (cpu.ENABLED when None). Each weight row is
    converted once. Float weights: gemm.product, decode's sums. bf16 weights and GGUF blocks go to
    bf16.gemm where the paths send them (_bf16_gemm); other blocks on an integer path take the
    integer kernel (_integer_prefill).
    """
    paths = cpu.ENABLED if paths is None else paths
    per = _worker_floats(x.shape[1])
    workers = max(1, min(numba.get_num_threads(), scratch.size // per))
    work = scratch[: workers * per].reshape(workers, per)  # [workers, per]
    for part, cols in _parts(w, out):
        if lanes.is_tiles(part):  # decode's kernel: the same sums
            lanes.linear_lanes(x, part, cols, workers)
        elif bf16.is_packed(part) and bf16.vdpbf16ps(paths):
            dpbf16.gemm(x, part, cols, scratch, bf16.rounded(paths))
        elif bf16.is_packed(part):
            bf16.gemm_packed(x, part, cols, scratch, paths)
        elif _integer_prefill(x, part, fmt, paths):
            _linear_integer(x, part, cols)
        elif _bf16_gemm(x, part, fmt, paths):
            bf16.gemm(x, part, cols, scratch, paths)
        elif quant.is_blocks(part):
            _prefill_product(x, part, cols, work)
        else:  # float weights: decode's order of sums, so a token's numbers do not depend on its chunk
            gemm.product(x, kernel_view(part, fmt), cols, work)


def _integer_prefill(x, w, fmt, paths):
    """True when block weight w's prefill takes the integer GEMM: on an integer path, unless
    "bf16-prefill" sends it to AMX."""
    return _integer(w) and not _bf16_gemm(x, w, fmt, paths)


def _bf16_gemm(x, w, fmt, paths):
    """True when w's prefill takes bf16.gemm on these paths: bf16 weights on AMX ("bf16" or
    "bf16-prefill"; those packed at load take gemm_packed); GGUF blocks with "bf16-prefill" only."""
    if w.ndim != 2 or not (w.flags.c_contiguous and x.flags.c_contiguous):
        return False
    if quant.is_blocks(w):
        return "bf16-prefill" in paths and bf16.tiles(paths) and bf16.usable(w.shape[0], quant.columns(w))
    return fmt == BF16 and w.dtype == np.uint16 and bf16.tiles(paths) and bf16.usable(*w.shape)


def _decodes_on_tiles(x, w, fmt, paths):
    """True when w's decode takes AMX tiles as its prefill does (bf16 weights on the "bf16" path)."""
    return bf16.decode_tiles(paths) and not quant.is_blocks(w) and _bf16_gemm(x, w, fmt, paths)


def linear_prefill_ref(x, w, fmt, out, scratch, paths=None):
    """numpy reference of linear_prefill (of its bf16 GEMM where the paths send w there)."""
    paths = cpu.ENABLED if paths is None else paths
    for part, cols in _parts(w, out):
        packed = bf16.is_packed(part)
        part = bf16.unpack(part) if packed else part
        if packed or (_bf16_gemm(x, part, fmt, paths) and not lanes.is_tiles(part)):
            bf16.gemm_ref(x, part, cols, None, paths)
        else:
            linear_ref(x, part, fmt, cols)


def matmul(x, w, fmt, out, scratch, paths=None):
    """out = x @ w.T, choosing linear (few rows) or linear_prefill (many rows) by n.

    Shapes and paths as in linear_prefill; scratch may be None when n < PREFILL_MIN_ROWS.
    """
    if x.shape[0] < PREFILL_MIN_ROWS:
        linear(x, w, fmt, out, paths)
    else:
        linear_prefill(x, w, fmt, out, scratch, paths)


def matmul_ref(x, w, fmt, out, scratch, paths=None):
    """numpy reference of matmul."""
    if x.shape[0] < PREFILL_MIN_ROWS:
        linear_ref(x, w, fmt, out, paths)
    else:
        linear_prefill_ref(x, w, fmt, out, scratch, paths)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _embed(tokens, table, out):
    # serial: one row per token, memory-bound
    for i in range(tokens.shape[0]):
        decode_row(table[tokens[i]], out[i])


def embed(tokens, table, fmt, out):
    """out[i] = table[tokens[i]] as float32.

    tokens: [n] int64; table: [V, d] storage or [V, blocks] of a block dtype; out: [n, d] float32.
    """
    _embed(tokens, kernel_view(table, fmt), out)


def embed_ref(tokens, table, fmt, out):
    """numpy reference of embed."""
    out[:] = to_f32(table[tokens], fmt)
