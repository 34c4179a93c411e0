"""The KV cache held in blocks (q8_0, q4_0, rotated or not): kernels against their numpy references,
and the rotation's point (outliers spread over the blocks)."""

import numba
import numpy as np
import pytest

from ellmd.engine.kvcache import KVCache
from ellmd.kernels import attention, kv_blocks, quant, quant_int
from ellmd.kernels.kv_blocks import Q4_0, Q4_0_PLAIN, Q8_0, Q8_0_ROTATED
from arrays import randn

FORMATS = [Q8_0, Q8_0_ROTATED, Q4_0, Q4_0_PLAIN]
TOL = dict(rtol=1e-5, atol=1e-5)
# q8_0 keys score on int16 query codes (test_q8_0_key_scores_are_integer_sums): a score moves by up
# to ~2**-16 of a block's largest product, an output by a few 1e-5
INTEGER_TOL = dict(rtol=1e-4, atol=1e-4)


def tol(key_fmt):
    """The tolerance against the float64 references for keys in key_fmt."""
    return INTEGER_TOL if kv_blocks.INTEGER_KEYS and key_fmt in (Q8_0, Q8_0_ROTATED) else TOL


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def stored(rng, fmt, *shape):
    """Random values quantized by the reference: [..., hd] -> blocks."""
    return kv_blocks.quantize_ref(randn(rng, *shape), fmt)


def test_hadamard_is_orthogonal_and_its_own_inverse(rng):
    for hd in (64, 96, 128):
        h = kv_blocks.hadamard_matrix(hd)
        np.testing.assert_allclose(h @ h.T, np.eye(hd), atol=1e-12)
        x = randn(rng, hd)
        y = x.copy()
        kv_blocks.hadamard(y)
        np.testing.assert_allclose(y, h @ x, rtol=1e-5, atol=1e-5)
        kv_blocks.hadamard(y)
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5)


def test_unrotated_blocks_are_ggufs(rng):
    """q4_0 is GGUF's Q4_0; q8_0 is GGUF's Q8_0 rule, over 64 values a block where head_dim allows."""
    x = randn(rng, 5, 96)
    assert kv_blocks.quantize_ref(x, Q8_0).tobytes() == quant.quantize(x, "Q8_0").tobytes()
    assert kv_blocks.quantize_ref(x, Q4_0_PLAIN).tobytes() == quant.quantize(x, "Q4_0").tobytes()
    x = np.clip(randn(rng, 5, 128), -3.9, 3.9)
    x[:, ::32] = 4.0  # every 32 values share GGUF's scale 4 / 127, so its codes are ours
    blocks = kv_blocks.quantize_ref(x, Q8_0)
    assert blocks.dtype.itemsize == 66 and blocks.shape == (5, 2)
    raw = blocks.view(np.uint8).reshape(5, 2, 66)
    gguf = quant.quantize(x, "Q8_0").view(np.uint8).reshape(5, 4, 34)
    assert raw[:, :, :2].tobytes() == gguf[:, ::2, :2].tobytes()
    assert raw[:, :, 2:].tobytes() == np.concatenate([gguf[:, ::2, 2:], gguf[:, 1::2, 2:]], axis=-1).tobytes()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("hd", [64, 128, 96])
def test_store_blocks(rng, fmt, hd):
    """Writing tokens quantizes them exactly as gguf's quantizer does (after the rotation)."""
    kvh, slots, seq, n = 3, 2, 16, 5
    dtype, nb = kv_blocks.storage(fmt, hd)
    k_new, v_new = randn(rng, n, kvh, hd), randn(rng, n, kvh, hd)
    slot_ids = np.array([0, 1, 1, 0, 1], np.int64)
    positions = np.array([3, 0, 7, 15, 2], np.int64)
    got = [np.zeros((slots, kvh, seq, nb), dtype) for _ in range(2)]
    want = [np.zeros((slots, kvh, seq, nb), dtype) for _ in range(2)]
    attention.store_kv(k_new.copy(), v_new.copy(), *got, fmt, slot_ids, positions)  # rotated in place
    kv_blocks.store_blocks_ref(k_new, v_new, *want, fmt, slot_ids, positions)
    for g, w in zip(got, want):
        if not kv_blocks.rotated(fmt):
            assert g.tobytes() == w.tobytes()
        else:  # float32 butterflies against the float64 matrix: a rare code one step apart
            assert np.mean(g.view(np.uint8) != w.view(np.uint8)) < 0.01
    # what attention reads back is the value within the format's step
    back = kv_blocks.dequantize_ref(got[0][slot_ids, :, positions], fmt)
    step = 0.25 if fmt in (Q4_0, Q4_0_PLAIN) else 0.02
    assert np.abs(back - k_new).max() < step * np.abs(k_new).max()


@pytest.mark.parametrize("fmt", [Q4_0, Q4_0_PLAIN])
def test_key_mean_is_subtracted_before_quantization(rng, fmt):
    """Keys near a large common offset m (as a model's are) stored as k - m: the bytes are the
    reference's, the keys come back far closer than stored without m, and attention over them is
    attention over the true keys (q . (k - m) shifts every key's score of a query alike)."""
    kvh, group, hd, n = 2, 2, 64, 48
    m = 4 * randn(rng, kvh, hd)  # [kvh, hd]
    keys, values = m + 0.05 * randn(rng, n, kvh, hd), randn(rng, n, kvh, hd)  # [n, kvh, hd]
    slot_ids, positions = np.zeros(n, np.int64), np.arange(n, dtype=np.int64)
    dtype, nb = kv_blocks.storage(fmt, hd)
    centred, plain, want = ([np.zeros((1, kvh, n, nb), dtype) for _ in range(2)] for _ in range(3))
    attention.store_kv(keys.copy(), values.copy(), *centred, fmt, slot_ids, positions, key_mean=m)
    attention.store_kv(keys.copy(), values.copy(), *plain, fmt, slot_ids, positions)
    kv_blocks.store_blocks_ref(keys, values, *want, fmt, slot_ids, positions, m)
    assert np.mean(centred[0].view(np.uint8) != want[0].view(np.uint8)) < 0.01  # (float32 butterflies)
    assert centred[1].tobytes() == plain[1].tobytes()  # values untouched
    true_keys = keys.transpose(1, 0, 2)[None]  # [1, kvh, n, hd]
    error_centred = np.abs(kv_blocks.dequantize_ref(centred[0], fmt) + m[:, None] - true_keys).max()
    error_plain = np.abs(kv_blocks.dequantize_ref(plain[0], fmt) - true_keys).max()
    assert error_centred < 0.04 and error_plain > 10 * error_centred, (error_centred, error_plain)

    q = randn(rng, 1, kvh * group, hd)
    shapes = attention.decode_scratch_shapes(1, kvh * group, hd, 2, n)
    scratch = [np.zeros(shapes[name], np.float32) for name in ("partial_m", "partial_l", "partial_acc", "tile")]
    lengths, v32 = np.array([n], np.int64), kv_blocks.dequantize_ref(centred[1], fmt)
    exact, got = np.empty_like(q), {}
    attention.attention_decode_ref(q, true_keys, v32, kv_blocks.F32, slot_ids[:1], lengths, 1.0, exact, *scratch)
    for name, (k, v) in (("centred", centred), ("plain", plain)):
        got[name] = np.empty_like(q)
        attention.attention_decode(q, k, v, fmt, slot_ids[:1], lengths, 1.0, got[name], *scratch)
    error = {name: np.abs(out - exact).max() for name, out in got.items()}
    assert error["centred"] < 0.05 * np.abs(exact).max() and error["plain"] > 10 * error["centred"], error


@numba.njit
def _tile(head, k0, nk, dst):
    kv_blocks.dequantize_rows(head, k0, nk, dst)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("hd", [32, 64, 96, 128])
def test_tile_conversion_is_scale_times_code(rng, fmt, hd):
    """Attention's tile of keys in float32 is each block's scale times its codes, bit for bit (the
    values as stored: rotated ones stay rotated), whatever the tile's place in the head."""
    head = stored(rng, fmt, 300, hd)
    plain = {Q8_0_ROTATED: Q8_0, Q4_0: Q4_0_PLAIN}.get(fmt, fmt)  # the same bytes, read without the rotation
    want = kv_blocks.dequantize_ref(head.view(kv_blocks.storage(plain, hd)[0]), plain)
    dst = np.full((64, hd + 16), np.nan, np.float32)  # wider than a row, as attention's padded tiles
    for k0, nk in ((0, 64), (64, 64), (250, 50), (299, 1)):
        _tile(head, k0, nk, dst)
        np.testing.assert_array_equal(dst[:nk, :hd], want[k0 : k0 + nk])


@numba.njit
def _integer_scores(qs, head, t0, nk, rows, qc, qd, out):
    kv_blocks.quantize_queries(head, qs, rows, qc, qd)
    quant_int.key_scores(qc, qd, head, t0, nk, rows, out)


@pytest.mark.skipif(not kv_blocks.INTEGER_KEYS, reason="the CPU has neither AVX512-VNNI nor AVX2")
@pytest.mark.parametrize("fmt", [Q8_0, Q8_0_ROTATED])
@pytest.mark.parametrize("hd", [32, 64, 96, 128])
def test_q8_0_key_scores_are_integer_sums(rng, fmt, hd):
    """q8_0 keys' scores: each query row quantized to int16 with one scale per key block, the exact
    integer sums of codes times codes over a block, times the two scales, blocks in order (the
    reference's numbers, whatever the tile's place, rows and output layout); within 2**-15 of a
    block's largest product of the float scores on the same keys."""
    head = stored(rng, fmt, 300, hd)
    values = kv_blocks.block_values(fmt, hd)
    qs = randn(rng, 7, hd)
    qs[3] = 0.0  # a zero row: scale 0, scores 0
    qc_ref, qd_ref = kv_blocks.quantize_queries_ref(qs, values)
    want = kv_blocks.key_scores_ref(qc_ref, qd_ref, head)  # [rows, S]
    for t0, nk, rows in ((0, 64, 7), (236, 64, 5), (299, 1, 1), (100, 37, 3)):
        qc = np.full((8, hd), -1, np.int16)
        qd = np.full((8, hd // 32), np.nan, np.float32)
        out = np.full((64, 8), np.nan, np.float32)  # transposed, as prefill's scores
        _integer_scores(qs, head, t0, nk, rows, qc, qd, out[:nk, :rows].T)
        np.testing.assert_array_equal(qc[:rows], qc_ref[:rows])
        # max |x| / 32767 to one rounding: under fastmath the division may run as a product by 1 / 32767
        np.testing.assert_allclose(qd[:rows, : hd // values], qd_ref[:rows], rtol=2.0**-23, atol=0)
        np.testing.assert_allclose(out[:nk, :rows].T, want[:rows, t0 : t0 + nk], rtol=1e-6, atol=1e-30)
        assert np.isnan(out[nk:]).all() and np.isnan(out[:, rows:]).all()
    assert not want[3].any()
    keys = kv_blocks.dequantize_ref(head.view(kv_blocks.storage(Q8_0, hd)[0]), Q8_0)  # as stored, not rotated back
    exact = qs.astype(np.float64) @ keys.T.astype(np.float64)
    bound = np.abs(qs).max() * np.abs(keys).max() * hd * 2.0**-15
    assert np.abs(want - exact).max() < bound


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lengths,kvh,group,hd", [([1, 70, 2100], 2, 3, 64), ([300], 1, 2, 128), ([65, 9], 2, 1, 96),
                                                  ([5000], 2, 4, 64)])
def test_attention_decode_blocks(rng, fmt, lengths, kvh, group, hd):
    heads, batch, slots, seq = kvh * group, len(lengths), 4, 5000
    q = randn(rng, batch, heads, hd)
    k, v = stored(rng, fmt, slots, kvh, seq, hd), stored(rng, fmt, slots, kvh, seq, hd)
    slot_ids = rng.permutation(slots)[:batch].astype(np.int64)
    lengths = np.array(lengths, np.int64)
    shapes = attention.decode_scratch_shapes(batch + 2, heads, hd, 2, seq)
    scratch = [np.full(shapes[name], np.nan, np.float32) for name in ("partial_m", "partial_l", "partial_acc", "tile")]
    got, want = np.empty_like(q), np.empty_like(q)
    attention.attention_decode(q, k, v, fmt, slot_ids, lengths, hd**-0.5, got, *scratch)
    k32, f32 = kv_blocks.as_f32(k, fmt)
    v32, _ = kv_blocks.as_f32(v, fmt)
    attention.attention_decode_ref(q, k32, v32, f32, slot_ids, lengths, hd**-0.5, want, *scratch)
    np.testing.assert_allclose(got, want, **tol(fmt))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,start,kvh,group,hd", [(1, 0, 2, 3, 64), (37, 100, 1, 4, 128), (200, 0, 2, 2, 96)])
def test_attention_prefill_blocks(rng, fmt, n, start, kvh, group, hd):
    seq = start + n + 10
    q = randn(rng, n, kvh * group, hd)
    k, v = stored(rng, fmt, kvh, seq, hd), stored(rng, fmt, kvh, seq, hd)
    got, want = np.empty_like(q), np.empty_like(q)
    attention.attention_prefill(q, k, v, fmt, start, hd**-0.5, got)
    k32, f32 = kv_blocks.as_f32(k, fmt)
    v32, _ = kv_blocks.as_f32(v, fmt)
    attention.attention_prefill_ref(q, k32, v32, f32, start, hd**-0.5, want)
    np.testing.assert_allclose(got, want, **tol(fmt))


def test_rotation_spreads_an_outlier(rng):
    """A key with one large channel (as real models' keys have): q4_0 loses the rest of its block
    unless rotated."""
    x = randn(rng, 200, 64)
    x[:, 5] *= 30.0
    errors = {}
    for fmt in (Q4_0, Q4_0_PLAIN):
        back = kv_blocks.dequantize_ref(kv_blocks.quantize_ref(x, fmt), fmt)
        errors[fmt] = np.sqrt(np.mean((back - x)[:, :32] ** 2))
    assert errors[Q4_0] < 0.5 * errors[Q4_0_PLAIN]


@pytest.mark.parametrize("fmt,ratio", [(Q8_0, 66 / 128), (Q4_0, 18 / 64)])
def test_bytes_per_token(fmt, ratio):
    """SmolLM2-135M's shape: 30 layers, 3 kv heads, head_dim 64."""
    bf16 = KVCache(30, 1, 3, 8, 64, 1)
    blocks = KVCache(30, 1, 3, 8, 64, fmt)
    assert bf16.bytes_per_token == 23_040
    assert blocks.bytes_per_token == 23_040 * ratio
    assert blocks.nbytes == KVCache.nbytes_for(30, 1, 3, 8, 64, fmt) == 8 * blocks.bytes_per_token


def test_head_dim_not_in_blocks_is_refused():
    with pytest.raises(ValueError, match="head_dim that is a multiple of 32"):
        KVCache(2, 1, 1, 8, 80, Q8_0)


# keys and values in two formats: rotated q8_0 keys with rotated q4_0 values, and plain q4_0 keys
# with rotated q8_0 values (the values' accumulator is rotated back by the values' format)
PAIRS = [kv_blocks.KV_DTYPES["q8_0/q4_0"], kv_blocks.KV_DTYPES["q4_0-plain/q8_0"]]


@pytest.mark.parametrize("pair", PAIRS)
def test_keys_and_values_in_two_formats(rng, pair):
    """Each array is written and read in its own format: store, decode and prefill against the
    references on the keys' and the values' formats."""
    key_fmt, value_fmt = kv_blocks.key_value_formats(pair)
    kvh, group, hd, slots, seq = 2, 3, 64, 3, 300
    kv = KVCache(1, slots, kvh, seq, hd, pair)
    assert kv.k.dtype == kv_blocks.storage(key_fmt, hd)[0] and kv.v.dtype == kv_blocks.storage(value_fmt, hd)[0]
    k_new, v_new = randn(rng, 4, kvh, hd), randn(rng, 4, kvh, hd)
    slot_ids, positions = np.array([0, 1, 2, 2], np.int64), np.array([5, 0, 9, 3], np.int64)
    attention.store_kv(k_new.copy(), v_new.copy(), kv.k[0], kv.v[0], pair, slot_ids, positions)
    for held, new, fmt in ((kv.k[0], k_new, key_fmt), (kv.v[0], v_new, value_fmt)):
        want = kv_blocks.quantize_ref(new, fmt)
        assert np.mean(held[slot_ids, :, positions].view(np.uint8) != want.view(np.uint8)) < 0.01

    k = kv_blocks.quantize_ref(randn(rng, slots, kvh, seq, hd), key_fmt)
    v = kv_blocks.quantize_ref(randn(rng, slots, kvh, seq, hd), value_fmt)
    (k32, f32), (v32, _) = kv_blocks.as_f32(k, key_fmt), kv_blocks.as_f32(v, value_fmt)
    q = randn(rng, 2, kvh * group, hd)
    lengths, slot_ids = np.array([7, 280], np.int64), np.array([2, 0], np.int64)
    shapes = attention.decode_scratch_shapes(4, kvh * group, hd, 2, seq)
    scratch = [np.full(shapes[name], np.nan, np.float32) for name in ("partial_m", "partial_l", "partial_acc", "tile")]
    got, want = np.empty_like(q), np.empty_like(q)
    attention.attention_decode(q, k, v, pair, slot_ids, lengths, hd**-0.5, got, *scratch)
    attention.attention_decode_ref(q, k32, v32, f32, slot_ids, lengths, hd**-0.5, want, *scratch)
    np.testing.assert_allclose(got, want, **tol(key_fmt))

    q = randn(rng, 70, kvh * group, hd)
    got, want = np.empty_like(q), np.empty_like(q)
    attention.attention_prefill(q, k[1], v[1], pair, 100, hd**-0.5, got)
    attention.attention_prefill_ref(q, k32[1], v32[1], f32, 100, hd**-0.5, want)
    np.testing.assert_allclose(got, want, **tol(key_fmt))


def test_bytes_per_token_of_two_formats():
    """q8_0 keys and q4_0 values: SmolLM2-135M's 11,880 / 2 + 6,480 / 2 bytes a token, 0.40x bf16's."""
    kv = KVCache(30, 1, 3, 8, 64, kv_blocks.KV_DTYPES["q8_0/q4_0"])
    assert kv.bytes_per_token == 9_180 and kv.bytes_per_token / 23_040 < 0.4
    assert kv.nbytes == 8 * kv.bytes_per_token
