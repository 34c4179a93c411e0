"""bf16 weights on vdpbf16ps (dpbf16.py: the "dpbf16" path) against numpy: the register blocks, the
prefill GEMM and decode, one arithmetic between them, and where matmul, the engine and attention
take the path.

The reference takes the same bf16 halves as the kernels and sums their products in float64 (as
bf16.gemm_ref does), so kernel and reference differ only by f32 summation order: each lane sums its
2k products in one sequence of f32 adds, so the error grows with k (~1e-6 to 4e-6 of the largest
output at k = 576 to 8,224). Operands a block must not read (pairs outside q0 .. q0 + count, other
tiles, tokens past the block's) hold NaN, so a stray read shows in the result.
"""

from functools import cache
from importlib import import_module
from types import SimpleNamespace

import numba
import numpy as np
import pytest
from llvmlite import binding

from test_bf16 import _weights, use_dpbf16
from test_quant import blocks

from ellmd.engine import Engine
from ellmd.kernels import attention, bf16, cpu, dpbf16, formats
from ellmd.kernels.formats import BF16, F16

matmul = import_module("ellmd.kernels.matmul")  # ellmd.kernels re-exports a function named matmul

NAN_BITS = 0x7FC0  # a bf16 quiet NaN


@pytest.fixture
def rng():
    return np.random.default_rng(11)


@pytest.fixture
def dp(monkeypatch):
    use_dpbf16(monkeypatch)


@pytest.fixture(params=[False, True], ids=["halves", "rounded"])
def rounding(request, dp, monkeypatch):
    """Activations as two bf16 halves, then rounded once ("bf16-round")."""
    if request.param:
        monkeypatch.setattr(cpu, "ENABLED", cpu.ENABLED | {"bf16-round"})
    return request.param


def _halves(x, rounded):
    """xh, xl as the kernels take them: rows of bf16 bits (xl of no rows when rounded)."""
    hi, lo = (formats.to_storage(h, BF16) for h in bf16.split(x))
    return hi, lo[:0] if rounded else lo


def _reference(x, w, rounded):
    """bf16.gemm_ref of x [n, k] float32 and w [m, k] bf16 bits: the halves' products in float64."""
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    bf16.gemm_ref(x, w, out, None, frozenset({"bf16-round"} if rounded else ()))
    return out


@cache
def _runner(row_tiles, tokens):
    block = dpbf16.make_block(row_tiles, tokens)

    @numba.njit(nogil=True, fastmath=True)
    def run(w, j, xh, xl, nb, out, r0, q0, count):
        block(w, j, xh, xl, nb, out, r0, q0, count, q0 > 0)

    return run


def test_path_is_detected_from_the_cpu():
    features = binding.get_host_cpu_features()
    assert ("dpbf16" in cpu.host_paths()) == bool(features.get("avx512bf16") and features.get("avx512f"))


def test_the_halves_compile_for_either_path(monkeypatch):
    """The activations' halves (vcvtneps2bf16) serve AMX and vdpbf16ps: emitted where the CPU has
    either path, a trap where it has neither."""
    codegen = object()
    for host, emitted in (({"bf16"}, True), ({"dpbf16"}, True), ({"int16", "vnni"}, False)):
        monkeypatch.setattr(cpu, "host_paths", lambda host=host: frozenset(host))
        assert (cpu.compiled_for(bf16.PATHS, codegen) is codegen) == emitted


def test_pack_tokens_rows_of_halves(rng, rounding):
    """Rows of bf16 bits, hi then lo (or hi alone); the rows past n repeat the last token."""
    n, k = 7, 96
    x = rng.standard_normal((n, k)).astype(np.float32)
    rows = dpbf16.token_rows(n)
    assert rows == 12 and dpbf16.token_rows(1) == 1 and dpbf16.token_rows(6) == 6
    xh = np.zeros((rows, k), np.uint16)
    xl = np.zeros((0 if rounding else rows, k), np.uint16)
    dpbf16.pack_tokens(x, xh, xl)
    want_h, want_l = _halves(np.concatenate([x, np.repeat(x[-1:], rows - n, axis=0)]), rounding)
    assert np.array_equal(xh, want_h) and np.array_equal(xl, want_l)


@pytest.mark.parametrize("row_tiles,tokens", [(4, 6), (1, 6), (8, 1), (1, 1)])
@pytest.mark.parametrize("q0,count", [(0, 48), (16, 32), (5, 3)])
@pytest.mark.parametrize("nb", [1, 6, 11])
def test_block_matches_reference(rng, rounding, row_tiles, tokens, q0, count, nb):
    """Each block: its tiles from j, pairs q0 .. q0 + count, the tokens in blocks (the rows past nb
    computed, not stored), stored into out's columns of its tiles (the rest of out untouched) or,
    from a later pass (q0 > 0), added to out's sums."""
    k, j, tiles, r0 = -(-(2 * (q0 + count) + 8) // 32) * 32, 1, 10, 2  # depths past the call's
    nbp = -(-nb // tokens) * tokens
    wf = _weights(rng, 16 * tiles, k)
    wf[:, : 2 * q0] = wf[:, 2 * (q0 + count) :] = NAN_BITS  # depths outside the call's
    wf[: 16 * j] = wf[16 * (j + row_tiles) :] = NAN_BITS  # tiles outside the block
    x = rng.standard_normal((nbp, k)).astype(np.float32)
    x[:, : 2 * q0] = x[:, 2 * (q0 + count) :] = np.nan
    xh, xl = _halves(x, rounding)
    start = rng.standard_normal((r0 + nbp + 2, 16 * tiles + 8)).astype(np.float32)
    out = start.copy()
    _runner(row_tiles, tokens)(bf16.pack(wf), j, xh, xl, nb, out, r0, q0, count)
    cols, depths = slice(16 * j, 16 * (j + row_tiles)), slice(2 * q0, 2 * (q0 + count))
    product = _reference(x[:nb, depths], wf[cols, depths], rounding)
    want = start.copy()
    want[r0 : r0 + nb, cols] = product + (start[r0 : r0 + nb, cols] if q0 else 0)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    untouched = np.ones(out.shape, bool)
    untouched[r0 : r0 + nb, cols] = False
    assert np.array_equal(out[untouched], start[untouched])


@pytest.mark.parametrize("rows_per_block", [(4, 6), (1, 6), (4, 4), (4, 3), (4, 2), (8, 1), (1, 1)])
def test_a_token_has_the_same_bits_in_every_block(rng, rounding, rows_per_block):
    """One arithmetic: a token's outputs are the same bits in every block, at every place in it,
    whatever the tokens beside it, in one pass or two (out keeping the f32 sums between them)."""
    k, tiles = 256, 8
    w = bf16.pack(_weights(rng, 16 * tiles, k))
    token = rng.standard_normal(k).astype(np.float32)
    alone = np.empty((1, 16 * tiles), np.float32)
    xh, xl = _halves(token[None], rounding)
    _runner(8, 1)(w, 0, xh, xl, 1, alone, 0, 0, k // 2)
    row_tiles, tokens = rows_per_block
    for place in range(tokens):
        x = rng.standard_normal((tokens, k)).astype(np.float32)
        x[place] = token
        xh, xl = _halves(x, rounding)
        out = np.empty((tokens, 16 * tiles), np.float32)
        for j in range(0, tiles, row_tiles):
            _runner(row_tiles, tokens)(w, j, xh, xl, tokens, out, 0, 0, 40)  # two passes over the depths
            _runner(row_tiles, tokens)(w, j, xh, xl, tokens, out, 0, 40, k // 2 - 40)
        assert np.array_equal(out[place], alone[0]), place


@pytest.mark.parametrize("n,m,k", [(70, 64, 576), (300, 48, 2048), (600, 96, 2048), (257, 160, 96),
                                   (70, 48, 8224), (2, 16, 32)])
@pytest.mark.parametrize("workers", [1, 2])
def test_gemm_matches_reference(rng, rounding, n, m, k, workers):
    """Prefill: chunks of TOKENS tokens (n = 300, 600) and a last partial block of tokens, a last
    group of row tiles short of four (m = 48, 160), the depth in passes (k = 8224), out a column
    slice (its neighbours untouched); rounded: the products of bf16(x) alone, ~8 bits of it."""
    x = rng.standard_normal((n, k)).astype(np.float32)
    w = _weights(rng, m, k)
    wide = np.full((n, m + 24), np.nan, np.float32)
    got = wide[:, 8 : 8 + m]
    threads = numba.get_num_threads()
    numba.set_num_threads(min(workers, numba.config.NUMBA_NUM_THREADS))
    try:
        dpbf16.gemm(x, bf16.pack(w), got, np.full(dpbf16.scratch_floats(k), np.nan, np.float32), rounding)
    finally:
        numba.set_num_threads(threads)
    want = _reference(x, w, rounding)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert np.isnan(wide[:, :8]).all() and np.isnan(wide[:, 8 + m :]).all()
    exact = x.astype(np.float64) @ formats.to_f32(w, BF16).T.astype(np.float64)
    assert (np.abs(got - exact).max() > 1e-4 * np.abs(exact).max()) == rounding  # bf16(x)'s 8 bits, or ~16


@pytest.mark.parametrize("m,k", [(96, 576), (48, 2048), (160, 96)])
def test_decode_has_the_gemms_bits(rng, rounding, m, k):
    """matmul.linear (decode) on packed weights: every row count (one token's block and blocks of
    six) gives prefill's bits, and rows() any run of tiles."""
    x = rng.standard_normal((70, k)).astype(np.float32)
    w = bf16.pack(_weights(rng, m, k))
    full = np.empty((70, m), np.float32)
    matmul.matmul(x, w, BF16, full, np.empty(matmul.prefill_scratch_size(m, k), np.float32))
    for n in (1, 2, 6, 7, 16, 63):
        got = np.full((n, m), np.nan, np.float32)
        matmul.linear(x[:n], w, BF16, got)
        assert np.array_equal(got, full[:n]), n
    for n, (j0, j1) in ((1, (16, m)), (3, (0, 32)), (7, (32, 48))):
        xh = np.empty((dpbf16.token_rows(n), k), np.uint16)
        xl = np.empty((0 if rounding else xh.shape[0], k), np.uint16)
        dpbf16.pack_tokens(x[:n], xh, xl)
        got = np.full((n, m), np.nan, np.float32)
        dpbf16.rows(xh, xl, n, w, got, j0, j1)
        assert np.array_equal(got[:, j0:j1], full[:n, j0:j1]), (n, j0, j1)
        assert np.isnan(got[:, :j0]).all() and np.isnan(got[:, j1:]).all()  # nothing outside j0:j1


def test_weights_are_packed_at_load_and_matmul_takes_them(rng, dp, monkeypatch):
    """bf16 matrices of usable shapes are packed at load on this path (not f16, not other shapes), and
    matmul sends them to the GEMM in prefill; with the path off they stay as stored, on the f32
    kernels, and GGUF blocks keep their integer kernels either way."""
    from ellmd.model.llama import logical_shape, repacked

    n, m, k = 130, 96, 256
    w = _weights(rng, m, k)
    assert bf16.packs(w, BF16) and not bf16.packs(w, F16) and not bf16.packs(w[:, :80].copy(), BF16)
    packed = repacked(w, BF16)
    assert bf16.is_packed(packed) and logical_shape(packed) == (m, k)
    calls = []
    real = dpbf16.gemm
    monkeypatch.setattr(dpbf16, "gemm", lambda *a: calls.append(a[1].shape) or real(*a))
    x = rng.standard_normal((n, k)).astype(np.float32)
    scratch = np.empty(matmul.prefill_scratch_size(m, k), np.float32)
    got, want = np.empty((n, m), np.float32), np.empty((n, m), np.float32)
    matmul.matmul(x, packed, BF16, got, scratch)
    matmul.linear_ref(x, w, BF16, want, frozenset())  # the f32 kernels' reference
    assert calls == [(m // 16, k // 32)]
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()  # hi + lo: ~16 bits of each activation
    q = blocks(rng, "Q4_K", m, k)
    matmul.linear_ref(x, q, BF16, want)
    matmul.matmul(x, q, BF16, got, scratch)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max() and len(calls) == 1  # the integer GEMM
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"int16"}))  # the path off
    kept = repacked(w, BF16)
    assert kept.dtype == np.uint16 and np.array_equal(kept, w)


def test_amx_wins_where_both_are_on(monkeypatch):
    monkeypatch.setattr(bf16, "AMX", True)
    assert bf16.decode_tiles({"bf16", "dpbf16"}) and not bf16.vdpbf16ps({"bf16", "dpbf16"})
    assert bf16.vdpbf16ps({"dpbf16"}) and bf16.vdpbf16ps({"bf16-prefill", "dpbf16"})


def test_attention_takes_vdpbf16ps_on_its_path(rng, dp, monkeypatch):
    """bf16 KV takes vdpbf16ps where bf16 weights do (head_dim a multiple of 32): within bf16
    probabilities' bound of exact (test_bf16 checks it over shapes, test_head_dim decode against
    prefill); f16 KV, a head_dim of 80 and the path off take the f32 kernels."""
    assert attention.products(BF16, 64) == attention.products(BF16, 128) == attention.ON_DPBF16
    assert attention.products(F16, 64) == attention.products(BF16, 80) == attention.ON_F32
    assert attention.products(BF16, 64, frozenset({"int16"})) == attention.ON_F32
    n, start, hd = 40, 70, 64
    q = rng.standard_normal((n, 4, hd)).astype(np.float32)
    k, v = (formats.to_storage(rng.standard_normal((2, start + n, hd)).astype(np.float32), BF16) for _ in range(2))
    want = np.empty_like(q)
    attention.attention_prefill_ref(q, k, v, BF16, start, hd**-0.5, want)
    got = np.empty_like(q)
    attention.attention_prefill(q, k, v, BF16, start, hd**-0.5, got)
    assert 1e-6 < np.abs(got - want).max() <= 2.0**-8 * np.abs(formats.to_f32(v, BF16)).max()  # bf16 probabilities
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"int16"}))
    attention.attention_prefill(q, k, v, BF16, start, hd**-0.5, got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_engine_names_the_path(monkeypatch):
    engine = Engine.__new__(Engine)  # describe_kernels reads the paths, the KV format and head_dim only
    engine.kv = SimpleNamespace(fmt=BF16)
    engine.spec = SimpleNamespace(head_dim=64)
    monkeypatch.setattr(bf16, "AMX", False)
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"int16", "dpbf16"}))
    described = engine.describe_kernels()
    assert "bf16 weights: vdpbf16ps in decode and prefill (activations as two bf16 halves, a token's numbers alike);" \
        in described
    assert "attention: vdpbf16ps in prefill and decode (queries as two bf16 halves" in described
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"int16", "dpbf16", "bf16-round"}))
    assert "bf16 weights: vdpbf16ps in decode and prefill (activations rounded to bf16" in engine.describe_kernels()
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"int16"}))
    assert "bf16 weights: f32 FMA in decode and prefill;" in engine.describe_kernels()
    monkeypatch.setattr(bf16, "AMX", True)  # the start-up line of a CPU with AMX
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"int16", "bf16", "dpbf16"}))
    described = engine.describe_kernels()
    assert "bf16 weights: AMX tdpbf16ps in decode and prefill (activations as two bf16 halves" in described
    assert "attention: AMX tdpbf16ps in prefill and decode" in described
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"int16", "bf16", "bf16-round"}))
    assert "bf16 weights: AMX tdpbf16ps in decode and prefill (activations rounded to bf16" in engine.describe_kernels()
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"int16", "bf16"}))
    engine.kv = SimpleNamespace(fmt=F16)  # KV kept in f16 for its precision: the f32 kernels
    assert "attention: f32 FMA in prefill and decode" in engine.describe_kernels()
    engine.kv = SimpleNamespace(fmt=BF16)
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"int16", "bf16-prefill"}))
    described = engine.describe_kernels()
    assert "bf16 weights: f32 FMA in decode, AMX tdpbf16ps (activations as two bf16 halves) in prefill" in described
    assert "attention: f32 FMA in prefill and decode" in described
