"""The AMX bf16 GEMM (bf16.py: prefill, and decode's rows_amx) and AMX attention (attention.py)
against numpy.

GEMM: the reference splits the activations (and the values of block weights) into the same two bf16
halves; products of bf16 values are exact in f32, so kernel and reference differ only by f32
summation order. Attention: the
probabilities are rounded to bf16 (relative error <= 2**-9 of each weight, the output a weighted
mean of the values with those weights), so the output is within 2**-8 x max|v| of the reference;
tests with exactly representable weights check the key ranges to f32 precision.
"""

from importlib import import_module

import numba
import numpy as np
import pytest
from llvmlite import binding

from test_quant import blocks

from ellmd.kernels import attention, bf16, cpu, formats, quant
from ellmd.kernels.formats import BF16, F16, F32

matmul = import_module("ellmd.kernels.matmul")  # ellmd.kernels re-exports a function named matmul

TOL = dict(rtol=1e-5, atol=1e-4)  # kernel vs reference on the same halves: f32 summation order


@pytest.fixture
def rng():
    return np.random.default_rng(7)


@pytest.fixture
def amx(monkeypatch):
    use_amx(monkeypatch)


@pytest.fixture(params=["amx", "dpbf16"])
def bf16_products(request, monkeypatch):
    """The bf16 products of attention: AMX tiles ("bf16"), then vdpbf16ps ("dpbf16", AMX off)."""
    (use_amx if request.param == "amx" else use_dpbf16)(monkeypatch)
    return request.param


def use_amx(monkeypatch):
    """The AMX paths, or a skip where the CPU lacks them (its instructions cannot run here)."""
    if not bf16.AMX:
        pytest.skip("this CPU has no AMX-BF16 (tile instructions): the AMX kernels cannot run here")
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"bf16", "bf16-prefill"}))


def use_dpbf16(monkeypatch):
    """The "dpbf16" path alone (AMX off: "bf16" would win), or a skip where the CPU lacks it."""
    if "dpbf16" not in cpu.host_paths():  # the instruction would trap (cpu.compiled_for)
        pytest.skip("this CPU has no AVX512-BF16 (vdpbf16ps): the dpbf16 kernels cannot run here")
    monkeypatch.setattr(bf16, "AMX", False)
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"int16", "dpbf16"}))


@pytest.fixture(params=[False, True], ids=["halves", "rounded"])
def rounding(request, amx, monkeypatch):
    """The AMX paths with activations as two bf16 halves, then rounded once ("bf16-round")."""
    if request.param:
        monkeypatch.setattr(cpu, "ENABLED", cpu.ENABLED | {"bf16-round"})
    return request.param


def _weights(rng, m, k):
    return formats.to_storage(rng.standard_normal((m, k)).astype(np.float32), BF16)


def _work(m, k, workers):
    """Scratch for `workers` work areas: gemm takes as many as fit."""
    return np.full(bf16.scratch_floats(m, k, workers), np.nan, np.float32)  # must not be read unwritten


def test_amx_is_detected_from_the_cpu():
    features = binding.get_host_cpu_features()
    assert bf16.AMX == bool(features.get("amx-bf16") and features.get("amx-tile"))


def test_split_keeps_sixteen_bits(rng):
    x = rng.standard_normal(10_000).astype(np.float32)
    hi, lo = bf16.split(x)
    assert np.array_equal(formats.to_f32(formats.to_storage(hi, BF16), BF16), hi)  # both are bf16 values
    assert np.array_equal(formats.to_f32(formats.to_storage(lo, BF16), BF16), lo)
    assert np.abs(hi - x).max() / np.abs(x).max() > 1e-3  # hi alone is bf16's 8 bits
    assert np.all(np.abs(hi + lo - x) <= np.abs(x) * 2.0**-16)


@pytest.mark.parametrize("n,k", [(5, 64), (37, 96)])
@pytest.mark.parametrize("lo", [True, False], ids=["halves", "hi-only"])
def test_pack_activations_layout(rng, amx, n, k, lo):
    """Both halves; with an xl of no rows (activations rounded once), hi alone, the same bits."""
    tokens = 64
    x = rng.standard_normal((n + 3, k)).astype(np.float32)
    xh, xl = np.zeros((tokens // 16, k * 16), np.uint16), np.zeros((tokens // 16 if lo else 0, k * 16), np.uint16)

    @numba.njit
    def pack(x, xh, xl):
        bf16.pack_activations(x, 2, n, (n + 15) // 16 * 16, xh, xl)

    pack(x, xh, xl)
    rows = (n + 15) // 16 * 16
    tokens_x = np.concatenate([x[2 : 2 + n], np.repeat(x[1 + n : 2 + n], rows - n, axis=0)])  # repeats the last
    for packed, half in zip((xh, xl) if lo else (xh,), bf16.split(tokens_x)):
        bits = formats.to_storage(half, BF16)  # [rows, k]
        # group of 16 tokens g, pair p, token t: the pair (bits[16 g + t, 2p], bits[16 g + t, 2p + 1])
        want = bits.reshape(rows // 16, 16, k // 2, 2).transpose(0, 2, 1, 3).reshape(rows // 16, k * 16)
        assert np.array_equal(packed[: rows // 16], want)
        assert not packed[rows // 16 :].any()  # groups past the last token untouched


@pytest.mark.parametrize("n,m,k", [(70, 64, 64), (300, 48, 576), (64, 96, 1024), (257, 160, 96), (16, 32, 64),
                                   (1, 16, 32)])
@pytest.mark.parametrize("workers", [1, 2])
def test_gemm_matches_reference(rng, rounding, n, m, k, workers):
    """Partial token blocks, a last block of 16 rows (m=48, 160), several depth blocks (k=576, 1024),
    a worker packing only padding tokens (n=16, 1 on two workers); out a column slice of a wider
    array (its rows further apart than m), the columns beside it untouched. Rounded: the products
    of bf16(x) alone, which two halves miss by far more than summation order."""
    x = rng.standard_normal((n, k)).astype(np.float32)
    w = _weights(rng, m, k)
    wide = np.full((n, m + 24), np.nan, np.float32)
    got, want = wide[:, 8 : 8 + m], np.empty((n, m), np.float32)
    bf16.gemm(x, w, got, _work(m, k, workers))
    bf16.gemm_ref(x, w, want, None)
    np.testing.assert_allclose(got, want, **TOL)
    assert np.isnan(wide[:, :8]).all() and np.isnan(wide[:, 8 + m :]).all()
    exact = x.astype(np.float64) @ formats.to_f32(w, BF16).T.astype(np.float64)
    error = np.abs(got - exact).max() / np.abs(exact).max()
    assert (1e-4 < error < 2e-2) if rounding else error < 2e-5, error


@pytest.mark.parametrize("name", list(quant.BLOCK_DTYPES))
@pytest.mark.parametrize("workers", [1, 2])
def test_gemm_of_blocks_matches_reference(rng, rounding, name, workers):
    """Every block type: a last group of 16 rows, partial token blocks, several depth blocks; rounded,
    bf16(x) meets both halves of the weights."""
    n, m, k = 300, 48, 768
    x = rng.standard_normal((n, k)).astype(np.float32)
    w = blocks(rng, name, m, k)
    got, want = np.empty((n, m), np.float32), np.empty((n, m), np.float32)
    bf16.gemm(x, w, got, _work(m, k, workers))
    bf16.gemm_ref(x, w, want, None)
    np.testing.assert_allclose(got, want, **TOL)
    exact = x.astype(np.float64) @ quant.dequantize(w).T.astype(np.float64)
    error = np.abs(got - exact).max() / np.abs(exact).max()
    assert (1e-4 < error < 2e-2) if rounding else error <= 2e-5, error  # bf16(x)'s 8 bits, or ~16 of each factor


@pytest.mark.parametrize("m,k", [(96, 576), (48, 2048)])  # rows sharing 4 KiB pages (prefetched), and not
def test_decode_rows_are_the_gemms_to_the_bit(rng, rounding, m, k):
    """rows_amx sums a token as gemm does, whatever the tokens beside it and the rows asked for."""
    x = rng.standard_normal((70, k)).astype(np.float32)
    w = _weights(rng, m, k)
    full = np.empty((70, m), np.float32)
    bf16.gemm(x, w, full, _work(m, k, 2))
    want = np.empty((70, m), np.float32)
    bf16.gemm_ref(x, w, want, None)
    np.testing.assert_allclose(full, want, **TOL)
    c = np.empty((bf16.TILE, bf16.TILE), np.float32)
    for n, (j0, j1) in ((1, (0, m)), (3, (16, 48)), (16, (5, 37)), (17, (0, m)), (40, (33, 34))):
        xh = np.empty(bf16.packed_shape(n, k), np.uint16)
        xl = np.empty((0, xh.shape[1]) if rounding else xh.shape, np.uint16)
        bf16.pack_tokens(x[:n], xh, xl)
        got = np.full((n, m), np.nan, np.float32)
        bf16.rows_amx(xh, xl, n, w, got, j0, j1, c)
        assert np.array_equal(got[:, j0:j1], full[:n, j0:j1]), (n, j0, j1)
        assert np.isnan(got[:, :j0]).all() and np.isnan(got[:, j1:]).all()  # nothing outside j0:j1


def test_packing_lays_out_b_tiles_and_unpacks(rng):
    m, k = 48, 96
    w = _weights(rng, m, k)
    packed = bf16.pack(w)
    assert packed.shape == (m // 16, k // 32) and bf16.is_packed(packed) and not bf16.is_packed(w)
    tiles = packed.view(np.uint16).reshape(m // 16, k // 32, 16, 32)
    for j, s, p, r, e in [(0, 0, 0, 0, 1), (2, 1, 15, 3, 0), (1, 2, 7, 15, 1)]:  # tile (j, s), pair row p, weight row r
        assert tiles[j, s, p, 2 * r + e] == w[16 * j + r, 32 * s + 2 * p + e]
    assert np.array_equal(bf16.unpack(packed), w)


@pytest.mark.parametrize("n,m,k", [(70, 64, 64), (300, 48, 576), (600, 96, 2048), (40, 48, 4096), (16, 32, 64),
                                   (1, 16, 32)])
@pytest.mark.parametrize("workers", [1, 2])
def test_packed_gemm_is_the_gemms_to_the_bit(rng, rounding, n, m, k, workers):
    """Weights packed at load, tokens as the A operand: gemm's sums to the bit, a last edge of fewer
    than 32 tokens (through the edge block), a last single tile of 16 rows (m = 48), several blocks of
    256 tokens (n = 600), passes over depth that resume the sums of the one before (k = 2,048 in two
    halves, k = 4,096 either way; the edge's too); out a column slice, the columns beside it untouched."""
    x = rng.standard_normal((n, k)).astype(np.float32)
    w = _weights(rng, m, k)
    want = np.empty((n, m), np.float32)
    bf16.gemm(x, w, want, _work(m, k, workers))
    wide = np.full((n, m + 24), np.nan, np.float32)
    got = wide[:, 8 : 8 + m]
    bf16.gemm_packed(x, bf16.pack(w), got, np.full(bf16.packed_scratch_floats(k, workers), np.nan, np.float32))
    assert np.array_equal(got, want)
    assert np.isnan(wide[:, :8]).all() and np.isnan(wide[:, 8 + m :]).all()
    reference = np.empty((n, m), np.float32)
    bf16.gemm_packed_ref(x, bf16.pack(w), reference)
    np.testing.assert_allclose(got, reference, **TOL)


@pytest.mark.parametrize("m,k", [(96, 576), (48, 2048)])
def test_packed_decode_rows_are_the_gemms_to_the_bit(rng, rounding, m, k):
    """rows_packed sums a token as gemm_packed does, whatever the tokens beside it and the rows asked for."""
    x = rng.standard_normal((70, k)).astype(np.float32)
    packed = bf16.pack(_weights(rng, m, k))
    full = np.empty((70, m), np.float32)
    bf16.gemm_packed(x, packed, full, np.empty(bf16.packed_scratch_floats(k), np.float32))
    c = np.empty((bf16.TILE, bf16.TILE), np.float32)
    for n, (j0, j1) in ((1, (0, m)), (3, (16, 48)), (16, (5, 37)), (17, (0, m)), (40, (33, 34))):
        xa = np.empty(bf16.packed_shape(n, k), np.uint16)
        xal = np.empty((0, xa.shape[1]) if rounding else xa.shape, np.uint16)
        bf16.pack_token_rows(x[:n], xa, xal)
        got = np.full((n, m), np.nan, np.float32)
        bf16.rows_packed(xa, xal, n, packed, got, j0, j1, c)
        assert np.array_equal(got[:, j0:j1], full[:n, j0:j1]), (n, j0, j1)
        assert np.isnan(got[:, :j0]).all() and np.isnan(got[:, j1:]).all()


def test_packed_parts_in_decode_and_prefill(rng, rounding):
    """A fusion of packed parts through matmul: decode (linear) gives prefill's bits in every row
    count, and both the unpacked weights' bits."""
    m, k = 80, 256
    x = rng.standard_normal((100, k)).astype(np.float32)
    parts = (_weights(rng, 48, k), _weights(rng, 32, k))
    packed = tuple(bf16.pack(p) for p in parts)
    scratch = np.empty(matmul.prefill_scratch_size(m, k), np.float32)
    prefill, unpacked = np.empty((100, m), np.float32), np.empty((100, m), np.float32)
    matmul.linear_prefill(x, packed, BF16, prefill, scratch)
    matmul.linear_prefill(x, parts, BF16, unpacked, scratch)
    assert np.array_equal(prefill, unpacked)
    for n in (1, 3, 16, 17, 63):
        got = np.empty((n, m), np.float32)
        matmul.linear(x[:n], packed, BF16, got)
        assert np.array_equal(got, prefill[:n]), n
    want = np.empty((3, m), np.float32)
    matmul.linear_ref(x[:3], packed, BF16, want)
    np.testing.assert_allclose(prefill[:3], want, **TOL)


def test_weights_are_packed_at_load_where_decode_runs_on_tiles(amx, monkeypatch):
    from ellmd.model.llama import logical_shape, repacked

    w = formats.to_storage(np.ones((64, 96), np.float32), BF16)
    assert bf16.packs(w, BF16) and not bf16.packs(w, F16) and not bf16.packs(w[:, :80].copy(), BF16)
    assert bf16.is_packed(repacked(w, BF16)) and logical_shape(repacked(w, BF16)) == (64, 96)
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"bf16-prefill"}))  # AMX in prefill only: decode's f32 rows
    kept = repacked(w, BF16)
    assert kept.dtype == np.uint16 and np.array_equal(kept, w)


def test_decode_takes_the_tiles_on_the_bf16_path_only(rng, rounding, monkeypatch):
    """linear (decode) on "bf16": a token's outputs are prefill's bits in every row count; on
    "bf16-prefill" alone decode stays on the f32 kernels."""
    m, k = 80, 256
    x = rng.standard_normal((100, k)).astype(np.float32)
    parts = (_weights(rng, 48, k), _weights(rng, 32, k))
    prefill = np.empty((100, m), np.float32)
    matmul.linear_prefill(x, parts, BF16, prefill, np.empty(matmul.prefill_scratch_size(m, k), np.float32))
    for n in (1, 3, 16, 17, 63):
        got = np.empty((n, m), np.float32)
        matmul.linear(x[:n], parts, BF16, got)
        assert np.array_equal(got, prefill[:n]), n
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"bf16-prefill"}))
    f32 = np.empty((3, m), np.float32)
    matmul.linear(x[:3], parts, BF16, f32)
    want = np.empty((3, m), np.float32)
    matmul.linear_ref(x[:3], parts, BF16, want)
    np.testing.assert_allclose(f32, want, **TOL)
    assert not np.array_equal(f32, prefill[:3])  # f32 FMA sums round otherwise


def test_linear_prefill_takes_the_gemm_for_blocks(rng, amx, monkeypatch):
    n, m, k = 130, 96, 256
    x = rng.standard_normal((n, k)).astype(np.float32)
    w = blocks(rng, "Q4_K", m, k)
    calls = _counting_gemm(monkeypatch)
    got, want = np.empty((n, m), np.float32), np.empty((n, m), np.float32)
    matmul.matmul(x, w, BF16, got, np.empty(matmul.prefill_scratch_size(m, k), np.float32))
    matmul.linear_ref(x, w, BF16, want)
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()
    assert calls == [(w.shape, True)]
    # the portable path; AMX's "bf16" alone (blocks decode on other kernels, so prefill does too)
    for enabled in (frozenset(), frozenset({"bf16"})):
        monkeypatch.setattr(cpu, "ENABLED", enabled)
        matmul.matmul(x, w, BF16, got, np.empty(matmul.prefill_scratch_size(m, k), np.float32))
        np.testing.assert_allclose(got, want, **TOL)
    assert calls == [(w.shape, True)]


def test_usable_shapes_and_the_paths_that_take_them(monkeypatch):
    assert bf16.usable(48, 64) and not bf16.usable(70, 64) and not bf16.usable(64, 48)
    monkeypatch.setattr(bf16, "AMX", True)
    assert bf16.tiles({"bf16"}) and bf16.decode_tiles({"bf16"})  # AMX in prefill and decode
    assert bf16.tiles({"bf16-prefill"}) and not bf16.decode_tiles({"bf16-prefill"})  # AMX in prefill only
    assert bf16.vdpbf16ps({"dpbf16"}) and not bf16.tiles({"dpbf16"})  # vdpbf16ps in prefill and decode
    assert not bf16.vdpbf16ps({"bf16", "dpbf16"}) and bf16.vdpbf16ps({"bf16-prefill", "dpbf16"})  # "bf16" wins
    assert not (bf16.tiles(frozenset()) or bf16.vdpbf16ps(frozenset()))  # the paths off
    assert bf16.rounded({"bf16", "bf16-round"}) and not bf16.rounded({"bf16"})  # activations rounded once, or split
    monkeypatch.setattr(bf16, "AMX", False)  # a CPU without AMX: the f32 kernels, or vdpbf16ps
    assert not (bf16.tiles({"bf16"}) or bf16.decode_tiles({"bf16"}) or bf16.tiles({"bf16", "bf16-prefill"}))
    assert bf16.vdpbf16ps({"bf16", "dpbf16"})


def _counting_gemm(monkeypatch):
    """bf16.gemm's calls: (weight shape, on AMX tiles)."""
    calls = []
    real = bf16.gemm

    def gemm(x, w, out, work, paths=None):
        calls.append((w.shape, bf16.tiles(paths)))
        real(x, w, out, work, paths)

    monkeypatch.setattr(bf16, "gemm", gemm)
    return calls


def test_linear_prefill_takes_the_gemm_only_on_its_path(rng, amx, monkeypatch):
    n, m, k = 130, 96, 192
    x = rng.standard_normal((n, k)).astype(np.float32)
    w = _weights(rng, m, k)
    scratch = np.empty(matmul.prefill_scratch_size(m, k), np.float32)
    calls = _counting_gemm(monkeypatch)
    got, want = np.empty((n, m), np.float32), np.empty((n, m), np.float32)
    matmul.matmul(x, w, BF16, got, scratch)
    matmul.linear_ref(x, w, BF16, want, frozenset())  # the f32 kernels' reference
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()  # hi + lo: ~16 bits of each activation
    assert calls == [((m, k), True)]

    monkeypatch.setattr(cpu, "ENABLED", frozenset())  # the portable path
    matmul.matmul(x, w, BF16, got, scratch)
    np.testing.assert_allclose(got, want, **TOL)
    monkeypatch.setattr(cpu, "ENABLED", frozenset({"bf16"}))
    monkeypatch.setattr(bf16, "AMX", False)  # a CPU with AVX512-BF16 but no AMX
    matmul.matmul(x, w, BF16, got, scratch)
    np.testing.assert_allclose(got, want, **TOL)
    assert calls == [((m, k), True)]


def test_other_weights_stay_on_the_f32_kernels(rng, amx, monkeypatch):
    n, k = 100, 96
    x = rng.standard_normal((n, k)).astype(np.float32)
    calls = _counting_gemm(monkeypatch)
    cases = ((_weights(rng, 40, 90), BF16, 90), (_weights(rng, 40, k), BF16, k),  # k % 32, m % 16
             (rng.standard_normal((32, k)).astype(np.float32), F32, k))
    for w, fmt, width in cases:
        xs = np.ascontiguousarray(x[:, :width])
        got, want = np.empty((n, w.shape[0]), np.float32), np.empty((n, w.shape[0]), np.float32)
        matmul.linear_prefill(xs, w, fmt, got, np.empty(matmul.prefill_scratch_size(*w.shape), np.float32))
        matmul.linear_ref(xs, w, fmt, want)
        np.testing.assert_allclose(got, want, **TOL)
    assert calls == []


def test_fused_weights_write_their_column_slices(rng, amx, monkeypatch):
    n, k = 96, 128
    x = rng.standard_normal((n, k)).astype(np.float32)
    parts = (_weights(rng, 64, k), _weights(rng, 32, k))
    calls = _counting_gemm(monkeypatch)
    got = np.empty((n, 96), np.float32)
    matmul.matmul(x, parts, BF16, got, np.empty(matmul.prefill_scratch_size(96, k), np.float32))
    want = np.empty((n, 96), np.float32)
    bf16.gemm_ref(x, np.concatenate(parts), want, None)
    np.testing.assert_allclose(got, want, **TOL)
    assert calls == [((64, k), True), ((32, k), True)]


# --- attention on bf16 products, AMX or vdpbf16ps (prefill here; decode against prefill in
# test_head_dim.py) ---------------------------------------------------------------------------


def _attention_inputs(rng, n, start, kvh, group, hd, q_scale=1.0):
    seq = start + n + 5  # positions past the chunk hold keys that must stay unseen
    q = (rng.standard_normal((n, kvh * group, hd)) * q_scale).astype(np.float32)
    k = formats.to_storage(rng.standard_normal((kvh, seq, hd)).astype(np.float32), BF16)
    v = formats.to_storage(rng.standard_normal((kvh, seq, hd)).astype(np.float32), BF16)
    return q, k, v


def _bf16_attention(q, k, v, start, threads):
    """attention_prefill, its tasks shared as among `threads` threads: on bf16 products where head_dim
    allows (AMX: a multiple of 16, vdpbf16ps: of 32; else the f32 kernels, the same bound)."""
    out = np.full(q.shape, np.nan, np.float32)
    attention._prefill(q, k, v, start, q.shape[2] ** -0.5, out, threads, attention.products(BF16, q.shape[2]))
    return out


@pytest.mark.parametrize(
    "n,start,kvh,group,hd",
    [
        (1, 0, 2, 3, 64),
        (70, 0, 3, 3, 64),  # SmolLM2 heads; queries of a group straddle tiles of 16 rows
        (45, 100, 1, 1, 128),  # MHA, start not a multiple of the key tile
        (131, 37, 2, 4, 128),
        (200, 5, 1, 4, 80),  # head_dim not a multiple of 32: zero-padded depth
        (3, 300, 2, 1, 40),
        (600, 10, 1, 2, 64),  # 1,200 rows: two query blocks of a kv head
        (256, 2000, 3, 3, 64),  # a chunk over a long history
    ],
)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_bf16_attention_matches_reference(rng, bf16_products, n, start, kvh, group, hd, threads):
    q, k, v = _attention_inputs(rng, n, start, kvh, group, hd)
    got = _bf16_attention(q, k, v, start, threads)
    want = np.empty_like(q)
    attention.attention_prefill_ref(q, k, v, BF16, start, hd**-0.5, want)
    bound = 2.0**-8 * float(np.abs(formats.to_f32(v, BF16)).max())
    assert np.abs(got - want).max() <= bound
    assert np.abs(got - want).mean() <= bound / 20  # typical errors are far below the bound


@pytest.mark.parametrize("n,start,hd", [(256, 2000, 64), (50, 4097, 80), (300, 0, 128)])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_attention_key_ranges_exact(rng, bf16_products, n, start, hd, threads):
    """Zero queries: every visible key weighs exactly 1 (exact in bf16), so the output is the
    plain mean of the visible values, and one key too many or too few shows at f32 precision."""
    q, k, v = _attention_inputs(rng, n, start, 2, 3, hd, q_scale=0.0)
    got = _bf16_attention(q, k, v, start, threads)
    want = np.empty_like(q)
    attention.attention_prefill_ref(q, k, v, BF16, start, hd**-0.5, want)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_bf16_attention_constant_values_stay_constant(rng, bf16_products):
    """The normalizer sums the very bf16 weights the values product uses: a constant column of
    values comes out unchanged, however the weights were rounded (to the f32 summation order of
    ~1,100 weights: vdpbf16ps sums the products in pairs, the normalizer in a tree; weights rounded
    apart would show at bf16's 2**-9)."""
    q, k, v = _attention_inputs(rng, 200, 900, 2, 2, 64, q_scale=3.0)
    column = formats.to_storage(np.full(v.shape[:2], 1.7, np.float32), BF16)
    v[:, :, 5] = column
    got = _bf16_attention(q, k, v, 900, 2)
    np.testing.assert_allclose(got[:, :, 5], formats.to_f32(column[0, 0], BF16), rtol=5e-6)


def _counting_prefill(monkeypatch):
    calls = []
    real = attention._prefill

    def prefill(*args):
        calls.append(args[-1])  # on AMX tiles or not
        real(*args)

    monkeypatch.setattr(attention, "_prefill", prefill)
    return calls


def test_attention_takes_amx_only_on_its_path(rng, amx, monkeypatch):
    n, start, hd = 40, 70, 64
    q, k, v = _attention_inputs(rng, n, start, 2, 2, hd)
    calls = _counting_prefill(monkeypatch)
    want = np.empty_like(q)
    attention.attention_prefill_ref(q, k, v, BF16, start, hd**-0.5, want)
    got = np.empty_like(q)
    attention.attention_prefill(q, k, v, BF16, start, hd**-0.5, got)
    assert np.abs(got - want).max() <= 2.0**-8 * np.abs(formats.to_f32(v, BF16)).max()

    for fmt in (F16, F32):  # KV kept in f16 or f32 for its precision: the f32 kernels
        kf = formats.to_storage(formats.to_f32(k, BF16), fmt)
        vf = formats.to_storage(formats.to_f32(v, BF16), fmt)
        attention.attention_prefill(q, kf, vf, fmt, start, hd**-0.5, got)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # the "bf16" path off (AMX for the untiled blocks alone), or a CPU without AMX: the f32 kernels
    for enabled, has_amx in ((frozenset({"bf16-prefill"}), True), (frozenset({"bf16"}), False)):
        monkeypatch.setattr(cpu, "ENABLED", enabled)
        monkeypatch.setattr(bf16, "AMX", has_amx)
        attention.attention_prefill(q, k, v, BF16, start, hd**-0.5, got)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [True, False, False, False, False]


@numba.njit(cache=True)
def _softmax_vectors(s, m, m0, best, total, p, cols):
    bf16.column_max(s, m, m0, best, cols)
    bf16.exp_pairs(s, best, total, p, cols)


def test_column_max_and_exp_pairs(rng, amx):
    rows, width, cols, m0 = 64, 128, 96, 7
    s = (rng.standard_normal((rows, width)) * 30).astype(np.float32)
    s[:, 3] = -3e30  # a column of hidden scores under a finite running max
    m = (rng.standard_normal(m0 + width) * 30).astype(np.float32)
    best, total = np.full(width, np.nan, np.float32), np.full(width, np.nan, np.float32)
    p = np.zeros((rows // 2, width), np.uint32)
    _softmax_vectors(s, m, m0, best, total, p, cols)
    want_max = np.maximum(m[m0 : m0 + cols], s[:, :cols].max(axis=0))
    np.testing.assert_array_equal(best[:cols], want_max)
    assert np.isnan(best[cols:]).all() and np.isnan(total[cols:]).all() and not p[:, cols:].any()
    e = np.exp(s[:, :cols].astype(np.float64) - want_max).astype(np.float32)  # [rows, cols]
    bits = np.stack([p[:, :cols] & 0xFFFF, p[:, :cols] >> 16], axis=1).reshape(rows, cols).astype(np.uint16)
    got = formats.to_f32(bits, BF16)
    np.testing.assert_allclose(got, e, rtol=2.0**-8, atol=1e-37)  # bf16 of exp, 2 ulp f32 before rounding
    assert (got[:, 3] == 0).all()
    np.testing.assert_allclose(total[:cols], got.astype(np.float64).sum(axis=0), rtol=1e-6)
