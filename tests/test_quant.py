"""GGUF block formats: kernels on the blocks against numpy on the gguf package's dequantization.

The reference of every check is gguf.quants.dequantize of the very same blocks, so the kernels
must agree to float32 rounding whatever the quantization error.
"""

from importlib import import_module

import gguf
import numba
import numpy as np
import pytest

from ellmd.kernels.formats import BF16, F32

cpu, quant, quant_int, matmul = (import_module(f"ellmd.kernels.{name}") for name in ("cpu", "quant", "quant_int", "matmul"))

NAMES = list(quant.BLOCK_DTYPES)
K = 512  # a multiple of every block size
GGUF_QUANTIZERS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


@pytest.fixture
def rng():
    return np.random.default_rng(99)


def blocks(rng, name, rows, k=K):
    """A [rows, k] weight of block type name: quantized random values, or random blocks with
    bounded scales for the types the gguf package cannot quantize (Q5_K, Q6_K)."""
    x = rng.standard_normal((rows, k)).astype(np.float32) * 0.05
    if name in GGUF_QUANTIZERS or name == "Q4_K":
        return quant.quantize(x, name)
    dt = quant.BLOCK_DTYPES[name]
    nb = rows * k // quant.BLOCK_SIZES[name]
    w = rng.integers(0, 256, nb * dt.itemsize, dtype=np.uint8).view(dt).reshape(rows, -1)
    w["d"] = (rng.uniform(1e-3, 2e-3, w.shape)).astype(np.float16).view(np.uint16)
    if "dmin" in dt.names:
        w["dmin"] = (rng.uniform(1e-3, 2e-3, w.shape)).astype(np.float16).view(np.uint16)
    return w


def assert_f32_close(got, want):
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * scale)


def assert_int16_close(got, want):
    """Within what int16 activations cost (the "int16" path) of the exact product."""
    assert np.abs(got - want).max() < ACTIVATION_ERROR[np.int16] * np.abs(want).max()


def test_layouts_are_ggufs():
    for name, dt in quant.BLOCK_DTYPES.items():
        size, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        assert (quant.BLOCK_SIZES[name], dt.itemsize) == (size, nbytes)


@pytest.mark.parametrize("name", GGUF_QUANTIZERS)
def test_quantize_is_gguf_quantizer(rng, name):
    x = rng.standard_normal((8, K)).astype(np.float32)
    ours = quant.quantize(x, name)
    theirs = gguf.quants.quantize(x, gguf.GGMLQuantizationType[name])
    assert np.array_equal(ours.view(np.uint8).reshape(theirs.shape), theirs)


def test_q4_k_quantizer_roundtrip(rng):
    x = rng.standard_normal((16, K)).astype(np.float32)
    w = quant.quantize(x, "Q4_K")
    assert w.shape == (16, K // 256) and quant.block_name(w) == "Q4_K"
    y = quant.dequantize(w)
    # 4-bit codes over each sub-block's range (6-bit scales): error within ~a step of 32 values
    sub = x.reshape(16, -1, 32)
    step = (sub.max(axis=2) - np.minimum(sub.min(axis=2), 0)) / 15
    err = np.abs(y - x).reshape(16, -1, 32).max(axis=2)
    assert np.all(err <= 1.1 * step)
    assert np.abs(y - x).mean() < 0.1


# the largest error of a product, with the outlier channel below: int16 activations ~6e-5, int8 ~2e-2
ACTIVATION_ERROR = {np.int16: 2e-4, np.int8: 0.06}


@pytest.mark.parametrize("kernels", ["vnni", "int16", "portable"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [1, 3, 5, 6, 9, 70])  # rows_vnni takes passes of 4, 2 and 1 input rows
def test_matmul_on_blocks(rng, use_kernels, kernels, name, n):
    use_kernels(kernels)
    w = blocks(rng, name, 37)  # odd row count: the last row pair is a single row
    x = rng.standard_normal((n, K)).astype(np.float32)
    x[:, 7] *= 30.0  # an outlier channel, as in real activations
    out = np.full((n, 37), np.nan, np.float32)
    scratch = np.zeros(matmul.prefill_scratch_size(37, K), np.float32)
    matmul.matmul(x, w, F32, out, scratch)  # n=70 takes the prefill path (the integer GEMM, or packed panels)
    exact = x.astype(np.float64) @ quant.dequantize(w).T.astype(np.float64)
    if n < matmul.PREFILL_MIN_ROWS and cpu.INTEGER & cpu.ENABLED or matmul._integer_prefill(x, w, F32, cpu.ENABLED):
        dtype = np.int8 if "vnni" in cpu.ENABLED else np.int16
        want = np.zeros_like(out)  # the reference quantizes the activations the same way
        quant_int.rows_vnni_ref(*quant.quantize_activations_ref(x, dtype), w, want, 0, 37)
        error = np.abs(out - exact).max() / np.abs(exact).max()
        assert ACTIVATION_ERROR[dtype] / 100 < error < ACTIVATION_ERROR[dtype]  # the path taken, its cost
    else:
        want = exact
    assert_f32_close(out, want)


@pytest.mark.parametrize("kernels", ["vnni", "int16", "portable"])
@pytest.mark.parametrize("name", NAMES)
def test_a_row_sums_the_same_whatever_rows_share_its_pass(rng, use_kernels, kernels, name):
    # a session decodes to the same numbers alone, in a batch, or beside a riding prefill: seven
    # rows take passes of 4, 2 and 1, and each must equal itself multiplied alone, to the bit
    use_kernels(kernels)
    w = blocks(rng, name, 37)
    x = rng.standard_normal((7, K)).astype(np.float32)
    together = np.zeros((7, 37), np.float32)
    matmul.matmul(x, w, F32, together, None)
    for i in range(7):
        alone = np.zeros((1, 37), np.float32)
        matmul.matmul(x[i : i + 1], w, F32, alone, None)
        assert np.array_equal(together[i], alone[0]), f"row {i}"


@pytest.mark.parametrize("name", [name for name in NAMES if quant.BLOCK_SIZES[name] == 32])
@pytest.mark.parametrize("k", [288, 2048])
def test_one_scale_blocks_on_int16_codes_at_either_activation_group(rng, use_kernels, name, k):
    # int16 codes share a scale per 256 values where 256 divides the width (rows_vnni applies it
    # once per 8 blocks), else one per block (288): both against the reference, and a row's numbers
    # alone equal its numbers beside 10 others
    use_kernels("int16")
    assert quant.activation_group(k, 2) == (256 if k == 2048 else 32)
    w = blocks(rng, name, 37, k)
    x = rng.standard_normal((11, k)).astype(np.float32)
    x[:, 7] *= 30.0
    out = np.full((11, 37), np.nan, np.float32)
    matmul.matmul(x, w, F32, out, None)
    want = np.zeros_like(out)
    quant_int.rows_vnni_ref(*quant.quantize_activations_ref(x, np.int16), w, want, 0, 37)
    assert_f32_close(out, want)
    for i in (0, 10):
        alone = np.zeros((1, 37), np.float32)
        matmul.matmul(x[i : i + 1], w, F32, alone, None)
        assert np.array_equal(out[i], alone[0]), f"row {i}"


@pytest.mark.parametrize("kernels", ["default", "vnni"])
@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_a_row_wider_than_a_depth_chunk_is_the_same_in_prefill_and_decode(rng, use_kernels, kernels, name):
    # rows are summed by depth chunks (quant_int.INT_DEPTH values, then the chunks' totals added):
    # the GEMM takes the chunks over its weight rows (depth first), decode row by row; a token's
    # numbers must not depend on which, and both are the reference's
    use_kernels(kernels)
    assert matmul._integer_prefill(np.zeros((1, K), np.float32), blocks(rng, name, 1), F32, cpu.ENABLED)
    k = 2 * quant_int.INT_DEPTH + 256  # two whole chunks and a part
    w = blocks(rng, name, 37, k)
    x = rng.standard_normal((70, k)).astype(np.float32)
    x[:, 7] *= 30.0
    rows = np.full((70, 37), np.nan, np.float32)
    matmul.matmul(x, w, F32, rows, np.zeros(matmul.prefill_scratch_size(37, k), np.float32))
    for i in (0, 9, 69):
        alone = np.zeros((1, 37), np.float32)
        matmul.matmul(x[i : i + 1], w, F32, alone, None)
        assert np.array_equal(rows[i], alone[0]), f"row {i}"
    xq = np.zeros(x.shape, np.int8 if "vnni" in cpu.ENABLED else np.int16)
    xd, xs = np.zeros((70, k // 32), np.float32), np.zeros((70, k // 16), np.float32)
    quant.quantize_activations(x, xq, xd, xs)  # the kernel's codes (a tie may round apart in numpy's)
    want = np.zeros_like(rows)
    quant_int.rows_vnni_ref(xq, xd, xs, w, want, 0, 37)
    assert_f32_close(rows, want)


@pytest.mark.parametrize("kernels", ["default", "vnni"])
@pytest.mark.parametrize("name", NAMES)
def test_a_prefill_row_is_the_decode_row_to_the_bit(rng, use_kernels, kernels, name):
    # one arithmetic per token: prefills of several lengths, whole or in chunks of several sizes,
    # give each row exactly the numbers the decode kernel gives it alone
    use_kernels(kernels)
    assert matmul._integer_prefill(np.zeros((1, K), np.float32), blocks(rng, name, 1), F32, cpu.ENABLED)
    w = blocks(rng, name, 37)
    x = rng.standard_normal((200, K)).astype(np.float32)
    x[:, 7] *= 30.0
    alone = np.zeros((200, 37), np.float32)
    for i in range(200):
        matmul.matmul(x[i : i + 1], w, F32, alone[i : i + 1], None)
    scratch = np.zeros(matmul.prefill_scratch_size(37, K), np.float32)
    for n, chunk in [(64, 64), (70, 70), (200, 200), (200, 64), (200, 130), (137, 71)]:
        rows = np.full((n, 37), np.nan, np.float32)
        for i0 in range(0, n, chunk):
            matmul.matmul(x[i0 : min(n, i0 + chunk)], w, F32, rows[i0 : i0 + chunk], scratch)
        assert np.array_equal(rows, alone[:n]), f"n={n} in chunks of {chunk}"


@pytest.mark.parametrize("dtype", [np.int8, np.int16])
def test_quantize_activations_matches_reference(rng, dtype):
    group = quant.activation_group(K, np.dtype(dtype).itemsize)  # int16: one scale per 256 values
    assert group == (256 if dtype == np.int16 else 32)
    x = rng.standard_normal((3, K)).astype(np.float32)
    x[1, :group] = 0.0  # an all-zero group: scale 0, codes 0
    xq, xd, xs = np.zeros((3, K), dtype), np.zeros((3, K // 32), np.float32), np.zeros((3, K // 16), np.float32)
    quant.quantize_activations(x, xq, xd, xs)
    ref_q, ref_d, ref_s = quant.quantize_activations_ref(x, dtype)
    assert np.array_equal(xq, ref_q) and np.array_equal(xs, ref_s)
    np.testing.assert_allclose(xd, ref_d, rtol=1e-7)
    assert xd[1, 0] == 0 and not xq[1, :group].any()
    per_group = xd.reshape(3, -1, group // 32)
    assert np.all(per_group == per_group[..., :1])  # the 32-value scales of a group are one
    assert np.abs(xq).max() == np.iinfo(dtype).max  # the block's largest value takes the top code
    blocks_x = (xq.reshape(3, -1, 32) * xd[..., None]).reshape(3, K)
    assert np.abs(blocks_x - x).max() <= 0.5 * xd.max() * (1 + 1e-6)  # round to nearest


def test_kernel_paths_detection_and_override():
    import subprocess
    import sys

    flags = open("/proc/cpuinfo").read()
    has_vnni, has_amx = " avx512_vnni" in flags, " amx_bf16" in flags and " amx_tile" in flags
    has_int16 = has_vnni or " avx2" in flags  # vpdpwssd, or vpmaddwd
    has_dpbf16 = " avx512_bf16" in flags  # vdpbf16ps
    assert cpu.choose("portable") == frozenset()
    assert ("bf16" in cpu.choose("auto")) == has_amx and ("bf16-prefill" in cpu.choose("auto")) == has_amx
    assert ("vnni" in cpu.choose("auto")) == has_vnni and ("int16" in cpu.choose("auto")) == has_int16
    assert ("dpbf16" in cpu.choose("auto")) == has_dpbf16
    assert cpu.choose("vnni") == (frozenset({"vnni"}) if has_vnni else frozenset())
    with pytest.raises(ValueError, match="avx2 unknown"):
        cpu.choose("vnni,avx2")
    code = "from ellmd.kernels import cpu; print(sorted(cpu.ENABLED))"
    vnni, int16 = ["vnni"] if has_vnni else [], ["int16"] if has_int16 else []
    # AMX in prefill alone ("bf16-prefill") is opt-in; vdpbf16ps is on where the CPU has it, and bf16
    # products round activations once wherever one of the two bf16 paths runs
    bf16_paths = (["bf16"] if has_amx else []) + (["dpbf16"] if has_dpbf16 else [])
    default = sorted(int16 + bf16_paths + (["bf16-round"] if bf16_paths else []))
    for env, want in (({}, default), ({"ELLM_KERNELS": "vnni"}, vnni), ({"ELLM_KERNELS": "portable"}, []),
                      ({"ELLM_KERNELS": "x"}, [])):
        got = subprocess.run([sys.executable, "-c", code], env={"PATH": "", **env}, capture_output=True, text=True, check=True)
        assert got.stdout.strip() == str(want)


def test_a_path_the_cpu_lacks_compiles_to_a_trap(monkeypatch):
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    monkeypatch.setattr(cpu, "host_paths", lambda: frozenset())  # a CPU with none of the paths

    def avx512_codegen(context, builder, signature, args):  # LLVM aborts on it for a CPU without AVX512-VNNI
        v8 = ir.VectorType(ir.IntType(32), 8)
        dp = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.256", fnty=ir.FunctionType(v8, [v8] * 3))
        zero = ir.Constant(v8, [0] * 8)
        builder.call(dp, [zero, zero, zero])
        return context.get_dummy_value()

    assert cpu.compiled_for("vnni", avx512_codegen) is not avx512_codegen

    @intrinsic
    def dot(typingctx):
        return types.void(), cpu.compiled_for("vnni", avx512_codegen)

    @numba.njit
    def kernel(enabled):
        if enabled:
            dot()
        return 7

    assert kernel(False) == 7  # compiled and run on any CPU; the trap sits in the branch not taken


@pytest.mark.parametrize("name", NAMES)
def test_embed_on_blocks(rng, name):
    table = blocks(rng, name, 20)
    tokens = np.array([19, 0, 7, 7])
    out = np.zeros((4, K), np.float32)
    matmul.embed(tokens, table, F32, out)
    assert_f32_close(out, quant.dequantize(table)[tokens])


@numba.njit(cache=True)
def _two_halves(x, w, out):
    half = w.shape[0] // 2
    matmul.linear_rows(x, w, out, 0, half)
    matmul.linear_rows(x, w, out, half, w.shape[0])


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
def test_linear_rows_inside_numba_on_an_expert_stack(rng, name):
    stack = np.stack([blocks(rng, name, 10) for _ in range(3)])  # [E, rows, blocks]
    x = rng.standard_normal((2, K)).astype(np.float32)
    for e in range(3):
        out = np.zeros((2, 10), np.float32)
        _two_halves(x, stack[e], out)
        assert_f32_close(out, x.astype(np.float64) @ quant.dequantize(stack[e]).T)


@pytest.mark.parametrize("kernels", ["portable", "int16"])
def test_tuple_of_formats_fills_consecutive_columns(rng, use_kernels, kernels):
    use_kernels(kernels)
    check = assert_f32_close if kernels == "portable" else assert_int16_close
    q, k = blocks(rng, "Q6_K", 8), blocks(rng, "Q4_K", 6)
    v = rng.standard_normal((4, K)).astype(np.float32).view(np.uint32) >> 16
    v = v.astype(np.uint16)  # bf16 bits
    x = rng.standard_normal((2, K)).astype(np.float32)
    out = np.zeros((2, 18), np.float32)
    matmul.matmul(x, (q, k, v), BF16, out, None)
    ref = np.zeros_like(out)
    matmul.linear_ref(x, (q, k, v), BF16, ref)
    check(out, ref)
    check(out[:, 8:14], x.astype(np.float64) @ quant.dequantize(k).T)


def test_quantize_weight_falls_back_as_llama_quantize(rng):
    from ellmd.model.weights import quantize_weight

    wide = rng.standard_normal((4, 512)).astype(np.float32)
    assert quant.block_name(quantize_weight(wide, F32, "Q4_K")) == "Q4_K"
    narrow = rng.standard_normal((4, 96)).astype(np.float32)
    assert quant.block_name(quantize_weight(narrow, F32, "Q4_K")) == "Q5_0"
    odd = rng.standard_normal((4, 40)).astype(np.float32)
    assert quantize_weight(odd, F32, "Q8_0") is odd  # no block fits: stays float
    stack = rng.standard_normal((3, 4, 256)).astype(np.float32)  # an expert stack
    blocks = quantize_weight(stack, F32, "Q4_K")
    assert blocks.shape == (3, 4, 1)
    assert np.array_equal(quant.dequantize(blocks[1]), quant.dequantize(quant.quantize(stack[1], "Q4_K")))
