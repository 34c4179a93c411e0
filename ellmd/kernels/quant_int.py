"""Row dot products of GGUF block weights in integers: the code generation of rows_vnni.

Where the CPU has AVX512-VNNI (or, for int16, AVX2), rows_vnni multiplies the codes of every
block type in integers by quantized activations (quant.quantize_activations): to int16 with
vpdpwssd (AVX2: vpmaddwd + vpaddd) on the "int16" path (the default; one scale per 256 values,
~1e-4 of a product, SmolLM2's logits within 2.5e-4 of the reference and its greedy text
unchanged), or, one scale per 32 values, to int8 with vpdpbusd on the "vnni" path (as
llama.cpp's q8 x q8; ~1% of a product, which moves SmolLM2's logits by a few percent and changes
some greedy answers, so it is asked for). rows_vnni serves decode and prefill alike
(matmul._linear_int tiles prefill's rows over rows_vnni_depth_first, the same sums taken depth
chunk by depth chunk), and sums an input row in one order whatever rows share its pass: a token's
numbers do not depend on the chunk or the batch it comes in.
The kernels are LLVM IR written at compile time (intrinsics): the instructions, the register
blocking and the order of the sums are spelled out, not left to the vectorizer.
"""

import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ellmd.kernels import cpu, tile
from ellmd.kernels.quant import BLOCK_DTYPES, BLOCK_SIZES, PREFETCH, VNNI_BLOCKS, as_bytes, dequantize, record_name

binding.initialize_native_asmparser()  # numba's object emitter then takes inline assembly (_dot_words)


# ---- numba: the integer paths (vpdpbusd, vpdpwssd or AVX2 vpmaddwd) ----------------------------
#
# As llama.cpp's q8 x q8: the activations are quantized per block of 32 values
# (quantize_activations), to int8 for vpdpbusd (unsigned x signed bytes: 32 products summed by
# fours into 8 int32 lanes) or to int16 for vpdpwssd (signed words: 32 products summed by pairs
# into 16 int32 lanes). A group of 32 weights is a vector of unsigned codes c whose values are
# a * c + b (a and b per 16 values), so with the activations' scale dx and code sums per 16 (xs)
#   sum(w * x) = dx * (a * sum(c * xq) + b * sum(xq))
# and every offset (Q8_0's sign flip, Q4_0's -8, Q6_K's -32) and every min is the exact b term.
# Rounding x to int8 costs ~1% of a product (rms), to int16 ~1e-4 of that.
# int16 activations share one scale per 256 values where the width allows (activation_group):
# then a K-quant super-block's 6- or 8-bit sub-block scales multiply its codes in int16
# (vpmullw), its 8 groups sum in int32, and one float step per super-block remains (the
# per-group float scaling cost more than the products). Every kernel streams its rows with
# software prefetches PREFETCH bytes ahead. rows_vnni unpacks a weight row's blocks (codes,
# scales; the int16 K-quants' scaled codes) once for a pass of up to 8 input rows (ROW_PASSES):
# one row at a time, the unpacking was redone for each, and n rows cost n times one.


def rows_vnni_ref(xq, xd, xs, w, out, j0, j1):
    """numpy reference of rows_vnni: the dequantized activations times the dequantized blocks."""
    n, k = xq.shape
    x = (xq.astype(np.float64).reshape(n, -1, 32) * xd[..., None]).reshape(n, k)
    out[:, j0:j1] = (x @ dequantize(w[j0:j1]).astype(np.float64).T).astype(np.float32)


class _Ir:
    """IR building blocks of the integer kernels (codegen time): vectors, splats, byte reads."""

    def __init__(self, builder, data):
        self.b, self.data = builder, data  # data: the row's uint8 pointer
        self.i8, self.i32, self.f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()

    def vec(self, elem, count):
        return ir.VectorType(elem, count)

    def splat(self, value, count):
        vty = self.vec(value.type, count)
        v = self.b.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(self.i32, 0))
        return self.b.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(self.vec(self.i32, count), [0] * count))

    def const8(self, value):
        return ir.Constant(self.vec(self.i8, 32), [value] * 32)

    def ptr(self, at):
        return self.b.gep(self.data, [at])

    def bytes(self, at, count):
        return self.b.load(self.b.bitcast(self.ptr(at), self.vec(self.i8, count).as_pointer()), align=1)

    def prefetch_line(self, at):
        """Ask for the cache line of byte offset at, into L1 (a prefetch never faults)."""
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ir.VoidType(), [self.i8.as_pointer()] + [self.i32] * 3),
                                            "llvm.prefetch.p0")
        self.b.call(fn, [self.ptr(at), ir.Constant(self.i32, 0), ir.Constant(self.i32, 3), ir.Constant(self.i32, 1)])

    def prefetch(self, at, size):
        """Ask for the cache lines of the size bytes PREFETCH past byte offset at (past the row's end
        is fine: it is the next row's start)."""
        for line in range(0, size, 64):
            self.prefetch_line(self.b.add(at, ir.Constant(at.type, PREFETCH + line)))

    def prefetch_span(self, at, size):
        """Ask for every cache line of bytes [at, at + size) (size a runtime value)."""
        with cgutils.for_range_slice(self.b, ir.Constant(at.type, 0), size, ir.Constant(at.type, 64)) as (line, _):
            self.prefetch_line(self.b.add(at, line))

    def byte(self, at):
        return self.b.zext(self.b.load(self.ptr(at)), self.i32)

    def f16(self, at):
        """The f16 at byte offset at, as f32, converted from an integer register (movzwl, opaque to LLVM,
        then vmovd, which writes the whole vector register): LLVM loads a half with vpinsrw, which merges
        into the register's old value, and when that was the last block's scale the false dependency
        chained a row's blocks (Q4_0 at 0.6x)."""
        word = self.b.asm(ir.FunctionType(self.i32, [self.i8.as_pointer()]), "movzwl ($1), $0", "=r,r",
                          [self.ptr(at)], side_effect=False, name="load_word")
        pair = self.b.fpext(self.b.bitcast(word, self.vec(ir.HalfType(), 2)), self.vec(self.f32, 2))
        return self.b.extract_element(pair, ir.Constant(self.i32, 0))

    def u32(self, at):
        return self.b.load(self.b.bitcast(self.ptr(at), self.i32.as_pointer()), align=1)

    def nibbles(self, at):
        """16 bytes -> their 32 nibbles as bytes: the low ones, then the high ones (Q4_0's order)."""
        raw = self.bytes(at, 16)
        lo = self.b.and_(raw, ir.Constant(raw.type, [15] * 16))
        hi = self.b.lshr(raw, ir.Constant(raw.type, [4] * 16))
        return self.b.shuffle_vector(lo, hi, ir.Constant(self.vec(self.i32, 32), list(range(32))))

    def bit4(self, word):
        """An i32 -> 32 bytes, byte l = bit l of the word << 4 (the fifth bit of Q5 codes)."""
        bits = self.b.zext(self.b.bitcast(word, self.vec(ir.IntType(1), 32)), self.vec(self.i8, 32))
        return self.b.shl(bits, self.const8(4))

    def field(self, v, shift, mask, to):
        """((v >> shift) & mask) << to, bytewise (a vector of any count)."""

        def splat(value):
            return ir.Constant(v.type, [value] * v.type.count)
        return self.b.shl(self.b.and_(self.b.lshr(v, splat(shift)), splat(mask)), splat(to))


def _ir_scale_min_k4(q, s, j):
    """IR of the 6-bit scale and min of sub-block j (constant) from the 12 scale bytes at s."""
    b, c = q.b, lambda v: ir.Constant(q.i32, v)

    def byte(offset):
        return q.byte(b.add(s, ir.Constant(s.type, offset)))

    if j < 4:
        sc, mn = b.and_(byte(j), c(63)), b.and_(byte(j + 4), c(63))
    else:
        lo, top, top_m = byte(j + 4), byte(j - 4), byte(j)
        sc = b.or_(b.and_(lo, c(15)), b.shl(b.lshr(top, c(6)), c(4)))
        mn = b.or_(b.lshr(lo, c(4)), b.shl(b.lshr(top_m, c(6)), c(4)))
    return b.uitofp(sc, q.f32), b.uitofp(mn, q.f32)


def _group(name, q, o, g):
    """Group g of the block at byte offset o: (32 unsigned codes, offset, a_lo, a_hi, m), values
    a * (code - offset) + m, a of the first and of the second 16 values, m None for no min."""
    b = q.b

    def at(v):
        return b.add(o, ir.Constant(o.type, v))

    if name == "Q8_0":  # int8 codes: the sign bit flipped
        d = q.f16(o)
        return b.xor(q.bytes(at(2), 32), q.const8(0x80)), 128, d, d, None
    if name in ("Q4_0", "Q4_1"):
        d, one = q.f16(o), name == "Q4_1"
        return q.nibbles(at(4 if one else 2)), 0 if one else 8, d, d, q.f16(at(2)) if one else None
    if name in ("Q5_0", "Q5_1"):
        d, one = q.f16(o), name == "Q5_1"
        codes = b.or_(q.nibbles(at(8 if one else 6)), q.bit4(q.u32(at(4 if one else 2))))
        return codes, 0 if one else 16, d, d, q.f16(at(2)) if one else None
    if name in ("Q4_K", "Q5_K"):
        sc, mn = _ir_scale_min_k4(q, at(4), g)
        a, m = b.fmul(q.f16(o), sc), b.fneg(b.fmul(q.f16(at(2)), mn))
        qs = q.bytes(at((16 if name == "Q4_K" else 48) + 32 * (g // 2)), 32)
        codes = q.field(qs, 4 * (g % 2), 15, 0)
        if name == "Q5_K":
            codes = b.or_(codes, q.field(q.bytes(at(16), 32), g, 1, 4))
        return codes, 0, a, a, m
    half, part = divmod(g, 4)  # Q6_K: values 128 * half + 32 * part + l, a scale per 16
    ql = q.bytes(at(64 * half + 32 * (part % 2)), 32)
    codes = b.or_(q.field(ql, 4 * (part // 2), 15, 0), q.field(q.bytes(at(128 + 32 * half), 32), 2 * part, 3, 4))
    d = q.f16(at(208))
    a_lo, a_hi = (b.fmul(d, b.sitofp(b.load(q.ptr(at(192 + 8 * half + 2 * part + s))), q.f32)) for s in (0, 1))
    return codes, 32, a_lo, a_hi, None


def _k4_scale_bytes(q, o):
    """The 8 six-bit scales and the 8 mins of a Q4_K/Q5_K super-block at byte offset o, as two
    <8 x i8> vectors."""
    b = q.b
    raw = q.bytes(b.add(o, ir.Constant(o.type, 4)), 16)  # 12 scale bytes (and 4 code bytes)

    def pick(*index):
        return b.shuffle_vector(raw, raw, ir.Constant(q.vec(q.i32, 8), list(index)))

    def c8(v):
        return ir.Constant(q.vec(q.i8, 8), [v] * 8)

    first = ir.Constant(q.vec(ir.IntType(1), 8), [j < 4 for j in range(8)])
    low, top = pick(0, 1, 2, 3, 8, 9, 10, 11), pick(0, 1, 2, 3, 0, 1, 2, 3)
    sc = b.select(first, b.and_(low, c8(63)), b.or_(b.and_(low, c8(15)), b.shl(b.lshr(top, c8(6)), c8(4))))
    low, top = pick(4, 5, 6, 7, 8, 9, 10, 11), pick(4, 5, 6, 7, 4, 5, 6, 7)
    mn = b.select(first, b.and_(low, c8(63)), b.or_(b.lshr(low, c8(4)), b.shl(b.lshr(top, c8(6)), c8(4))))
    return sc, mn


def _k_words(name, q, o, g):
    """Group g (32 values) of the K-quant super-block at byte offset o as <32 x i16> signed codes
    (Q6_K's offset 32 taken off), and the index of its scale for each of the 32 values. Codes are
    cut from their bytes on 256-bit vectors, then widened: a 512-bit shift would take the port
    the multiplies need."""
    b = q.b

    def at(v):
        return b.add(o, ir.Constant(o.type, v))

    w16 = q.vec(ir.IntType(16), 32)
    if name == "Q6_K":
        half, part = divmod(g, 4)  # values 128 * half + 32 * part + l, a scale per 16
        codes = b.or_(q.field(q.bytes(at(64 * half + 32 * (part % 2)), 32), 4 * (part // 2), 15, 0),
                      q.field(q.bytes(at(128 + 32 * half), 32), 2 * part, 3, 4))
        codes = b.sub(b.zext(codes, w16), ir.Constant(w16, [32] * 32))
        return codes, [8 * half + 2 * part + (l >= 16) for l in range(32)]
    codes = q.field(q.bytes(at((16 if name == "Q4_K" else 48) + 32 * (g // 2)), 32), 4 * (g % 2), 15, 0)
    if name == "Q5_K":
        codes = b.or_(codes, q.field(q.bytes(at(16), 32), g, 1, 4))
    return b.zext(codes, w16), [g] * 32


WORDS_VNNI = bool(binding.get_host_cpu_features().get("avx512vnni"))  # else the int16 path runs on AVX2


def broadcasts_pairs() -> bool:
    """True where _dot_words takes a pair's address for vpdpwssd to broadcast (AVX512-VNNI): for a
    pair that meets one vector of codes, a broadcast instruction less."""
    return WORDS_VNNI


def _dot_words(b, acc, a, x):
    """acc + the pairwise products of a and x (<16 x i32> each, as 32 int16; AVX2: or <8 x i32>),
    exact int32 sums. With AVX512-VNNI the instruction vpdpwssd itself (LLVM would otherwise split
    it into vpmaddwd and vpaddd: two uops); on AVX2, vpmaddwd and vpaddd on each 256-bit half.
    With AVX512-VNNI, x may also be (an i8 pointer, a constant byte offset) of one int32 that
    vpdpwssd broadcasts itself (broadcasts_pairs)."""
    if isinstance(x, tuple):
        base, offset = x
        return b.asm(ir.FunctionType(acc.type, [acc.type, acc.type, base.type]), f"vpdpwssd {offset}($3){{1to16}}, $2, $0",
                     "=v,0,v,r", [acc, a, base], side_effect=False, name="dpwssd_from")
    if WORDS_VNNI:
        return b.asm(ir.FunctionType(acc.type, [acc.type] * 3), "vpdpwssd $3, $2, $0", "=v,0,v,v", [acc, a, x],
                     side_effect=False, name="dpwssd")
    i32 = ir.IntType(32)
    words, pairs = ir.VectorType(ir.IntType(16), 16), ir.VectorType(i32, 8)
    madd = cgutils.get_or_insert_function(b.module, ir.FunctionType(pairs, [words, words]), "llvm.x86.avx2.pmadd.wd")
    if acc.type.count == 8:
        return b.add(acc, b.call(madd, [b.bitcast(a, words), b.bitcast(x, words)]))
    halves = []
    for h in (0, 8):
        pick = ir.Constant(ir.VectorType(i32, 8), list(range(h, h + 8)))
        a_h, x_h = (b.bitcast(b.shuffle_vector(v, v, pick), words) for v in (a, x))
        halves.append(b.add(b.shuffle_vector(acc, acc, pick), b.call(madd, [a_h, x_h])))
    return b.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(i32, 16), list(range(16))))


def _k_scales(name, q, o):
    """The float scales of the K-quant super-block at byte offset o, for every input row to share:
    (scales, mins), scales times d (Q6_K: 16, one per 16 values; else 8, one per 32), mins times
    -dmin (8), None for Q6_K."""
    b = q.b
    d = q.f16(b.add(o, ir.Constant(o.type, 208 if name == "Q6_K" else 0)))
    if name == "Q6_K":  # 16 signed 8-bit scales
        sc = b.sitofp(q.bytes(b.add(o, ir.Constant(o.type, 192)), 16), q.vec(q.f32, 16))
        return b.fmul(sc, q.splat(d, 16)), None
    sc, mn = _k4_scale_bytes(q, o)
    f8 = q.vec(q.f32, 8)
    dmin = b.fneg(q.f16(b.add(o, ir.Constant(o.type, 2))))
    return b.fmul(b.uitofp(sc, f8), q.splat(d, 8)), b.fmul(b.uitofp(mn, f8), q.splat(dmin, 8))


def _k_row_scales(q, scales, mins, dxv, xsv):
    """One input row's (scales, bias) from _k_scales: scales[l] of value l * 16 of the block times
    the row's activation scale (dxv: the 8 of the block), bias the vector whose lane sum is the
    block's min term (xsv: the 16 code sums); None for no min."""
    b = q.b
    every = ir.Constant(q.vec(q.i32, 16), [l // 2 for l in range(16)])
    if mins is None:
        return b.fmul(scales, b.shuffle_vector(dxv, dxv, every)), None
    scales = b.fmul(scales, dxv)
    pairs = [b.shuffle_vector(xsv, xsv, ir.Constant(q.vec(q.i32, 8), list(range(h, 16, 2)))) for h in (0, 1)]
    sums = b.fadd(*pairs)  # code sums per 32 (exact)
    return b.shuffle_vector(scales, scales, every), b.fmul(b.fmul(mins, dxv), sums)


# block type -> (bytes per block, groups of 32 values per block)
_INT_BLOCKS = {name: (BLOCK_DTYPES[name].itemsize, BLOCK_SIZES[name] // 32) for name in VNNI_BLOCKS}


def _make_rows_vnni(name):
    @intrinsic
    def rows_vnni(typingctx, wb, xq, xd, xs, out, j, b0, b1, add):
        """out[:, j] = (or, with add, +=) blocks [b0, b1) of block row wb (bytes) times every
        quantized activation row."""
        if not (isinstance(wb, types.Array) and wb.dtype == types.uint8 and wb.ndim == 1):
            return None
        if not (isinstance(xq, types.Array) and xq.dtype in (types.int8, types.int16)):
            return None
        wide = xq.dtype == types.int16
        codegen = cpu.compiled_for("int16" if wide else "vnni", _rows_vnni_codegen(name, wide))
        return types.void(wb, xq, xd, xs, out, types.intp, types.intp, types.intp, types.boolean), codegen

    return rows_vnni


def _group_words(q, codes, offset, wide):
    """A group's 32 codes as the weight operand of _dot_group: the unsigned bytes (int8 path), or
    signed words, the codes less their offset (int16 path)."""
    if not wide:
        return codes
    w16 = q.vec(ir.IntType(16), 32)
    return q.b.sub(q.b.zext(codes, w16), ir.Constant(w16, [offset] * 32))


def _dot_group(q, xq_a, xi, words, wide):
    """int32 lanes of sum(code * xq) over one group (words: _group_words): vpdpbusd (int8 x,
    unsigned codes), or vpdpwssd (int16 x, signed words)."""
    b = q.b
    lanes = 16 if wide else 8
    i32v = q.vec(q.i32, lanes)
    zero = ir.Constant(i32v, [0] * lanes)
    xt = q.vec(ir.IntType(16) if wide else q.i8, 32)
    xv = b.load(b.bitcast(b.gep(xq_a.data, [xi]), xt.as_pointer()), align=1)
    if wide:
        return _dot_words(b, zero, b.bitcast(words, i32v), b.bitcast(xv, i32v))
    dp = cgutils.get_or_insert_function(b.module, ir.FunctionType(i32v, [i32v] * 3), "llvm.x86.avx512.vpdpbusd.256")
    return b.call(dp, [zero, b.bitcast(words, i32v), b.bitcast(xv, i32v)])


def _bias(q, xs_at, offset, a, m, wide):
    """sum(xq) times the b term of a block (values a * code + b), None when it has none; the
    int16 path has the offsets in its signed codes, the int8 path needs them here."""
    b = q.b
    terms = [m] if m is not None else []
    if offset and not wide:
        terms.append(b.fmul(a, ir.Constant(q.f32, -float(offset))))
    if not terms:
        return None
    total = b.fadd(b.load(xs_at(0)), b.load(xs_at(1)))  # exact: |sum| < 2^21
    return b.fmul(terms[0] if len(terms) == 1 else b.fadd(*terms), total)


# input rows that share one unpacking of a weight row's blocks (codes, scales), largest first: passes
# of 8 rows where 32 vector registers hold their sums (prefill's GEMM), of 4 on AVX2's 16, then at
# most one of 2 and one of 1 for the rest
ROW_PASSES = (8, 4, 2, 1) if WORDS_VNNI else (4, 2, 1)


def _fma(b, a, x, y):
    """a * x + y, float32 vectors, one rounding."""
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(a.type, [a.type] * 3), f"llvm.fma.v{a.type.count}f32")
    return b.call(fn, [a, x, y])


class _RowSums:
    """One input row's sums over a weight row, in allocas (registers once LLVM promotes them): two
    vector chains of FMAs, two scalar chains of bias terms, and the int8 path's K-quant min terms;
    for one-scale blocks on int16 codes with one activation scale per 256 values, the two chains of
    the current 256 values before that scale (group_accs)."""

    def __init__(self, q, i, lanes, kbias_lanes):
        self.q, self.i, b = q, i, q.b

        def zeros(count):
            return [cgutils.alloca_once_value(b, ir.Constant(q.vec(q.f32, lanes), [0.0] * lanes)) for _ in range(count)]

        self.accs, self.group_accs = zeros(2), zeros(2)
        self.corrs = [cgutils.alloca_once_value(b, ir.Constant(q.f32, 0.0)) for _ in range(2)]
        self.kbias = cgutils.alloca_once_value(b, ir.Constant(q.vec(q.f32, kbias_lanes), [0.0] * kbias_lanes))

    def add(self, slot, value):
        self.q.b.store(self.q.b.fadd(self.q.b.load(slot), value), slot)

    def fma(self, slot, a, x):
        """slot += a * x (vectors)."""
        self.q.b.store(_fma(self.q.b, a, x, self.q.b.load(slot)), slot)

    def close_group(self, dx):
        """accs[0] += the group's sums times its activation scale dx; the group's sums back to zero."""
        b, q = self.q.b, self.q
        value = b.fadd(b.load(self.group_accs[0]), b.load(self.group_accs[1]))
        self.fma(self.accs[0], value, q.splat(dx, value.type.count))
        for slot in self.group_accs:
            b.store(ir.Constant(value.type, [0.0] * value.type.count), slot)

    def total(self):
        b, q = self.q.b, self.q
        total = tile.lane_sum(b, b.fadd(b.load(self.accs[0]), b.load(self.accs[1])))
        corr = b.fadd(b.load(self.corrs[0]), b.load(self.corrs[1]))
        return b.fadd(total, b.fadd(corr, tile.lane_sum(b, b.load(self.kbias))))


def _rows_vnni_codegen(name, wide):
    size, groups = _INT_BLOCKS[name]
    lanes = 16 if wide else 8  # lanes [0, lanes/2) hold the first 16 values of a group
    # float lanes of a one-scale group's sums: vpdpwssd's 16 converted as they are (a fold costs two
    # instructions on 512-bit registers, one less conversion and FMA gains nothing); else folded
    group_lanes = 16 if wide and WORDS_VNNI else lanes // 2

    def codegen(context, builder, signature, args):
        w_a, xq_a, xd_a, xs_a, out_a = (context.make_array(t)(context, builder, v)
                                        for t, v in zip(signature.args[:5], args[:5]))
        q = _Ir(builder, w_a.data)
        f32v = q.vec(q.f32, lanes)
        intp = context.get_value_type(types.intp)
        n, k = cgutils.unpack_tuple(builder, xq_a.shape)
        first, nb = args[6], builder.sub(args[7], args[6])  # the blocks summed: [first, first + nb)

        def c(v):
            return ir.Constant(intp, v)

        def x_at(row, blk, g):
            """Index in xq of group g of block blk, input row row."""
            at = builder.add(builder.mul(blk, c(groups)), c(g))
            return builder.add(builder.mul(row.i, k), builder.mul(at, c(32)))

        def dx_at(row, blk):
            """The activation scale of block blk of an input row."""
            return builder.load(builder.gep(xd_a.data, [builder.add(builder.mul(row.i, builder.udiv(k, c(32))), blk)]))

        def group(rows, blk, chain, shared_scale=False):
            """Block blk of a one-group type (one scale) for every row of the pass, on chain: into the
            row's sums times its activation scale, or, with shared_scale (one activation scale for
            the 8 blocks of a group of 256), its products into the group's sums before that scale
            (close_group), its min (Q4_1, Q5_1) returned for groups_of_256 (else None)."""
            o = builder.mul(blk, c(size))
            q.prefetch(o, size)
            codes, offset, a, _, m = _group(name, q, o, 0)  # one scale for the 32 values
            words = _group_words(q, codes, offset, wide)
            a_lanes = q.splat(a, group_lanes) if shared_scale else None  # shared by the rows of the pass
            for row in rows:
                dot = _dot_group(q, xq_a, x_at(row, blk, 0), words, wide)
                if dot.type.count > group_lanes:  # one scale: the halves of the lanes add up before the float conversion
                    dot = tile.fold(builder, dot)
                dot = builder.sitofp(dot, q.vec(q.f32, group_lanes))
                if shared_scale:
                    row.fma(row.group_accs[chain], dot, a_lanes)
                    continue
                dx = dx_at(row, blk)
                row.fma(row.accs[chain], dot, q.splat(builder.fmul(a, dx), group_lanes))
                s = builder.add(builder.mul(row.i, builder.udiv(k, c(16))), builder.mul(blk, c(2)))
                bias = _bias(q, lambda h: builder.gep(xs_a.data, [builder.add(s, c(h))]), offset, a, m, wide)
                if bias is not None:
                    row.add(row.corrs[chain], builder.fmul(bias, dx))
            return m

        def block_pairs(rows):
            """Blocks in pairs, one on each chain, whatever the pass (a row sums in one order)."""
            with cgutils.for_range(builder, builder.udiv(nb, c(2))) as pairs:
                for h in (0, 1):
                    group(rows, builder.add(first, builder.add(builder.mul(pairs.index, c(2)), c(h))), h)
            with builder.if_then(builder.icmp_unsigned("!=", builder.urem(nb, c(2)), c(0))):
                group(rows, builder.add(first, builder.sub(nb, c(1))), 0)

        def groups_of_256(rows):
            """As block_pairs, for int16 codes with one activation scale per 256 values: the scale
            multiplies a group's sums once, not each block's (the float steps per block, not the
            products, bounded the one-scale types)."""
            with cgutils.for_range(builder, builder.udiv(nb, c(8))) as groups_256:
                blk = builder.add(first, builder.mul(groups_256.index, c(8)))
                mins = [group(rows, builder.add(blk, c(h)), h % 2, shared_scale=True) for h in range(8)]
                if mins[0] is not None:
                    group_mins(rows, blk, mins)
                for row in rows:
                    row.close_group(dx_at(row, blk))

        def group_mins(rows, blk, mins):
            """The 8 blocks' mins times the activations' code sums per 16 values (xs), one vector
            product per input row and group of 256 (a scalar product per block cost as much as the
            blocks' products)."""
            lanes8 = ir.Constant(q.vec(q.f32, 8), ir.Undefined)
            for j, m in enumerate(mins):
                lanes8 = builder.insert_element(lanes8, m, ir.Constant(q.i32, j))
            every = ir.Constant(q.vec(q.i32, 16), [l // 2 for l in range(16)])
            mins16 = builder.shuffle_vector(lanes8, lanes8, every)  # xs holds two sums per block
            for row in rows:
                at = builder.add(builder.mul(row.i, builder.udiv(k, c(16))), builder.mul(blk, c(2)))
                xs = builder.load(builder.bitcast(builder.gep(xs_a.data, [at]), q.vec(q.f32, 16).as_pointer()), align=4)
                if group_lanes == 16:
                    row.fma(row.group_accs[0], mins16, xs)
                else:  # AVX2: the row's sums in 8 lanes
                    row.add(row.group_accs[0], tile.fold(builder, builder.fmul(mins16, xs)))

        def row_inputs(row, blk):
            """Super-block blk's 8 activation scales and 16 code sums of an input row."""
            at = builder.add(builder.mul(row.i, builder.udiv(k, c(32))), builder.mul(blk, c(8)))
            dxv = builder.load(builder.bitcast(builder.gep(xd_a.data, [at]), q.vec(q.f32, 8).as_pointer()), align=4)
            xsv = builder.load(builder.bitcast(builder.gep(xs_a.data, [builder.mul(at, c(2))]),
                                               q.vec(q.f32, 16).as_pointer()), align=4)
            return dxv, xsv

        def super_block(rows, blk):
            """K-quant super-block blk, int8 path, for every row of the pass."""
            o = builder.mul(blk, c(size))
            q.prefetch(o, size)
            block_scales = _k_scales(name, q, o)
            inputs = [row_inputs(row, blk) for row in rows]
            scaled = [_k_row_scales(q, *block_scales, dxv, xsv) for dxv, xsv in inputs]  # one per 16 values
            for g in range(groups):
                codes, offset = _group(name, q, o, g)[:2]
                index = ir.Constant(q.vec(q.i32, lanes), [2 * g + (lane >= lanes // 2) for lane in range(lanes)])
                for row, (scales, _) in zip(rows, scaled):
                    dot = _dot_group(q, xq_a, x_at(row, blk, g), codes, wide)
                    row.fma(row.accs[g % 2], builder.sitofp(dot, f32v), builder.shuffle_vector(scales, scales, index))
            for row, (scales, bias), (_, xsv) in zip(rows, scaled, inputs):
                if name == "Q6_K":  # the codes' offset 32, on int8 activations
                    bias = builder.fmul(builder.fmul(scales, xsv),
                                        q.splat(ir.Constant(q.f32, -32.0), 16))
                if bias is not None:
                    row.add(row.kbias, bias)

        def super_block_words(rows, blk):
            # int16 activations share one scale per super-block (activation_group): the sub-block
            # scales multiply the codes in int16 and the 8 groups sum in int32 (|sum| < 2^30); per
            # input row, one conversion, the block's scale and mins (shared by the rows of the pass),
            # then one FMA by the activation scale, in vpdpwssd's 16 lanes (8 on AVX2)
            o = builder.mul(blk, c(size))
            q.prefetch(o, size)
            w16, i32v = q.vec(ir.IntType(16), 32), q.vec(q.i32, 16)
            if name == "Q6_K":
                scales = builder.sext(q.bytes(builder.add(o, c(192)), 16), q.vec(ir.IntType(16), 16))
            else:
                scales, mins = _k4_scale_bytes(q, o)
                scales = builder.zext(scales, q.vec(ir.IntType(16), 8))
                mins = builder.shuffle_vector(mins, mins, ir.Constant(q.vec(q.i32, 16), [l // 2 for l in range(16)]))
                dmin = builder.fneg(q.f16(builder.add(o, c(2))))
                mins = builder.fmul(builder.uitofp(mins, f32v), q.splat(dmin, 16))
            width = 16 if WORDS_VNNI else 8  # vpdpwssd accumulates in its 16 lanes
            d = q.splat(q.f16(builder.add(o, c(208 if name == "Q6_K" else 0))), width)
            chains = 2 if len(rows) == 1 else 1  # int32 sums per input row
            sums = [[ir.Constant(q.vec(q.i32, width), [0] * width)] * chains for _ in rows]
            for g in range(groups):
                codes, index = _k_words(name, q, o, g)
                scale = builder.shuffle_vector(scales, scales, ir.Constant(q.vec(q.i32, 32), index))
                product = builder.bitcast(builder.mul(codes, scale), i32v)
                for row, row_sums in zip(rows, sums):
                    xv = builder.bitcast(builder.gep(xq_a.data, [x_at(row, blk, g)]), w16.as_pointer())
                    xv, h = builder.bitcast(builder.load(xv, align=1), i32v), g % chains
                    if WORDS_VNNI:
                        row_sums[h] = _dot_words(builder, row_sums[h], product, xv)
                    else:
                        dot = _dot_words(builder, ir.Constant(i32v, [0] * 16), product, xv)
                        row_sums[h] = builder.add(row_sums[h], tile.fold(builder, dot))
            for row, row_sums in zip(rows, sums):
                dxv, xsv = row_inputs(row, blk)
                total = row_sums[0] if chains == 1 else builder.add(*row_sums)
                scaled = builder.fmul(builder.sitofp(total, q.vec(q.f32, width)), d)
                if name != "Q6_K":  # the mins times the code sums per 16 of the activations
                    scaled = _fma(builder, mins, xsv, scaled) if width == 16 else builder.fadd(
                        scaled, tile.fold(builder, builder.fmul(mins, xsv)))
                row.fma(row.accs[0], scaled, q.splat(builder.extract_element(dxv, ir.Constant(q.i32, 0)), width))

        def rows_pass(i0, together):
            row_lanes = group_lanes if groups == 1 else 16 if wide and WORDS_VNNI else 8
            rows = [_RowSums(q, builder.add(i0, c(r)), row_lanes, 16 if name == "Q6_K" else 8)
                    for r in range(together)]
            if groups == 1 and wide:  # one activation scale per 256 values where the width allows (activation_group)
                with builder.if_else(builder.icmp_unsigned("==", builder.urem(k, c(256)), c(0))) as (by_256, by_32):
                    with by_256:
                        groups_of_256(rows)
                    with by_32:
                        block_pairs(rows)
            elif groups == 1:
                block_pairs(rows)
            else:
                with cgutils.for_range(builder, nb) as blocks:
                    (super_block_words if wide else super_block)(rows, builder.add(first, blocks.index))
            st0, st1 = cgutils.unpack_tuple(builder, out_a.strides)  # out may be a column slice
            for row in rows:
                ptr = builder.gep(builder.bitcast(out_a.data, q.i8.as_pointer()),
                                  [builder.add(builder.mul(row.i, st0), builder.mul(args[5], st1))])
                ptr = builder.bitcast(ptr, q.f32.as_pointer())
                total = row.total()
                builder.store(builder.select(args[8], builder.fadd(builder.load(ptr), total), total), ptr)

        done = cgutils.alloca_once_value(builder, c(0))  # input rows summed
        for together in ROW_PASSES:
            start = builder.load(done)
            passes = builder.udiv(builder.sub(n, start), c(together))
            with cgutils.for_range(builder, passes) as loop:
                rows_pass(builder.add(start, builder.mul(loop.index, c(together))), together)
            builder.store(builder.add(start, builder.mul(passes, c(together))), done)
        return context.get_dummy_value()

    return codegen


_ROWS_VNNI = {name: _make_rows_vnni(name) for name in _INT_BLOCKS}
# numba's fastmath flags every float instruction of a function, an intrinsic's IR included; with
# reassoc, LLVM reordered the int8 path's K-quant sums by the rows of a pass (the last bits of a
# row differed alone and in a batch), so the row kernels are compiled without it
FASTMATH_IN_ORDER = {"nnan", "ninf", "nsz", "contract", "afn", "arcp"}


# values of a weight row summed at a time (a depth chunk): a row's total is the chunks' totals added
# in order, so that the GEMM (rows_vnni_depth_first) can keep a pass's activations of one chunk in
# L1 across its weight rows (8 x 2,048 int16: 32 KB). At k = 6,144 a pass's 98 KB came from L2 for
# every weight row, and the down projection ran at 0.65x the rate of k = 2,048 (Xeon model 207).
INT_DEPTH = 2048


def rows_vnni(xq, xd, xs, w, out, j0, j1):
    """out[:, j0:j1] = x @ w[j0:j1].T for w in a VNNI_BLOCKS type, x given quantized
    (quantize_activations): xq [n, k] int8 (vpdpbusd) or int16 (vpdpwssd), xd [n, k/32] float32,
    xs [n, k/16] float32, all C-contiguous; out: [n, m] float32, any layout. int8 needs
    AVX512-VNNI (the "vnni" path of cpu.py), int16 AVX512-VNNI or AVX2 (the "int16" path).
    Weight row by weight row (decode: each row streamed once)."""
    raise NotImplementedError("numba only")


def rows_vnni_depth_first(xq, xd, xs, w, out, j0, j1):
    """rows_vnni, to the bit, depth chunk by depth chunk over the weight rows (prefill's tiles: the
    chunk's activations stay in L1)."""
    raise NotImplementedError("numba only")


def _rows_vnni_impl(w, depth_first):
    name = record_name(w.dtype)
    if name not in _ROWS_VNNI:
        return None
    row_kernel, depth = _ROWS_VNNI[name], INT_DEPTH // BLOCK_SIZES[name]

    def impl(xq, xd, xs, w, out, j0, j1):
        wb, nb = as_bytes(w), w.shape[1]
        chunks = (nb + depth - 1) // depth
        for t in range((j1 - j0) * chunks):
            j, c = (j0 + t % (j1 - j0), t // (j1 - j0)) if depth_first else (j0 + t // chunks, t % chunks)
            row_kernel(wb[j], xq, xd, xs, out, j, c * depth, min(nb, c * depth + depth), c > 0)

    return impl


@overload(rows_vnni, jit_options={"fastmath": FASTMATH_IN_ORDER, "nogil": True})
def _rows_vnni_overload(xq, xd, xs, w, out, j0, j1):
    return _rows_vnni_impl(w, False)


@overload(rows_vnni_depth_first, jit_options={"fastmath": FASTMATH_IN_ORDER, "nogil": True})
def _rows_vnni_depth_first_overload(xq, xd, xs, w, out, j0, j1):
    return _rows_vnni_impl(w, True)


# ---- q8_0 keys of the KV cache (kv_blocks.py): attention scores on integer dot products ----------


# keys ahead whose blocks the key and value kernels ask for (past the tile's end: the next tile's,
# which follow in memory): a decode step reads every layer's KV from memory, where the hardware
# prefetcher alone left the two kernels at 7-8 GB/s a core (15 with the blocks in cache)
KEYS_AHEAD = 16  # (Xeon model 167, 28 layers' q8_0 KV at 8k from memory: 8 and 32 slower, L2 hints too)
KEY_GROUP = 4  # keys whose int32 lanes are added up together (_lane_sums): a third of the shuffles


def _lane_sums(b, vectors):
    """The lane sums of 4 <16 x i32> vectors as one <4 x i32>, halves folded pairwise across the
    vectors (15 shuffles and adds where 4 tile.lane_sum take 36; integer sums: exact in any order)."""

    def fold(x, y, width):
        """Lanes of x then y in groups of `width`: each group's halves added (half the lanes)."""
        lo = [g + i for g in range(0, x.type.count + y.type.count, width) for i in range(width // 2)]
        pick = [ir.Constant(ir.VectorType(ir.IntType(32), len(lo)), [i + o for i in lo]) for o in (0, width // 2)]
        return b.add(b.shuffle_vector(x, y, pick[0]), b.shuffle_vector(x, y, pick[1]))

    def fold_one(x, width):
        return fold(*(b.shuffle_vector(x, x, ir.Constant(ir.VectorType(ir.IntType(32), x.type.count // 2), list(
            range(h, h + x.type.count // 2)))) for h in (0, x.type.count // 2)), width)

    four = fold(fold(vectors[0], vectors[1], 16), fold(vectors[2], vectors[3], 16), 8)  # [a, b, c, d], 4 lanes each
    return fold_one(fold_one(four, 4), 2)


def _key_scores_codegen(values):
    """Codegen of key_scores over key blocks of `values` codes (32 or 64): keys in groups of
    KEY_GROUP (the rest one by one), each group's codes widened to int16 once (vpmovsxbw) per block
    for every query row; per (query row, key, block) the exact int32 sum of codes x query codes
    (vpdpwssd, or vpmaddwd on AVX2; the lanes of a group's keys added together), then one float
    step, score = fma(sum, key scale x query scale, score), blocks in order."""
    size, groups = 2 + values, values // 32

    def codegen(context, builder, signature, args):
        qc_a, qd_a, head_a, _, _, _, out_a = (context.make_array(t)(context, builder, v) if isinstance(t, types.Array)
                                              else None for t, v in zip(signature.args, args))
        t0, nk, rows = args[3:6]
        intp = context.get_value_type(types.intp)
        i8p, f32 = ir.IntType(8).as_pointer(), ir.FloatType()
        i32v, w16 = ir.VectorType(ir.IntType(32), 16), ir.VectorType(ir.IntType(16), 32)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")

        def c(v):
            return ir.Constant(intp, v)

        hd = cgutils.unpack_tuple(builder, qc_a.shape)[1]
        nbq = cgutils.unpack_tuple(builder, qd_a.shape)[1]
        nb = cgutils.unpack_tuple(builder, head_a.shape)[1]
        row_bytes = cgutils.unpack_tuple(builder, head_a.strides)[0]
        out_st = cgutils.unpack_tuple(builder, out_a.strides)
        heads, outb = builder.bitcast(head_a.data, i8p), builder.bitcast(out_a.data, i8p)

        def out_at(r, j):
            at = builder.add(builder.mul(r, out_st[0]), builder.mul(j, out_st[1]))
            return builder.bitcast(builder.gep(outb, [at]), f32.as_pointer())

        def keys(j0, count):
            """The scores of keys j0..j0+count (count 1 or KEY_GROUP) for every query row."""
            js = [builder.add(j0, c(k)) for k in range(count)]
            rows_of = [_Ir(builder, builder.gep(heads, [builder.mul(builder.add(t0, j), row_bytes)])) for j in js]
            rows_of[0].prefetch_span(builder.mul(c(KEYS_AHEAD), row_bytes), builder.mul(c(count), row_bytes))
            with cgutils.for_range(builder, rows) as each:
                for j in js:
                    builder.store(ir.Constant(f32, 0.0), out_at(each.index, j))
            with cgutils.for_range(builder, nb) as blocks:
                blk = blocks.index
                o = builder.mul(blk, c(size))
                dks = [q.f16(o) for q in rows_of]
                words = [[builder.bitcast(builder.sext(q.bytes(builder.add(o, c(2 + 32 * g)), 32), w16), i32v)
                          for g in range(groups)] for q in rows_of]
                with cgutils.for_range(builder, rows) as each:
                    r = each.index
                    x0 = builder.add(builder.mul(r, hd), builder.mul(blk, c(values)))
                    xs = [builder.bitcast(builder.load(builder.bitcast(builder.gep(qc_a.data, [builder.add(x0, c(32 * g))]),
                                                                       w16.as_pointer()), align=2), i32v)
                          for g in range(groups)]
                    lanes = []
                    for key_words in words:
                        total = ir.Constant(i32v, [0] * 16)
                        for kw, xv in zip(key_words, xs):
                            total = _dot_words(builder, total, kw, xv)
                        lanes.append(total)
                    if count == 1:
                        sums = [tile.lane_sum(builder, lanes[0])]
                    else:
                        four = _lane_sums(builder, lanes)
                        sums = [builder.extract_element(four, ir.Constant(ir.IntType(32), k)) for k in range(count)]
                    dq = builder.load(builder.gep(qd_a.data, [builder.add(builder.mul(r, nbq), blk)]))
                    for j, dk, isum in zip(js, dks, sums):
                        ptr = out_at(r, j)
                        scale = builder.fmul(dk, dq)
                        builder.store(builder.call(fma, [builder.sitofp(isum, f32), scale, builder.load(ptr)]), ptr)

        grouped = builder.udiv(nk, c(KEY_GROUP))
        with cgutils.for_range(builder, grouped) as each:
            keys(builder.mul(each.index, c(KEY_GROUP)), KEY_GROUP)
        with cgutils.for_range_slice(builder, builder.mul(grouped, c(KEY_GROUP)), nk, c(1)) as (j, _):
            keys(j, 1)
        return context.get_dummy_value()

    return codegen


@intrinsic
def key_scores(typingctx, qc, qd, head, t0, nk, rows, out):
    """out[r, j] = score of query row r < rows and key t0 + j < t0 + nk of a head of q8_0 blocks:
    the sum over the key's blocks, in order, of (int32 sum of key codes x query codes) x (key scale x
    query scale). qc: [>= rows, hd] int16 query codes, qd: [>= rows, >= blocks] float32 their scales
    (one per key block: kv_blocks.quantize_queries), both C-contiguous; head: [S, blocks] q8_0 block
    records (kv_blocks.py), C-contiguous; out: [>= rows, >= nk] float32, any layout. Each score is
    computed alone (no sum depends on the rows or keys beside it): prefill and decode, which share
    this kernel, give a token's scores to the bit. Needs the "int16" path's features (cpu.py)."""
    if not (isinstance(head, types.Array) and isinstance(head.dtype, types.Record) and head.layout == "C"):
        return None
    if not (isinstance(qc, types.Array) and qc.dtype == types.int16 and qc.layout == "C"):
        return None
    values = head.dtype.size - 2  # a q8_0 block: an f16 scale, then one byte a code
    sig = types.void(qc, qd, head, types.intp, types.intp, types.intp, out)
    return sig, cpu.compiled_for("int16", _key_scores_codegen(values))


# query rows that share one conversion of a tile's value codes (value_sums), largest first: a pass
# holds its rows' sums of one block in registers (4 rows x 64 values: 16 of AVX-512's 32)
VALUE_PASSES = (4, 3, 2, 1) if WORDS_VNNI else (2, 1)


def _value_sums_codegen(values):
    """Codegen of value_sums over value blocks of `values` codes (32 or 64)."""
    size, strips = 2 + values, values // 16
    f16v = ir.VectorType(ir.FloatType(), 16)

    def codegen(context, builder, signature, args):
        p_a, head_a, acc_a = (context.make_array(t)(context, builder, v)
                              for t, v in zip(signature.args[:3], args[:3]))
        rows, nk = args[3], args[4]
        intp = context.get_value_type(types.intp)
        i8p, f32 = ir.IntType(8).as_pointer(), ir.FloatType()
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f16v, [f16v] * 3), "llvm.fma.v16f32")

        def c(v):
            return ir.Constant(intp, v)

        p_st = cgutils.unpack_tuple(builder, p_a.strides)
        acc_st = cgutils.unpack_tuple(builder, acc_a.strides)
        nb = cgutils.unpack_tuple(builder, head_a.shape)[1]
        row_bytes = cgutils.unpack_tuple(builder, head_a.strides)[0]
        heads, pb, accb = builder.bitcast(head_a.data, i8p), builder.bitcast(p_a.data, i8p), builder.bitcast(acc_a.data, i8p)

        def rows_pass(r0, together, blk):
            """Block blk of the values for rows r0..r0+together: their sums over the tile's keys in
            registers, then added to acc."""
            zero = ir.Constant(f16v, [0.0] * 16)
            sums = [[cgutils.alloca_once_value(builder, zero) for _ in range(strips)] for _ in range(together)]
            o = builder.mul(blk, c(size))
            first = builder.and_(builder.icmp_unsigned("==", r0, c(0)), builder.icmp_unsigned("==", blk, c(0)))
            with cgutils.for_range(builder, nk) as keys:
                j = keys.index
                q = _Ir(builder, builder.gep(heads, [builder.mul(j, row_bytes)]))
                with builder.if_then(first):  # the tile's first pass over its keys asks for those ahead
                    q.prefetch_span(builder.mul(c(KEYS_AHEAD), row_bytes), row_bytes)
                dv = q.f16(o)
                codes = [builder.sitofp(builder.sext(q.bytes(builder.add(o, c(2 + 16 * s)), 16), q.vec(q.i32, 16)), f16v)
                         for s in range(strips)]
                for r in range(together):
                    at = builder.add(builder.mul(builder.add(r0, c(r)), p_st[0]), builder.mul(j, p_st[1]))
                    w = builder.fmul(builder.load(builder.bitcast(builder.gep(pb, [at]), f32.as_pointer())), dv)
                    w = q.splat(w, 16)
                    for s in range(strips):
                        builder.store(builder.call(fma, [w, codes[s], builder.load(sums[r][s])]), sums[r][s])
            for r in range(together):
                row = builder.mul(builder.add(r0, c(r)), acc_st[0])
                for s in range(strips):
                    col = builder.mul(builder.add(builder.mul(blk, c(values)), c(16 * s)), acc_st[1])
                    ptr = builder.bitcast(builder.gep(accb, [builder.add(row, col)]), f16v.as_pointer())
                    builder.store(builder.fadd(builder.load(sums[r][s]), builder.load(ptr, align=4)), ptr, align=4)

        done = cgutils.alloca_once_value(builder, c(0))  # rows summed
        for together in VALUE_PASSES:
            start = builder.load(done)
            passes = builder.udiv(builder.sub(rows, start), c(together))
            with cgutils.for_range(builder, passes) as each:
                r0 = builder.add(start, builder.mul(each.index, c(together)))
                with cgutils.for_range(builder, nb) as blocks:
                    rows_pass(r0, together, blocks.index)
            builder.store(builder.add(start, builder.mul(passes, c(together))), done)
        return context.get_dummy_value()

    return codegen


@intrinsic
def value_sums(typingctx, p, head, acc, rows, nk):
    """acc[r, :hd] += sum over keys j < nk of p[r, j] x value j, for rows r < rows, on q8_0 value
    blocks read as stored (head: [nk, blocks] records, C-contiguous): each key's block scale joins
    its probability (p[r, j] x scale, one float product) and the codes, converted to float32 in
    registers, are summed by FMAs over the keys in order from zero, then added to acc (the order of
    tile.gemm_tile's sums). p: [>= rows, >= nk] float32, any layout; acc: [>= rows, >= hd] float32
    with rows of contiguous values. Each row's sums are its own (prefill and decode share them)."""
    if not (isinstance(head, types.Array) and isinstance(head.dtype, types.Record) and head.layout == "C"):
        return None
    sig = types.void(p, head, acc, types.intp, types.intp)
    return sig, _value_sums_codegen(head.dtype.size - 2)
