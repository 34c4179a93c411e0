"""The bf16 prefill GEMM (bf16.py) against numpy, on each engine this CPU has, and its dispatch.

The reference rounds the activations to bf16 as the kernel does; products of bf16 values are
exact in f32, so kernel and reference differ only by f32 summation order.
"""

from importlib import import_module

import numba
import numpy as np
import pytest
from llvmlite import binding

from ellmd.kernels import bf16, cpu, formats
from ellmd.kernels.formats import BF16, F32

matmul = import_module("ellmd.kernels.matmul")  # ellmd.kernels re-exports a function named matmul

# the engines this host can run: AMX where the CPU and Linux grant it, vdpbf16ps with AVX512-BF16
ENGINES = [name for name, on in (("amx", bf16.AMX), ("vdpbf16ps", "bf16" in cpu.host_paths())) if on]
TOL = dict(rtol=1e-5, atol=1e-4)


@pytest.fixture
def rng():
    return np.random.default_rng(7)


@pytest.fixture(params=ENGINES)
def engine(request, monkeypatch):
    monkeypatch.setattr(bf16, "AMX", request.param == "amx")
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"bf16"}))
    return request.param


def _weights(rng, m, k):
    return formats.to_storage(rng.standard_normal((m, k)).astype(np.float32), BF16)


def _work(k, workers):
    return np.full((workers, bf16.worker_floats(k)), np.nan, np.float32)  # kernels must not read it unwritten


def test_this_cpu_has_an_engine():
    features = binding.get_host_cpu_features()
    assert not bf16.AMX or (features.get("amx-bf16") and features.get("amx-tile"))
    assert ENGINES, "the machine the suite runs on has AVX512-BF16; the tests below need it"


@pytest.mark.parametrize("n,k", [(5, 64), (37, 96)])
def test_pack_activations_layout(rng, n, k):
    tokens = 64
    x = rng.standard_normal((n + 3, k)).astype(np.float32)
    xp = np.zeros((k // 2, 2 * tokens), np.uint16)

    @numba.njit
    def pack(x, xp):
        bf16.pack_activations(x, 2, n, (n + 15) // 16 * 16, xp)

    pack(x, xp)
    bits = formats.to_storage(x[2 : 2 + n], BF16)  # [n, k]: the tokens from row 2 on
    padded = np.concatenate([bits, np.repeat(bits[-1:], (n + 15) // 16 * 16 - n, axis=0)])  # repeats the last
    assert np.array_equal(xp[:, 0 : 2 * len(padded) : 2], padded[:, 0::2].T)  # even depth of each pair first
    assert np.array_equal(xp[:, 1 : 2 * len(padded) : 2], padded[:, 1::2].T)
    assert not xp[:, 2 * len(padded) :].any()  # columns past the last group of 16 untouched


@pytest.mark.parametrize("n,m,k", [(70, 64, 64), (300, 48, 576), (64, 96, 1024), (257, 160, 96)])
@pytest.mark.parametrize("workers", [1, 2])
def test_gemm_matches_reference(rng, engine, n, m, k, workers):
    """Partial token blocks, a last AMX block of 16 rows (m=48, 160), several depth blocks (k=576, 1024)."""
    x = rng.standard_normal((n, k)).astype(np.float32)
    w = _weights(rng, m, k)
    got, want = np.empty((n, m), np.float32), np.empty((n, m), np.float32)
    bf16.gemm(x, w, got, _work(k, workers))
    bf16.gemm_ref(x, w, want, None)
    np.testing.assert_allclose(got, want, **TOL)


def test_vdpbf16ps_takes_any_row_count(rng, monkeypatch):
    if "vdpbf16ps" not in ENGINES:
        pytest.fail("needs AVX512-BF16")
    monkeypatch.setattr(bf16, "AMX", False)
    n, m, k = 80, 70, 64  # 70 rows: the last group of MR repeats row 69
    x = rng.standard_normal((n, k)).astype(np.float32)
    w = _weights(rng, m, k)
    got, want = np.empty((n, m), np.float32), np.empty((n, m), np.float32)
    bf16.gemm(x, w, got, _work(k, 2))
    bf16.gemm_ref(x, w, want, None)
    np.testing.assert_allclose(got, want, **TOL)
    assert bf16.usable(70, 64) and not bf16.usable(64, 48)


def test_amx_needs_rows_in_tiles(monkeypatch):
    monkeypatch.setattr(bf16, "AMX", True)
    assert bf16.usable(48, 64) and not bf16.usable(70, 64) and not bf16.usable(64, 48)


def test_linear_prefill_takes_the_bf16_gemm_only_on_its_path(rng, engine, monkeypatch):
    n, m, k = 130, 96, 192
    x = rng.standard_normal((n, k)).astype(np.float32)
    w = _weights(rng, m, k)
    scratch = np.empty(matmul.prefill_scratch_size(m, k), np.float32)
    exact, rounded, got = (np.empty((n, m), np.float32) for _ in range(3))
    matmul.linear_ref(x, w, BF16, exact)
    bf16.gemm_ref(x, w, rounded, None)
    assert np.abs(rounded - exact).max() > 1e-3  # the two paths are told apart by their rounding
    matmul.linear_prefill(x, w, BF16, got, scratch)
    np.testing.assert_allclose(got, rounded, **TOL)
    want = np.empty_like(got)
    matmul.matmul_ref(x, w, BF16, want, scratch)
    np.testing.assert_allclose(got, want, **TOL)

    monkeypatch.setattr(cpu, "ENABLED", frozenset())  # the portable path: f32 products of the stored values
    matmul.linear_prefill(x, w, BF16, got, scratch)
    np.testing.assert_allclose(got, exact, **TOL)


def test_bf16_path_leaves_other_weights_to_the_f32_kernels(rng, engine):
    n, k = 100, 96
    x = rng.standard_normal((n, k)).astype(np.float32)
    odd = _weights(rng, 40, 90)  # k % 32 != 0
    f32 = rng.standard_normal((32, k)).astype(np.float32)
    for w, fmt, width in ((odd, BF16, 90), (f32, F32, k)):
        xs = np.ascontiguousarray(x[:, :width])
        got, want = np.empty((n, w.shape[0]), np.float32), np.empty((n, w.shape[0]), np.float32)
        matmul.linear_prefill(xs, w, fmt, got, np.empty(matmul.prefill_scratch_size(*w.shape), np.float32))
        matmul.linear_ref(xs, w, fmt, want)
        np.testing.assert_allclose(got, want, **TOL)


def test_fused_weights_write_their_column_slices(rng, engine):
    n, k = 96, 128
    x = rng.standard_normal((n, k)).astype(np.float32)
    parts = (_weights(rng, 64, k), _weights(rng, 32, k))
    scratch = np.empty(matmul.prefill_scratch_size(96, k), np.float32)
    got = np.empty((n, 96), np.float32)
    matmul.matmul(x, parts, BF16, got, scratch)
    want = np.empty((n, 96), np.float32)
    bf16.gemm_ref(x, np.concatenate(parts), want, None)
    np.testing.assert_allclose(got, want, **TOL)
