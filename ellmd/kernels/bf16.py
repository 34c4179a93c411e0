"""The bf16 GEMM of prefill: activations rounded to bf16, weights as stored, f32 accumulation.

Shape legend:
  n       input rows (tokens)
  k       input features, k % CHUNK == 0; pairs = k // 2
  m       output features (weight rows)
  tokens  tokens of a packed block of activations (TOKENS)

Two engines share one data layout. The weights are read as stored ([m, k] bf16 bits, the two
values of a pair of depths adjacent): no packing at load, no second copy in memory. The
activations of a block of tokens are rounded to bf16 and packed per pair of depths
(`pack_activations`: xp[p, i] is the 32-bit pair (x[i, 2p], x[i, 2p+1])), the layout both
instructions read as their "B" operand; each product is c[weight row, token], copied
transposed into out.

- AMX (`tdpbf16ps`, where the CPU has AMX-BF16 and Linux grants the tile state): a block of
  32 weight rows x 32 tokens is four 16 x 16 f32 tiles, fed by two tiles of weights (16 rows x
  32 depths) and two of tokens (16 pairs x 16 tokens) per 32 depths.
- AVX512-BF16 (`vdpbf16ps`): a 6 x 64 block in 24 zmm registers; per pair of depths, six
  broadcasts of a weight pair and four 64-byte loads of 16 tokens' pairs feed 24 vdpbf16ps.
  (Measured on a Xeon with AMX: vdpbf16ps runs ~0.5 per cycle there, so this engine only
  matches the f32 FMA kernels; AMX is 2.5-6x faster than both.)

The products of two bf16 values are exact in f32 and every sum is an f32 sum, so the only
rounding beyond the f32 kernels' is that of the activations to bf16 (relative ~2**-9 each).
"""

import ctypes

import numba
import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ellmd.kernels.formats import BF16, to_f32, to_storage

MR = 6  # rows of a micro-kernel block
NR = 64  # columns of a micro-kernel block
_LANES = 16  # f32 lanes of a zmm register
_NV = NR // _LANES
CHUNK = 32  # depths converted per step by pack_activations (and of an AMX tile)


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


_F32X16 = ir.VectorType(ir.FloatType(), _LANES)
_BF16X32 = ir.VectorType(_BFloat(), 2 * _LANES)
_I32X16 = ir.VectorType(ir.IntType(32), _LANES)


def _dpbf16ps(builder):
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_F32X16, [_F32X16, _BF16X32, _BF16X32]), "llvm.x86.avx512bf16.dpbf16ps.512"
    )


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
        low = ir.Constant(ir.VectorType(i32, _LANES), [c if not c & bit else _LANES + (c & ~bit) for c in range(_LANES)])
        high = ir.Constant(ir.VectorType(i32, _LANES), [c | bit if not c & bit else _LANES + c for c in range(_LANES)])
        out = list(rows)
        for r in range(_LANES):
            if not r & bit:
                out[r] = builder.shuffle_vector(rows[r], rows[r | bit], low)
                out[r | bit] = builder.shuffle_vector(rows[r], rows[r | bit], high)
        rows = out
    return rows


@intrinsic
def pack_activations(typingctx, x, i0, nb, nbp, xp):
    """xp as uint32 [pairs, tokens]: xp[p, i] = bf16 pair (x[i0+i, 2p], x[i0+i, 2p+1]), i < nbp.

    x: [n, k] float32, k % CHUNK == 0; xp: [pairs, 2 * tokens] uint16 (the pairs of a token
    side by side); nbp % 16 == 0; tokens from nb on repeat token nb - 1 (padding that stays
    finite). Rounds to nearest even (vcvtneps2bf16). Per 16 tokens x 16 pairs: 16 row loads,
    a transpose in registers, 16 row stores.
    """
    if not (_is_matrix(x, types.float32) and _is_matrix(xp, types.uint16)):
        return None
    sig = types.void(x, types.intp, types.intp, types.intp, xp)

    def codegen(context, builder, signature, args):
        x_p, (_, k), _ = _data(context, builder, signature.args[0], args[0])
        xp_p, (_, ld2), _ = _data(context, builder, signature.args[4], args[4])
        i0, nb, nbp = args[1], args[2], args[3]
        intp = context.get_value_type(types.intp)

        def const(v):
            return ir.Constant(intp, v)

        f32x32 = ir.VectorType(ir.FloatType(), CHUNK)
        xp32 = builder.bitcast(xp_p, ir.IntType(32).as_pointer())
        ld = builder.udiv(ld2, const(2))
        last = builder.sub(nb, const(1))
        with cgutils.for_range(builder, builder.udiv(nbp, const(_LANES))) as groups:
            t0 = builder.mul(groups.index, const(_LANES))
            starts = []
            for r in range(_LANES):
                t = builder.add(t0, const(r))
                t = builder.select(builder.icmp_signed(">", t, last), last, t)
                starts.append(builder.gep(x_p, [builder.mul(builder.add(i0, t), k)]))
            with cgutils.for_range(builder, builder.udiv(k, const(CHUNK))) as chunks:
                c = builder.mul(chunks.index, const(CHUNK))
                words = [builder.bitcast(builder.fptrunc(builder.load(builder.bitcast(
                    builder.gep(row, [c]), f32x32.as_pointer()), align=4), _BF16X32), _I32X16) for row in starts]
                p0 = builder.udiv(c, const(2))
                for lane, col in enumerate(_transpose16(builder, words)):
                    at = builder.add(builder.mul(builder.add(p0, const(lane)), ld), t0)
                    builder.store(col, builder.bitcast(builder.gep(xp32, [at]), _I32X16.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def micro_kernel(typingctx, w, j0, jlast, p0, xp, t0, c, pairs, accumulate):
    """c[r, t0:t0+NR] (+)= sum over pairs p0.. of w's row min(j0+r, jlast) . the tokens' pairs.

    For r < MR: w: [m, k] bf16 bits as stored (its pair p is the 32 bits at w[row, 2p]);
    xp: pack_activations' [pairs, 2 * tokens]; c: [MR, tokens] float32. The MR x NR block
    stays in 24 registers across the depth loop: per pair, MR broadcasts of a weight pair and
    four 64-byte loads of 16 tokens' pairs feed 24 vdpbf16ps.
    """
    u16 = types.uint16
    if not (_is_matrix(w, u16) and _is_matrix(xp, u16) and _is_matrix(c, types.float32)):
        return None
    sig = types.void(w, types.intp, types.intp, types.intp, xp, types.intp, c, types.intp, types.boolean)

    def codegen(context, builder, signature, args):
        w_p, (_, k), _ = _data(context, builder, signature.args[0], args[0])
        xp_p, (_, ld2), _ = _data(context, builder, signature.args[4], args[4])
        c_p, (_, ldc), _ = _data(context, builder, signature.args[6], args[6])
        _, j0, jlast, p0, _, t0, _, pairs, acc_flag = args
        intp = context.get_value_type(types.intp)
        i32 = ir.IntType(32)
        dp = _dpbf16ps(builder)

        def const(v):
            return ir.Constant(intp, v)

        half_k = builder.udiv(k, const(2))
        w32 = builder.bitcast(w_p, i32.as_pointer())
        rows = []
        for r in range(MR):
            j = builder.add(j0, const(r))
            j = builder.select(builder.icmp_signed(">", j, jlast), jlast, j)
            rows.append(builder.gep(w32, [builder.add(builder.mul(j, half_k), p0)]))
        ld = builder.udiv(ld2, const(2))
        xbase = builder.gep(builder.bitcast(xp_p, i32.as_pointer()), [builder.add(builder.mul(p0, ld), t0)])
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_F32X16, [0.0] * _LANES)) for _ in range(MR * _NV)]
        splat = ir.Constant(_I32X16, [0] * _LANES)
        with cgutils.for_range(builder, pairs) as loop:
            p = loop.index
            xrow = builder.gep(xbase, [builder.mul(p, ld)])
            xv = [builder.bitcast(builder.load(builder.bitcast(builder.gep(xrow, [const(_LANES * v)]),
                                                                _I32X16.as_pointer()), align=4), _BF16X32)
                  for v in range(_NV)]
            for r in range(MR):
                word = builder.load(builder.gep(rows[r], [p]))
                wv = builder.insert_element(ir.Constant(_I32X16, ir.Undefined), word, ir.Constant(i32, 0))
                wv = builder.bitcast(builder.shuffle_vector(wv, ir.Constant(_I32X16, ir.Undefined), splat), _BF16X32)
                for v in range(_NV):
                    slot = accs[r * _NV + v]
                    builder.store(builder.call(dp, [builder.load(slot), wv, xv[v]]), slot)
        for r in range(MR):
            crow = builder.gep(c_p, [builder.add(builder.mul(const(r), ldc), t0)])
            for v in range(_NV):
                ptr = builder.bitcast(builder.gep(crow, [const(_LANES * v)]), _F32X16.as_pointer())
                total = builder.load(accs[r * _NV + v])
                with builder.if_else(acc_flag) as (then, otherwise):
                    with then:
                        builder.store(builder.fadd(total, builder.load(ptr, align=4)), ptr, align=4)
                    with otherwise:
                        builder.store(total, ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


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
    """An intrinsic for one AMX block: row_tiles x 2 tiles of c, accumulated or overwritten."""

    @intrinsic
    def amx_block(typingctx, w, j0, xp, t0, c, p0, pairs):
        u16 = types.uint16
        if not (_is_matrix(w, u16) and _is_matrix(xp, u16) and _is_matrix(c, types.float32)):
            return None
        sig = types.void(w, types.intp, xp, types.intp, c, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            w_p, (_, k), _ = _data(context, builder, signature.args[0], args[0])
            xp_p, (_, ld2), _ = _data(context, builder, signature.args[2], args[2])
            c_p, (_, ldc), _ = _data(context, builder, signature.args[4], args[4])
            _, j0, _, t0, _, p0, pairs = args
            f = _amx_functions(builder)
            i8p = ir.IntType(8).as_pointer()
            intp = context.get_value_type(types.intp)

            def const(v):
                return ir.Constant(intp, v)

            rows, width = ir.Constant(ir.IntType(16), TILE), ir.Constant(ir.IntType(16), 4 * TILE)
            w_stride, x_stride, c_stride = builder.mul(k, const(2)), builder.mul(ld2, const(2)), builder.mul(ldc, const(4))
            w_bytes, x_bytes = builder.bitcast(w_p, i8p), builder.bitcast(xp_p, i8p)
            c_bytes = builder.bitcast(c_p, i8p)
            a_base = [builder.add(builder.mul(builder.add(j0, const(TILE * a)), w_stride), builder.mul(p0, const(4)))
                      for a in range(row_tiles)]
            b_base = [builder.add(builder.mul(p0, x_stride), builder.mul(builder.add(t0, const(TILE * b)), const(4)))
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
            with cgutils.for_range(builder, builder.udiv(pairs, const(TILE))) as loop:
                s = loop.index
                a_tiles = [builder.call(f["load"], [rows, width, builder.gep(w_bytes, [builder.add(base, builder.mul(
                    s, const(4 * TILE)))]), w_stride]) for base in a_base]
                b_tiles = [builder.call(f["load"], [rows, width, builder.gep(x_bytes, [builder.add(base, builder.mul(
                    s, builder.mul(x_stride, const(TILE))))]), x_stride]) for base in b_base]
                for a in range(row_tiles):
                    for b in range(2):
                        slot = accs[2 * a + b]
                        acc = builder.call(f["tile"], [builder.load(slot)])
                        acc = builder.call(f["dp"], [rows, width, width, acc, a_tiles[a], b_tiles[b]])
                        builder.store(builder.call(f["vec"], [acc]), slot)
            for a in range(row_tiles):
                for b in range(2):
                    tile = builder.call(f["tile"], [builder.load(accs[2 * a + b])])
                    builder.call(f["store"], [rows, width, builder.gep(c_bytes, [c_at[a][b]]), c_stride, tile])
            return context.get_dummy_value()

        return sig, codegen

    return amx_block


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


AMX = _request_amx()  # gemm's engine: tests set it False to run the vdpbf16ps one
TOKENS = 256  # tokens per packed block of activations (a multiple of NR and AMX_TOKENS)
DEPTH = 256  # pairs per block call: a block's [DEPTH, TOKENS] packed pairs stay in L2
_C_ROWS = max(MR, AMX_ROWS)


def worker_floats(k):
    """float32 elements of one worker's area in gemm: the packed tokens and a block of c."""
    return k * TOKENS // 2 + _C_ROWS * TOKENS


def usable(m, k):
    """Whether gemm takes a [m, k] weight (the AMX engine also needs m % TILE == 0)."""
    return k % CHUNK == 0 and (m % TILE == 0 or not AMX)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _amx_rows(w, j0, xp, nbp, cb):
    """cb[:rows, :nbp] = w[j0:j0+rows] . the packed tokens, rows = 32 (or 16 at the end of w)."""
    m, k = w.shape
    pairs = k // 2
    for kb in range(0, pairs, DEPTH):
        d = min(DEPTH, pairs - kb)
        for t in range(0, nbp, AMX_TOKENS):
            if j0 + AMX_ROWS <= m:
                if kb == 0:
                    _amx_2(w, j0, xp, t, cb, kb, d)
                else:
                    _amx_2_acc(w, j0, xp, t, cb, kb, d)
            elif kb == 0:
                _amx_1(w, j0, xp, t, cb, kb, d)
            else:
                _amx_1_acc(w, j0, xp, t, cb, kb, d)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dp_rows(w, j0, xp, nbp, cb):
    """cb[:MR, :nbp] = w[j0:j0+MR] . the packed tokens (rows past m repeat the last row)."""
    m, k = w.shape
    pairs = k // 2
    for kb in range(0, pairs, DEPTH):
        for t in range(0, nbp, NR):
            micro_kernel(w, j0, m - 1, kb, xp, t, cb, min(DEPTH, pairs - kb), kb > 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _block_product(w, out, i0, nb, xp, cb, wk, workers, amx):
    """out[i0:i0+nb, this worker's groups of rows] from the packed tokens xp; cb: [_C_ROWS, TOKENS]."""
    m = w.shape[0]
    group = AMX_ROWS if amx else MR
    nbp = (nb + NR - 1) // NR * NR
    for g in range(wk, (m + group - 1) // group, workers):  # dealt round-robin: equal shares
        j0 = g * group
        if amx:
            _amx_rows(w, j0, xp, nbp, cb)
        else:
            _dp_rows(w, j0, xp, nbp, cb)
        rows = min(group, m - j0)
        for i in range(nb):  # token-major: contiguous runs of out, cb (in L1) read across
            dst = out[i0 + i]
            for r in range(rows):
                dst[j0 + r] = cb[r, i]


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _gemm(x, w, out, work, amx):
    n, k = x.shape
    workers = work.shape[0]
    for wk in numba.prange(workers):
        area = work[wk]
        xp = area[: k * TOKENS // 2].view(np.uint16).reshape((k // 2, 2 * TOKENS))
        cb = area[k * TOKENS // 2 : k * TOKENS // 2 + _C_ROWS * TOKENS].reshape((_C_ROWS, TOKENS))
        for i0 in range(0, n, TOKENS):
            nb = min(TOKENS, n - i0)
            pack_activations(x, i0, nb, (nb + NR - 1) // NR * NR, xp)
            _block_product(w, out, i0, nb, xp, cb, wk, workers, amx)


def gemm(x, w, out, work):
    """out = x @ w.T with x rounded to bf16, products and sums in f32 (AMX where usable).

    x: [n, k] float32 (C-contiguous); w: [m, k] bf16 bits with usable(m, k); out: [n, m]
    float32 (any strides); work: [workers, worker_floats(k)] float32, one area per worker
    (its first dimension is the parallelism).
    """
    _gemm(x, w, out, work, AMX)


def gemm_ref(x, w, out, work):
    """numpy reference of gemm: x rounded to bf16 (nearest even), the product in float64."""
    xb = to_f32(to_storage(x, BF16), BF16).astype(np.float64)
    out[:] = (xb @ to_f32(w, BF16).T.astype(np.float64)).astype(np.float32)
