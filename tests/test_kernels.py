"""Each numba kernel against its numpy reference, on random inputs of awkward shapes.

bf16/f16 storage: kernel and reference read the same stored values, so tolerances stay those of
float32 arithmetic.
"""

import math
import os
from importlib import import_module

import numba
import numpy as np
import pytest

from ellmd.kernels import cpu
from ellmd.kernels.formats import BF16, F16, F32
from arrays import randn

# The modules themselves: ellmd.kernels re-exports functions named like some of them (rope, matmul).
activations, attention, formats, matmul, moe, norm, rope, tile = (
    import_module(f"ellmd.kernels.{name}")
    for name in ("activations", "attention", "formats", "matmul", "moe", "norm", "rope", "tile")
)

FORMATS = [F32, BF16, F16]
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# --- formats -----------------------------------------------------------------------------


@numba.njit(cache=True)
def _decode_all(bits, out_bf16, out_f16):
    for i in range(bits.shape[0]):
        out_bf16[i] = formats.bf16_to_f32(bits[i])
        out_f16[i] = formats.f16_to_f32(bits[i])


@numba.njit(cache=True)
def _encode_all(x, out_bf16, out_f16):
    for i in range(x.shape[0]):
        out_bf16[i] = formats.f32_to_bf16(x[i])
        out_f16[i] = formats.f32_to_f16(x[i])


def _same_bits_or_both_nan(a, b):
    nan = np.isnan(a)
    assert np.array_equal(nan, np.isnan(b))
    assert np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))


def test_storage_helpers(rng):
    x = randn(rng, 5, 7)
    for fmt in FORMATS:
        s = formats.to_storage(x, fmt)
        assert s.dtype == formats.storage_dtype(fmt)
        assert s.itemsize == formats.bytes_per_element(fmt)
        tol = {F32: 0, BF16: 2**-8, F16: 2**-10}[fmt]
        np.testing.assert_allclose(formats.to_f32(s, fmt), x, rtol=tol, atol=1e-4 if fmt == F16 else 0)
    assert formats.FORMAT_NAMES == {"f32": F32, "bf16": BF16, "f16": F16}
    # round to nearest even, overflow to inf, NaN stays NaN
    bits = np.array([0x3F808000, 0x3F818000, 0x3F80C000, 0x7F7FFFFF], np.uint32).view(np.float32)
    assert formats.to_storage(bits, BF16).tolist() == [0x3F80, 0x3F82, 0x3F81, 0x7F80]
    assert np.isnan(formats.to_f32(formats.to_storage(np.array([np.nan], np.float32), BF16), BF16)[0])


def test_aligned_arrays_start_a_cache_line(rng):
    from ellmd.kernels import aligned

    for shape, dtype in [((3, 5), np.float32), (7, np.uint16), ((2, 3, 4), np.int64)]:
        a = aligned.zeros(shape, dtype)
        assert (a.shape, a.dtype, a.ctypes.data % 64, a.flags.c_contiguous) == (np.empty(shape).shape, dtype, 0, True)
        assert not a.any()
    skewed = aligned.empty(64 * 41, np.uint8)[16 : 16 + 64 * 40].view(np.float32).reshape(40, 16)  # numpy's usual 16
    skewed[:] = randn(rng, *skewed.shape)
    moved = aligned.on_line(skewed)
    assert moved.ctypes.data % 64 == 0 and np.array_equal(moved, skewed) and moved is not skewed
    assert aligned.on_line(moved) is moved


def test_numba_decode_every_pattern():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    got_bf16, got_f16 = np.empty(65536, np.float32), np.empty(65536, np.float32)
    _decode_all(bits, got_bf16, got_f16)
    _same_bits_or_both_nan(formats.to_f32(bits, BF16), got_bf16)
    _same_bits_or_both_nan(formats.to_f32(bits, F16), got_f16)


def test_numba_encode_matches_numpy(rng):
    finite16 = formats.to_f32(np.arange(65536, dtype=np.uint32).astype(np.uint16), F16)
    finite16 = np.unique(finite16[np.isfinite(finite16)].astype(np.float64))
    halfway = ((finite16[1:] + finite16[:-1]) / 2).astype(np.float32)  # ties of f16 rounding
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65520, 2**-25, 2**-24, 1e-30, 3e38], np.float32)
    random_bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([halfway, -halfway, special, random_bits, randn(rng, 10_000)])
    got_bf16, got_f16 = np.empty(x.size, np.uint16), np.empty(x.size, np.uint16)
    _encode_all(x, got_bf16, got_f16)
    nan = np.isnan(x)
    with np.errstate(over="ignore", invalid="ignore"):
        for fmt, got in ((BF16, got_bf16), (F16, got_f16)):
            assert np.array_equal(got[~nan], formats.to_storage(x, fmt)[~nan])
            assert np.isnan(formats.to_f32(got[nan], fmt)).all()


# --- elementwise -------------------------------------------------------------------------


@numba.njit(cache=True)
def _exp_all(x, out):
    for i in range(x.shape[0]):
        out[i] = activations.exp_f32(x[i])


def test_exp_f32():
    x = np.concatenate([np.linspace(-90, 88, 200_001, dtype=np.float32), np.array([-np.inf, -1e30], np.float32)])
    got = np.empty_like(x)
    _exp_all(x, got)
    want = np.exp(x.astype(np.float64))
    normal = x >= -87.33  # e**x a normal float32
    assert np.max(np.abs(got[normal] - want[normal]) / want[normal]) < 2.5e-7
    assert np.all(got[x < -87.34] == 0.0)  # no denormals, and exp(-inf) == 0


@pytest.mark.parametrize("n,d", [(1, 64), (3, 129), (600, 128)])
def test_rmsnorm(rng, n, d):
    x, w = randn(rng, n, d, scale=3.0), randn(rng, d)
    got, want = np.empty_like(x), np.empty_like(x)
    norm.rmsnorm(x, w, 1e-6, got)
    norm.rmsnorm_ref(x, w, 1e-6, want)
    np.testing.assert_allclose(got, want, **TOL)
    norm.rmsnorm(x, w, 1e-6, x)  # in place
    np.testing.assert_allclose(x, want, **TOL)


@numba.njit
def _sum_squares(row):
    return norm.sum_squares(row)


@pytest.mark.parametrize("d", [37, 128, 576, 2048])
def test_the_order_of_a_sum_of_squares(rng, d):
    """rmsnorm's sum of squares in its one order: 16 partial sums (value j in lane j % 16, an fma a
    value), then the lanes in order, the same bits in every compiled copy."""
    x = randn(rng, d, scale=3.0)
    lanes = np.zeros(16, np.float32)
    for j in range(d):  # fma in float32: the product is exact in float64, the sum rounded once
        lanes[j % 16] = np.float32(np.float64(x[j]) * np.float64(x[j]) + np.float64(lanes[j % 16]))
    want = lanes[0]
    for lane in lanes[1:]:
        want = np.float32(want + lane)
    assert _sum_squares(x) == want


def test_rmsnorm_per_head_view(rng):
    q = randn(rng, 5, 4, 64)  # [n, heads, hd]: Qwen3's q norm runs on a [n*heads, hd] view
    w = randn(rng, 64)
    want = np.empty((20, 64), np.float32)
    norm.rmsnorm_ref(q.reshape(20, 64), w, 1e-6, want)
    flat = q.reshape(20, 64)
    norm.rmsnorm(flat, w, 1e-6, flat)
    np.testing.assert_allclose(q.reshape(20, 64), want, **TOL)


def test_rmsnorm_heads_strided(rng):
    qkv = randn(rng, 6, 4 + 2 + 2, 64)  # fused q, k, v heads: q is a strided [n, 4, hd] view
    w = randn(rng, 64)
    want = qkv[:, :4].copy()
    norm.rmsnorm_heads_ref(want, w, 1e-6)
    norm.rmsnorm_heads(qkv[:, :4], w, 1e-6)
    np.testing.assert_allclose(qkv[:, :4], want, **TOL)


@pytest.mark.parametrize("n,inter", [(1, 17), (4, 1536), (300, 256)])
def test_silu_mul(rng, n, inter):
    gu = randn(rng, n, 2 * inter, scale=4.0)
    got, want = np.empty((n, inter), np.float32), np.empty((n, inter), np.float32)
    activations.silu_mul(gu, got)
    activations.silu_mul_ref(gu, want)
    np.testing.assert_allclose(got, want, **TOL)
    last = np.empty((1, inter), np.float32)
    activations.silu_mul(gu[-1:], last)  # alone on the calling thread, the same bits as among many rows
    assert np.array_equal(last[0], got[-1])


# --- rope --------------------------------------------------------------------------------


def _hf_inv_freq(head_dim, theta, scaling, max_pos):
    """transformers' ROPE_INIT_FUNCTIONS, restated with numpy float32 like torch's float32."""
    f32 = np.float32
    exponent = np.arange(0, head_dim, 2).astype(f32) / f32(head_dim)
    pos_freqs = lambda base: np.array([f32(float(base) ** float(e)) for e in exponent], f32)  # noqa: E731
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return f32(1) / pos_freqs(theta), 1.0
    if kind == "linear":
        return f32(1) / pos_freqs(theta) / f32(scaling["factor"]), 1.0
    if kind == "dynamic":  # at max_position_embeddings the base is unchanged
        return f32(1) / pos_freqs(theta), 1.0
    if kind == "llama3":
        inv = f32(1) / pos_freqs(theta)
        factor, lo_f, hi_f = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = f32(2 * math.pi) / inv
        out = np.where(wavelen > old / lo_f, inv / f32(factor), inv)
        smooth = (f32(old) / wavelen - f32(lo_f)) / f32(hi_f - lo_f)
        smoothed = (f32(1) - smooth) * out / f32(factor) + smooth * out
        medium = (wavelen >= old / hi_f) & (wavelen <= old / lo_f)
        return np.where(medium, smoothed, out).astype(f32), 1.0
    assert kind == "yarn"
    factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
    attn = 0.1 * math.log(factor) + 1.0
    dim_for = lambda rot: head_dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
    low = max(math.floor(dim_for(scaling.get("beta_fast", 32))), 0)
    high = min(math.ceil(dim_for(scaling.get("beta_slow", 1))), head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2).astype(f32) - f32(low)) / f32(high - low), f32(0), f32(1))
    extra = f32(1) - ramp
    pf = pos_freqs(theta)
    inv = (f32(1) / (f32(factor) * pf)) * (f32(1) - extra) + (f32(1) / pf) * extra
    return inv.astype(f32), attn


@pytest.mark.parametrize(
    "head_dim,theta,scaling,max_pos",
    [
        (64, 100000.0, None, 8192),
        (128, 1000000.0, None, 40960),
        (64, 10000.0, {"type": "linear", "factor": 4.0}, 2048),
        (64, 10000.0, {"type": "dynamic", "factor": 2.0}, 4096),
        (128, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 131072),
        (128, 1000000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
    ],
)
def test_rope_tables(head_dim, theta, scaling, max_pos):
    length = 3000
    cos, sin = rope.rope_tables(head_dim, theta, scaling, max_pos, length)
    assert cos.shape == sin.shape == (length, head_dim // 2) and cos.dtype == np.float32
    inv, attn = _hf_inv_freq(head_dim, theta, scaling, max_pos)
    angles = np.arange(length, dtype=np.float32)[:, None] * inv[None, :]  # float32 products, as torch
    np.testing.assert_allclose(cos, np.cos(angles.astype(np.float64)) * attn, rtol=0, atol=1e-6)
    np.testing.assert_allclose(sin, np.sin(angles.astype(np.float64)) * attn, rtol=0, atol=1e-6)


def test_rope_tables_rejects_unknown_type():
    with pytest.raises(ValueError):
        rope.rope_tables(64, 10000.0, {"rope_type": "longrope"}, 4096, 8)


@pytest.mark.parametrize("n,heads,hd", [(1, 9, 64), (5, 3, 128), (300, 4, 64)])
def test_rope(rng, n, heads, hd):
    cos, sin = rope.rope_tables(hd, 10000.0, None, 4096, 2048)
    x = randn(rng, n, heads, hd)
    positions = rng.integers(0, 2048, n).astype(np.int64)
    got, want = x.copy(), x.copy()
    rope.rope(got, positions, cos, sin)
    rope.rope_ref(want, positions, cos, sin)
    np.testing.assert_allclose(got, want, **TOL)


# --- matmul ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,m,k", [(1, 7, 5), (2, 33, 70), (3, 64, 129), (5, 257, 64), (16, 96, 200), (7, 40, 576)])
def test_linear(rng, fmt, n, m, k):
    w = formats.to_storage(randn(rng, m, k), fmt)
    x = randn(rng, n, k)
    got, want = np.empty((n, m), np.float32), np.empty((n, m), np.float32)
    matmul.linear(x, w, fmt, got)
    matmul.linear_ref(x, w, fmt, want)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    for i in range(n):  # a row alone sums in the order it does among the others, to the bit
        alone = np.empty((1, m), np.float32)
        matmul.linear(x[i : i + 1], w, fmt, alone)
        assert np.array_equal(alone[0], got[i]), f"row {i}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,m,k", [(70, 70, 33), (130, 1100, 300)])
def test_linear_prefill_and_dispatch(rng, fmt, n, m, k):
    w = formats.to_storage(randn(rng, m, k), fmt)
    x = randn(rng, n, k)
    scratch = np.empty(matmul.prefill_scratch_size(m, k), np.float32)
    want = np.empty((n, m), np.float32)
    matmul.linear_prefill_ref(x, w, fmt, want, scratch)
    got = np.empty((n, m), np.float32)
    matmul.linear_prefill(x, w, fmt, got, scratch)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    for rows in (1, n):  # both sides of the dispatcher
        got = np.empty((rows, m), np.float32)
        matmul.matmul(x[:rows], w, fmt, got, scratch)
        np.testing.assert_allclose(got, want[:rows], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_embed(rng, fmt):
    table = formats.to_storage(randn(rng, 50, 24), fmt)
    tokens = rng.integers(0, 50, 11).astype(np.int64)
    got, want = np.empty((11, 24), np.float32), np.empty((11, 24), np.float32)
    matmul.embed(tokens, table, fmt, got)
    matmul.embed_ref(tokens, table, fmt, want)
    np.testing.assert_array_equal(got, want)


# --- attention ---------------------------------------------------------------------------


@pytest.mark.parametrize("tall", [False, True])
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_tile(rng, fmt, transpose_a, tall):
    rows, cols, depth = (12 if tall else 8), 32, 37
    a = randn(rng, depth + 1, rows + 4) if transpose_a else randn(rng, rows + 4, depth + 1)
    bt = formats.to_storage(randn(rng, depth + 2, cols + 16), fmt)
    bt_kernel = bt.view(np.int16) if fmt == F16 else bt  # kernels see f16 as int16
    for accumulate in (False, True):
        c = randn(rng, rows + 4, cols + 16)
        want = c.copy()
        tile.gemm_tile(a, transpose_a, bt_kernel, c, rows, cols, depth, accumulate, tall)
        tile.gemm_tile_ref(a, transpose_a, formats.to_f32(bt, fmt), want, rows, cols, depth, accumulate)
        np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "fmt,n,start,kvh,group,hd",
    [
        (BF16, 1, 0, 2, 3, 64),
        (BF16, 70, 0, 3, 3, 64),  # SmolLM2 heads, n not a multiple of the tile
        (F32, 45, 100, 1, 1, 128),  # start offset, MHA
        (F16, 131, 37, 2, 4, 128),
        (BF16, 200, 5, 1, 4, 64),
        (F16, 3, 300, 2, 1, 64),  # a short chunk after a long history
        (F32, 50, 20, 2, 2, 72),  # head_dim padded to the kernel's columns
        (BF16, 40, 700, 1, 8, 64),  # many key tiles, query rows past one tall block
    ],
)
def test_attention_prefill(rng, monkeypatch, fmt, n, start, kvh, group, hd):
    """The f32 kernels (the AMX path of bf16 KV has tests of its own in test_bf16.py)."""
    monkeypatch.setattr(cpu, "ENABLED", frozenset())
    heads = kvh * group
    seq = start + n + 7
    q = randn(rng, n, heads, hd)
    k = formats.to_storage(randn(rng, kvh, seq, hd), fmt)
    v = formats.to_storage(randn(rng, kvh, seq, hd), fmt)
    got, want = np.empty_like(q), np.empty_like(q)
    attention.attention_prefill(q, k, v, fmt, start, hd**-0.5, got)
    attention.attention_prefill_ref(q, k, v, fmt, start, hd**-0.5, want)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("n,start", [(20, 300), (5, 0), (9, 2100)])
def test_attention_prefill_key_splits(rng, n, start):
    """A short chunk's segments shared among 3 threads, on any machine (the f32 kernels; the AMX
    path's in test_bf16.py)."""
    kvh, group, hd = 2, 3, 64
    q = randn(rng, n, kvh * group, hd)
    k = formats.to_storage(randn(rng, kvh, start + n, hd), BF16)
    v = formats.to_storage(randn(rng, kvh, start + n, hd), BF16)
    got, want = np.full_like(q, np.nan), np.empty_like(q)
    attention._prefill(q, k, v, start, hd**-0.5, got, 3, False)
    attention.attention_prefill_ref(q, k, v, BF16, start, hd**-0.5, want)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("n,kvh,group", [(240, 3, 3), (100, 3, 3), (240, 1, 9), (7, 3, 3)])
def test_attention_prefill_tasks_even_for_the_threads(rng, n, kvh, group):
    """A chunk's (kv head, query block) tasks come in a multiple of the threads where smaller blocks
    make them so (SmolLM2's 3 kv heads and a 240-token turn: 18 tasks for 2 threads, not 15 split
    8 / 7), and a query's output is the same bits whatever block it falls in."""
    qb, nqb = attention._task_queries(n, kvh, group, 2)
    assert (kvh * nqb) % 2 == 0 and (nqb - 1) * qb < n <= nqb * qb
    hd, start = 64, 500
    q = randn(rng, n, kvh * group, hd)
    k = formats.to_storage(randn(rng, kvh, start + n, hd), BF16)
    v = formats.to_storage(randn(rng, kvh, start + n, hd), BF16)
    blocks_for_one, blocks_for_two = np.full_like(q, np.nan), np.full_like(q, np.nan)
    attention._prefill(q, k, v, start, hd**-0.5, blocks_for_one, 1, False)
    attention._prefill(q, k, v, start, hd**-0.5, blocks_for_two, 2, False)
    assert np.array_equal(blocks_for_one.view(np.uint32), blocks_for_two.view(np.uint32))


@pytest.mark.parametrize(
    "fmt,lengths,kvh,group,hd",
    [
        (BF16, [1, 7, 300, 1100], 3, 3, 64),
        (F16, [1200, 5], 2, 4, 128),
        (F32, [1], 1, 1, 128),
        (BF16, [2048, 999, 64], 2, 8, 64),
    ],
)
def test_attention_decode(rng, fmt, lengths, kvh, group, hd):
    heads, batch, slots, seq = kvh * group, len(lengths), 6, 2048
    q = randn(rng, batch, heads, hd)
    k = formats.to_storage(randn(rng, slots, kvh, seq, hd), fmt)
    v = formats.to_storage(randn(rng, slots, kvh, seq, hd), fmt)
    slot_ids = rng.permutation(slots)[:batch].astype(np.int64)
    lengths = np.array(lengths, np.int64)
    shapes = attention.decode_scratch_shapes(batch + 2, heads, hd, 4, seq)
    scratch = [np.full(shapes[name], np.nan, np.float32) for name in ("partial_m", "partial_l", "partial_acc", "tile")]
    got, want = np.empty_like(q), np.empty_like(q)
    attention.attention_decode(q, k, v, fmt, slot_ids, lengths, hd**-0.5, got, *scratch)
    attention.attention_decode_ref(q, k, v, fmt, slot_ids, lengths, hd**-0.5, want, *scratch)
    if attention.products(fmt, hd) != attention.ON_F32:  # bf16 probabilities: within 2**-8 x max|v| (test_bf16.py)
        assert np.abs(got - want).max() <= 2.0**-8 * np.abs(formats.to_f32(v, fmt)).max()
    else:
        np.testing.assert_allclose(got, want, **TOL)
    for b in range(batch):  # each row alone, to the bit: its key splits follow its own length only
        alone = np.empty_like(q[:1])
        attention.attention_decode(q[b : b + 1], k, v, fmt, slot_ids[b : b + 1], lengths[b : b + 1], hd**-0.5, alone,
                                   *scratch)
        assert np.array_equal(alone[0], got[b]), f"row {b}"


def test_decode_matches_prefill_of_last_token(rng, monkeypatch):
    monkeypatch.setattr(cpu, "ENABLED", frozenset())  # the f32 prefill kernels: decode's arithmetic
    kvh, group, hd, seq = 2, 3, 64, 500
    k = formats.to_storage(randn(rng, 1, kvh, seq, hd), BF16)
    v = formats.to_storage(randn(rng, 1, kvh, seq, hd), BF16)
    q = randn(rng, 1, kvh * group, hd)
    shapes = attention.decode_scratch_shapes(1, kvh * group, hd, 2, seq)
    scratch = [np.zeros(shapes[name], np.float32) for name in ("partial_m", "partial_l", "partial_acc", "tile")]
    dec, pre = np.empty_like(q), np.empty_like(q)
    attention.attention_decode(q, k, v, BF16, np.zeros(1, np.int64), np.array([seq], np.int64), 0.125, dec, *scratch)
    attention.attention_prefill(q, k[0], v[0], BF16, seq - 1, 0.125, pre)
    assert np.array_equal(dec, pre)  # decode computes a row as prefill computes its query


@pytest.mark.parametrize(
    "fmt,kvh,group,hd,total",
    [(BF16, 3, 3, 64, 1300), (F16, 2, 1, 128, 300), (F32, 2, 2, 72, 200), (BF16, 1, 12, 64, 2200)],
)
def test_attention_one_arithmetic(rng, monkeypatch, fmt, kvh, group, hd, total):
    """A query's output is the same bits in one prefill, in chunks of any size, and in a decode step
    (across segment boundaries; head_dim padded; groups past FEW_ROWS take the packed scores)."""
    monkeypatch.setattr(cpu, "ENABLED", frozenset())
    heads = kvh * group
    q = randn(rng, total, heads, hd)
    k = formats.to_storage(randn(rng, kvh, total, hd), fmt)
    v = formats.to_storage(randn(rng, kvh, total, hd), fmt)
    full = np.empty_like(q)
    attention.attention_prefill(q, k, v, fmt, 0, hd**-0.5, full)
    for chunk in (1, 7, 333):
        pieces = np.empty_like(q)
        for s in range(0, total, chunk):
            attention.attention_prefill(q[s : s + chunk], k, v, fmt, s, hd**-0.5, pieces[s : s + chunk])
        assert np.array_equal(pieces, full), chunk
    shapes = attention.decode_scratch_shapes(2, heads, hd, 2, total)
    scratch = [np.full(shapes[name], np.nan, np.float32) for name in ("partial_m", "partial_l", "partial_acc", "tile")]
    for pos in sorted({0, 63, 64, attention.SEGMENT - 1, attention.SEGMENT, total - 1} - set(range(total, 9999))):
        one = np.empty_like(q[:1])
        attention.attention_decode(q[pos : pos + 1], k[None], v[None], fmt, np.zeros(1, np.int64),
                                   np.array([pos + 1]), hd**-0.5, one, *scratch)
        assert np.array_equal(one[0], full[pos]), pos


# --- moe ---------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("n,experts,top_k", [(1, 8, 2), (7, 128, 8), (64, 16, 4)])
def test_route(rng, normalize, n, experts, top_k):
    logits = randn(rng, n, experts, scale=2.0)
    logits[0, :3] = logits[0, 3]  # ties go to the lower index
    got_w, want_w = np.empty((n, top_k), np.float32), np.empty((n, top_k), np.float32)
    got_e, want_e = np.empty((n, top_k), np.int64), np.empty((n, top_k), np.int64)
    moe.route(logits, top_k, normalize, got_w, got_e)
    moe.route_ref(logits, top_k, normalize, want_w, want_e)
    np.testing.assert_array_equal(got_e, want_e)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-6, atol=1e-7)
    if normalize:
        np.testing.assert_allclose(got_w.sum(axis=1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,experts,top_k,hidden,inter", [(1, 8, 2, 32, 48), (6, 16, 4, 64, 40), (40, 8, 2, 48, 32)])
def test_moe_experts(rng, fmt, n, experts, top_k, hidden, inter):
    x = randn(rng, n, hidden)
    weights, chosen = np.empty((n, top_k), np.float32), np.empty((n, top_k), np.int64)
    moe.route(randn(rng, n, experts), top_k, True, weights, chosen)
    gate_up = formats.to_storage(randn(rng, experts, 2 * inter, hidden, scale=0.2), fmt)
    down = formats.to_storage(randn(rng, experts, hidden, inter, scale=0.2), fmt)
    scratch = moe.moe_scratch(64, top_k, experts, hidden, inter)
    got, want = np.full((n, hidden), np.nan, np.float32), np.empty((n, hidden), np.float32)
    moe.moe_experts(x, chosen, weights, gate_up, down, fmt, got, scratch)
    moe.moe_experts_ref(x, chosen, weights, gate_up, down, fmt, want, scratch)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


def test_kernel_cache_folder_follows_every_kernel_source(tmp_path):
    import shutil
    from pathlib import Path

    import ellmd.kernels

    package = Path(ellmd.kernels.__file__).parent
    if not os.environ.get("NUMBA_CACHE_DIR"):
        assert numba.config.CACHE_DIR == ellmd.kernels.cache_dir(package)
    for source in package.glob("*.py"):
        shutil.copy(source, tmp_path)
    before = ellmd.kernels.cache_dir(tmp_path)
    assert before == ellmd.kernels.cache_dir(package)  # the sources' contents, not their place
    quant = tmp_path / "quant.py"
    quant.write_text(quant.read_text() + "\n")  # an edit of a file other kernels inline
    assert ellmd.kernels.cache_dir(tmp_path) != before


def test_kernel_cache_entries_do_not_depend_on_the_checkout_path(tmp_path):
    """A fresh clone of the same sources loads the kernels another clone compiled (CI clones
    afresh; numba's own locator hashed the absolute path, so every clone compiled ~2 min)."""
    import ellmd.kernels
    from ellmd.kernels import norm

    locator = ellmd.kernels.CheckoutLocator.from_function(norm.rmsnorm.py_func, norm.__file__)
    assert locator.get_cache_path() == os.path.join(numba.config.CACHE_DIR, "kernels")
    elsewhere = tmp_path / "norm.py"  # a module outside the kernels is left to numba's locators
    elsewhere.write_text("def f():\n    return 1\n")
    assert ellmd.kernels.CheckoutLocator.from_function(norm.rmsnorm.py_func, str(elsewhere)) is None
    if not os.environ.get("NUMBA_CACHE_DIR"):
        assert isinstance(norm.rmsnorm._cache._impl.locator, ellmd.kernels.CheckoutLocator)
