"""The vdpbf16ps GEMM block (dpbf16.py) against numpy, and against the AMX block where the CPU has both;
bf16.gemm on it ("dpbf16" path) end to end, and where matmul, attention and the engine take it.

The reference takes the same bf16 halves as the block and sums their products in float64 (as
bf16.gemm_ref does), so block and reference differ only by f32 summation order: test_bf16's TOL.
Operands the block must not read (pairs outside p0..p0 + pairs, weight columns outside theirs,
other tokens, the rows of c past the block) hold NaN, so a stray read shows in the result.
"""

from functools import cache
from types import SimpleNamespace
from importlib import import_module

import numba
import numpy as np
import pytest
from llvmlite import binding

from test_bf16 import _counting_gemm, _work
from test_quant import blocks

from ellmd.engine import Engine
from ellmd.kernels import attention, bf16, cpu, dpbf16, formats
from ellmd.kernels.formats import BF16, F16

matmul = import_module("ellmd.kernels.matmul")  # ellmd.kernels re-exports a function named matmul

TOL = dict(rtol=1e-5, atol=1e-4)  # as test_bf16: f32 summation order
TOKENS = 96  # packed tokens: three blocks of 32
NAN_BITS = 0x7FC0  # a bf16 quiet NaN


@pytest.fixture
def rng():
    return np.random.default_rng(11)


@pytest.fixture
def dp(monkeypatch):
    if "dpbf16" not in cpu.host_paths():  # the instruction would trap (cpu.compiled_for)
        pytest.skip("this CPU has no AVX512-BF16 (vdpbf16ps): the dpbf16 block cannot run here")
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"dpbf16"}))


@cache
def _runner(block):
    @numba.njit(nogil=True, fastmath=True)
    def run(w, wl, split, j0, xh, xl, t0, c, p0, pairs):
        block(w, wl, split, j0, xh, xl, t0, c, p0, pairs)

    return run


@cache
def _dp_block(row_tiles, accumulate):
    return _runner(dpbf16.make_block(row_tiles, accumulate))


def _pack(x):
    """xh, xl: [tokens // 16, pairs * 32] uint16 of x [tokens, 2 * pairs], as bf16.pack_activations
    lays them out (test_bf16 checks it against the same numpy), for any number of pairs: per group of
    16 tokens, pair p's 16 pairs (the even depth first) in a row."""
    t, k = x.shape
    bits = (formats.to_storage(half, BF16).reshape(t // 16, 16, k // 2, 2) for half in bf16.split(x))
    return [b.transpose(0, 2, 1, 3).reshape(t // 16, k * 16) for b in bits]


class Case:
    """The operands of one block call and its float64 reference: weights [48, 2 (p0 + pairs) + 6]
    (the rows from j0, padded), tokens [TOKENS, 2 (p0 + pairs + 4)], c [32, TOKENS]."""

    def __init__(self, rng, row_tiles, split, p0, pairs, t0, j0=8):
        self.rows, self.split, self.p0, self.pairs, self.t0, self.j0 = 16 * row_tiles, split, p0, pairs, t0, j0
        d0, d1 = 2 * p0, 2 * (p0 + pairs)
        wf = rng.standard_normal((48, d1 + 6)).astype(np.float32)
        if split:  # weights from GGUF blocks: their two halves (bf16.split_rows)
            self.wh, self.wl = (formats.to_storage(h, BF16) for h in bf16.split(wf))
        else:
            self.wh = formats.to_storage(wf, BF16)
            self.wl = np.full_like(self.wh, NAN_BITS)  # not read
        for w in (self.wh, self.wl):  # columns before and after the call's depths
            w[:, :d0] = w[:, d1:] = NAN_BITS
        self.x = rng.standard_normal((TOKENS, d1 + 8)).astype(np.float32)
        self.x[:, :d0] = self.x[:, d1:] = np.nan  # pairs before p0 and after p0 + pairs
        self.x[:t0] = self.x[t0 + 32 :] = np.nan  # the tokens of other blocks
        self.xh, self.xl = _pack(self.x)
        self.c0 = rng.standard_normal((32, TOKENS)).astype(np.float32)

    def reference(self, accumulate):
        rows, toks, depths = slice(self.j0, self.j0 + self.rows), slice(self.t0, self.t0 + 32), \
            slice(2 * self.p0, 2 * (self.p0 + self.pairs))
        hi, lo = (h.astype(np.float64) for h in bf16.split(self.x[toks, depths]))
        product = (hi + lo) @ formats.to_f32(self.wh[rows, depths], BF16).T.astype(np.float64)  # [32, rows]
        if self.split:
            product += hi @ formats.to_f32(self.wl[rows, depths], BF16).T.astype(np.float64)
        want = self.c0.copy()
        if accumulate:
            want[: self.rows, toks] = (self.c0[: self.rows, toks] + product.T).astype(np.float32)
        else:
            want[: self.rows, toks] = product.T.astype(np.float32)
        return want

    def run(self, block):
        c = self.c0.copy()
        block(self.wh, self.wl, self.split, self.j0, self.xh, self.xl, self.t0, c, self.p0, self.pairs)
        return c


def test_path_is_detected_from_the_cpu():
    features = binding.get_host_cpu_features()
    assert ("dpbf16" in cpu.host_paths()) == bool(features.get("avx512bf16") and features.get("avx512f"))


def test_the_halves_compile_for_either_path(monkeypatch):
    """pack_activations and split_rows (vcvtneps2bf16) serve AMX and vdpbf16ps: emitted where the CPU
    has either path, a trap where it has neither."""
    codegen = object()
    for host, emitted in (({"bf16"}, True), ({"dpbf16"}, True), ({"int16", "vnni"}, False)):
        monkeypatch.setattr(cpu, "host_paths", lambda host=host: frozenset(host))
        assert (cpu.compiled_for(bf16.PATHS, codegen) is codegen) == emitted


@pytest.mark.parametrize("p0,pairs,t0", [(0, 16, 0), (16, 48, 32), (0, 1024, 64), (256, 256, 32), (5, 3, 64)])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("row_tiles", [2, 1])
def test_block_matches_reference(rng, dp, row_tiles, accumulate, split, p0, pairs, t0):
    """32 and 16 rows, stored or added, the halves of block weights or not, depths of one tile to a
    pass of bf16.gemm at k = 2048 and a few pairs at an odd offset, every token block of c; the rest
    of c untouched."""
    case = Case(rng, row_tiles, split, p0, pairs, t0)
    got = case.run(_dp_block(row_tiles, accumulate))
    np.testing.assert_allclose(got, case.reference(accumulate), **TOL)


def test_no_pairs_stores_zero_or_leaves_c(rng, dp):
    case = Case(rng, 2, False, 0, 0, 32)
    assert np.array_equal(case.run(_dp_block(2, True)), case.c0)
    assert np.array_equal(case.run(_dp_block(2, False)), case.reference(False))  # zeros in the block


@pytest.mark.parametrize("split", [False, True])
def test_token_numbers_do_not_depend_on_the_other_tokens(rng, dp, split):
    """One arithmetic: a token's column has the same bits whatever the other 31 tokens of its block,
    its lane and the block it sits in."""
    case = Case(rng, 2, split, 0, 256, 0)
    block = _dp_block(2, False)
    first = case.run(block)
    token = case.x[7].copy()
    for t0, lane in ((0, 20), (64, 3), (32, 31)):
        case.x[:] = rng.standard_normal(case.x.shape).astype(np.float32)  # other tokens everywhere
        case.x[t0 + lane] = token
        case.xh, case.xl = _pack(case.x)
        case.t0 = t0
        again = case.run(block)
        assert np.array_equal(again[:, t0 + lane], first[:, 7])


@pytest.mark.parametrize("p0,pairs", [(0, 16), (32, 256)])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("row_tiles", [2, 1])
def test_block_matches_the_amx_block(rng, dp, row_tiles, accumulate, split, p0, pairs):
    if not bf16.AMX:
        pytest.skip("this CPU has no AMX-BF16 (or Linux did not grant the tile state): nothing to compare with")
    amx = {(2, False): bf16._amx_2, (2, True): bf16._amx_2_acc, (1, False): bf16._amx_1,
           (1, True): bf16._amx_1_acc}[row_tiles, accumulate]
    case = Case(rng, row_tiles, split, p0, pairs, 32)
    got, want = case.run(_dp_block(row_tiles, accumulate)), case.run(_runner(amx))
    np.testing.assert_allclose(got, want, **TOL)


# --- bf16.gemm on vdpbf16ps (the "dpbf16" path) ------------------------------------------------


def _weights(rng, m, k):
    return formats.to_storage(rng.standard_normal((m, k)).astype(np.float32), BF16)


@pytest.mark.parametrize("n,m,k", [(70, 64, 576), (300, 48, 2048), (257, 160, 96), (70, 48, 8224)])
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("rounded", [False, True], ids=["halves", "rounded"])
def test_gemm_matches_reference(rng, dp, monkeypatch, n, m, k, workers, rounded):
    """Partial token blocks, a last group of 16 rows (m = 48), groups dealt unevenly (m = 160), the
    depth in several passes (k = 8224: 3 for a block of 64 tokens, 2 for the last 6). Each lane sums
    its 2k products in one sequence of f32 adds: the summation error grows with k (measured 1.1e-6,
    1.8e-6 and 3.6e-6 of the largest output at k = 576, 2048 and 8224; AMX's tiles 0.2e-6 to 0.8e-6).
    Rounded ("bf16-round"): the products of bf16(x) alone, the reference's too."""
    if rounded:
        monkeypatch.setattr(cpu, "ENABLED", cpu.ENABLED | {"bf16-round"})
    assert not bf16.tiles()
    x = rng.standard_normal((n, k)).astype(np.float32)
    w = _weights(rng, m, k)
    got, want = np.empty((n, m), np.float32), np.empty((n, m), np.float32)
    bf16.gemm(x, w, got, _work(m, k, workers))
    bf16.gemm_ref(x, w, want, None)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    exact = x.astype(np.float64) @ formats.to_f32(w, BF16).T.astype(np.float64)
    assert (np.abs(got - exact).max() > 1e-4 * np.abs(exact).max()) == rounded  # bf16(x)'s 8 bits, or ~16


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
def test_gemm_of_blocks_matches_reference(rng, dp, name):
    """The split weights (wl . hi added) through the GEMM: matmul keeps blocks off this path, the
    GEMM takes them all the same."""
    n, m, k = 100, 48, 768
    x = rng.standard_normal((n, k)).astype(np.float32)
    w = blocks(rng, name, m, k)
    got, want = np.empty((n, m), np.float32), np.empty((n, m), np.float32)
    bf16.gemm(x, w, got, _work(m, k, 2))
    bf16.gemm_ref(x, w, want, None)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("k", [576, 8224])
def test_a_tokens_numbers_do_not_depend_on_its_chunk(rng, dp, k):
    """One arithmetic in the GEMM: each lane sums its token's pairs in one order, across depth passes
    too (c holds the f32 sums between them), so a token's row has the same bits alone as in a chunk."""
    n, m = 150, 64
    x = rng.standard_normal((n, k)).astype(np.float32)
    w = _weights(rng, m, k)
    work = _work(m, k, 2)
    full = np.empty((n, m), np.float32)
    bf16.gemm(x, w, full, work)
    for i0, i1 in ((0, 1), (77, 78), (149, 150), (40, 110)):
        part = np.empty((i1 - i0, m), np.float32)
        bf16.gemm(x[i0:i1], w, part, work)
        assert np.array_equal(part, full[i0:i1])


def test_linear_prefill_takes_it_for_bf16_weights_only(rng, dp, monkeypatch):
    n, m, k = 130, 96, 256
    x = rng.standard_normal((n, k)).astype(np.float32)
    w, q = _weights(rng, m, k), blocks(rng, "Q4_K", m, k)
    calls = _counting_gemm(monkeypatch)
    monkeypatch.setattr(bf16, "AMX", False)  # a CPU without AMX: the scratch still holds the GEMM's
    scratch = np.empty(matmul.prefill_scratch_size(m, k), np.float32)
    assert scratch.size >= bf16.scratch_floats(m, k)
    got, want = np.empty((n, m), np.float32), np.empty((n, m), np.float32)
    matmul.linear_prefill(x, w, BF16, got, scratch)
    matmul.linear_ref(x, w, BF16, want)
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()  # hi + lo: ~16 bits of each activation
    assert calls == [((m, k), False)]
    matmul.linear_ref(x, q, BF16, want)
    for enabled in ({"dpbf16"}, {"dpbf16", "int16"}):  # blocks: the f32 panels, the integer GEMM
        monkeypatch.setattr(cpu, "ENABLED", frozenset(enabled))
        matmul.linear_prefill(x, q, BF16, got, scratch)
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()  # int16 activations: ~1e-5 of a product
    matmul.linear_ref(x, w, BF16, want)
    for enabled in ((), {"int16"}):  # the path off: decode's f32 sums
        monkeypatch.setattr(cpu, "ENABLED", frozenset(enabled))
        matmul.linear_prefill(x, w, BF16, got, scratch)
        np.testing.assert_allclose(got, want, **TOL)
    assert calls == [((m, k), False)]


def test_amx_wins_where_both_are_on(rng, dp, monkeypatch):
    if not bf16.AMX:
        pytest.skip("this CPU has no AMX-BF16 (or Linux did not grant the tile state)")
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"bf16", "dpbf16"}))
    n, m, k = 130, 64, 256
    x, w = rng.standard_normal((n, k)).astype(np.float32), _weights(rng, m, k)
    calls = _counting_gemm(monkeypatch)
    matmul.linear_prefill(x, w, BF16, np.empty((n, m), np.float32),
                          np.empty(matmul.prefill_scratch_size(m, k), np.float32))
    assert calls == [((m, k), True)]


def test_attention_stays_off_amx(rng, dp, monkeypatch):
    """AMX attention is the "bf16" path's (with decode on the same tiles): with "dpbf16" on, bf16 KV
    takes the f32 kernels."""
    assert not attention.on_amx(BF16, 64)
    n, start, hd = 40, 70, 64
    q = rng.standard_normal((n, 4, hd)).astype(np.float32)
    k, v = (formats.to_storage(rng.standard_normal((2, start + n, hd)).astype(np.float32), BF16) for _ in range(2))
    got, want = np.empty_like(q), np.empty_like(q)
    attention.attention_prefill(q, k, v, BF16, start, hd**-0.5, got)
    attention.attention_prefill_ref(q, k, v, BF16, start, hd**-0.5, want)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_engine_names_the_path(monkeypatch):
    engine = Engine.__new__(Engine)  # describe_kernels reads the paths, the KV format and head_dim only
    engine.kv = SimpleNamespace(fmt=BF16)
    engine.spec = SimpleNamespace(head_dim=64)
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"int16", "dpbf16"}))
    assert "bf16 weights: f32 FMA in decode, vdpbf16ps (activations as two bf16 halves) in prefill;" in \
        engine.describe_kernels()
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"int16"}))
    assert "bf16 weights: f32 FMA in decode and prefill;" in engine.describe_kernels()
    monkeypatch.setattr(bf16, "AMX", True)  # the start-up line of a CPU with AMX
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"int16", "bf16"}))
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
