"""Attention, rope and the KV cache at head_dims that are not a multiple of the SIMD width (16):
12 (all of it past the SIMD kernel's columns), 40 and 80 (a remainder of 8 and none), beside 64
and 128; kernels against their numpy references, with GQA, several slots and every KV format.
Prefill attention runs on the f32 kernels ("portable") and on the default paths, which take
AMX tiles for bf16 KV where the CPU has them (bf16 probabilities: within 2**-8 x max|v|, as
test_bf16.py bounds them). An odd head_dim is refused when the model is loaded, as
transformers cannot run one either.
"""

import json
from importlib import import_module

import numpy as np
import pytest

from ellmd.engine.kvcache import KVCache
from ellmd.errors import ModelError
from ellmd.kernels.formats import BF16, F16, F32
from ellmd.model.spec import ModelSpec
from arrays import randn

attention, formats, rope = (import_module(f"ellmd.kernels.{name}") for name in ("attention", "formats", "rope"))

HEAD_DIMS = [12, 40, 80, 64, 128]
FORMATS = [F32, BF16, F16]
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def rng():
    return np.random.default_rng(4321)


def assert_attention_close(got, want, q, v, fmt):
    """f32 kernels to f32 rounding; AMX tiles, where they ran, within 2**-8 x max|v|."""
    if attention.products(fmt, q.shape[2]) != attention.ON_F32:
        assert np.abs(got - want).max() <= 2.0**-8 * np.abs(formats.to_f32(v, fmt)).max()
    else:
        np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("hd", HEAD_DIMS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_store_kv(rng, fmt, hd):
    n, kvh, slots, seq = 6, 2, 3, 20
    k_new, v_new = randn(rng, n, kvh, hd), randn(rng, n, kvh, hd)
    slot_ids = rng.integers(0, slots, n).astype(np.int64)
    positions = rng.permutation(seq)[:n].astype(np.int64)
    dtype = formats.storage_dtype(fmt)
    got = [np.zeros((slots, kvh, seq, hd), dtype) for _ in range(2)]
    want = [np.zeros((slots, kvh, seq, hd), dtype) for _ in range(2)]
    attention.store_kv(k_new, v_new, got[0], got[1], fmt, slot_ids, positions)
    attention.store_kv_ref(k_new, v_new, want[0], want[1], fmt, slot_ids, positions)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    # the last column of every stored entry was written (a kernel that stops short leaves zeros)
    assert np.all(formats.to_f32(got[1], fmt)[slot_ids, :, positions, hd - 1] != 0)


@pytest.mark.parametrize("hd", HEAD_DIMS)
@pytest.mark.parametrize(
    "fmt,n,start,kvh,group",
    [
        (BF16, 70, 0, 2, 3),  # GQA, n not a multiple of the key tile
        (F16, 9, 130, 2, 4),  # a short chunk after a history of several tiles
        (F32, 1, 40, 1, 1),  # one token, MHA
    ],
)
@pytest.mark.parametrize("kernels", ["portable", "default"])
def test_attention_prefill(rng, use_kernels, kernels, fmt, n, start, kvh, group, hd):
    use_kernels(kernels)
    heads, seq = kvh * group, start + n + 5
    q = randn(rng, n, heads, hd)
    k = formats.to_storage(randn(rng, kvh, seq, hd), fmt)
    v = formats.to_storage(randn(rng, kvh, seq, hd), fmt)
    got, want = np.full_like(q, np.nan), np.empty_like(q)
    attention.attention_prefill(q, k, v, fmt, start, hd**-0.5, got)
    attention.attention_prefill_ref(q, k, v, fmt, start, hd**-0.5, want)
    assert_attention_close(got, want, q, v, fmt)


@pytest.mark.parametrize("hd", HEAD_DIMS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kernels", ["portable", "default"])
def test_prefill_rows_do_not_depend_on_the_chunking(rng, use_kernels, kernels, fmt, hd):
    """A query's output is the same bits in one chunk of 1,100 or in chunks of 1, 99 and 1,000 (the
    segments, key tiles and sums of a row are its own, on the f32 kernels and on AMX tiles)."""
    use_kernels(kernels)
    kvh, group, n = 2, 3, 1100
    q = randn(rng, n, kvh * group, hd)
    k = formats.to_storage(randn(rng, kvh, n, hd), fmt)
    v = formats.to_storage(randn(rng, kvh, n, hd), fmt)
    whole, parts = np.empty_like(q), np.empty_like(q)
    attention.attention_prefill(q, k, v, fmt, 0, hd**-0.5, whole)
    for a, b in ((0, 1), (1, 100), (100, n)):
        attention.attention_prefill(q[a:b], k, v, fmt, a, hd**-0.5, parts[a:b])
    assert np.array_equal(whole, parts)


@pytest.mark.parametrize("hd", HEAD_DIMS)
@pytest.mark.parametrize(
    "fmt,lengths,kvh,group",
    [
        (BF16, [1, 7, 300, 1500], 2, 3),  # the parallel split-K path, GQA
        (F16, [65, 2], 2, 4),  # short: the calling thread
        (F32, [900, 1], 1, 1),  # MHA: the single-row passes
        (BF16, [2100, 33], 2, 2),  # groups of 2 (Qwen3-1.7B): the two-row passes
        (F32, [700], 1, 6),  # a block of 4 rows and one of 2
        (F16, [130, 1300], 1, 5),  # a block of 4 rows and one of 1
    ],
)
def test_attention_decode(rng, fmt, lengths, kvh, group, hd):
    heads, batch, slots, seq = kvh * group, len(lengths), 5, 2100
    q = randn(rng, batch, heads, hd)
    k = formats.to_storage(randn(rng, slots, kvh, seq, hd), fmt)
    v = formats.to_storage(randn(rng, slots, kvh, seq, hd), fmt)
    slot_ids = rng.permutation(slots)[:batch].astype(np.int64)
    lengths = np.array(lengths, np.int64)
    shapes = attention.decode_scratch_shapes(batch + 1, heads, hd, 4, seq)
    scratch = [np.full(shapes[name], np.nan, np.float32) for name in ("partial_m", "partial_l", "partial_acc", "tile")]
    got, want = np.full_like(q, np.nan), np.empty_like(q)
    attention.attention_decode(q, k, v, fmt, slot_ids, lengths, hd**-0.5, got, *scratch)
    attention.attention_decode_ref(q, k, v, fmt, slot_ids, lengths, hd**-0.5, want, *scratch)
    assert_attention_close(got, want, q, v, fmt)


@pytest.mark.parametrize("hd", [12, 40, 80])
@pytest.mark.parametrize("kernels", ["portable", "default"])
def test_decode_matches_prefill_of_last_token(rng, use_kernels, kernels, hd):
    use_kernels(kernels)
    kvh, group, seq = 2, 4, 333
    k = formats.to_storage(randn(rng, 1, kvh, seq, hd), BF16)
    v = formats.to_storage(randn(rng, 1, kvh, seq, hd), BF16)
    q = randn(rng, 1, kvh * group, hd)
    shapes = attention.decode_scratch_shapes(1, kvh * group, hd, 2, seq)
    scratch = [np.zeros(shapes[name], np.float32) for name in ("partial_m", "partial_l", "partial_acc", "tile")]
    dec, pre = np.empty_like(q), np.empty_like(q)
    attention.attention_decode(q, k, v, BF16, np.zeros(1, np.int64), np.array([seq], np.int64), hd**-0.5, dec, *scratch)
    attention.attention_prefill(q, k[0], v[0], BF16, seq - 1, hd**-0.5, pre)
    assert np.array_equal(dec, pre)  # decode computes a row as prefill computes its query, to the bit


@pytest.mark.parametrize("hd", [12, 40, 80])
def test_rope(rng, hd):
    cos, sin = rope.rope_tables(hd, 10000.0, None, 4096, 512)
    assert cos.shape == (512, hd // 2)
    x = randn(rng, 7, 3, hd)
    positions = rng.integers(0, 512, 7).astype(np.int64)
    got, want = x.copy(), x.copy()
    rope.rope(got, positions, cos, sin)
    rope.rope_ref(want, positions, cos, sin)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kv_bytes_and_roundtrip(rng, fmt):
    layers, slots, kvh, seq, hd = 2, 2, 3, 16, 40
    kv = KVCache(layers, slots, kvh, seq, hd, fmt)
    assert kv.bytes_per_token == 2 * layers * kvh * hd * formats.bytes_per_element(fmt)
    assert kv.nbytes == KVCache.nbytes_for(layers, slots, kvh, seq, hd, fmt) == seq * slots * kv.bytes_per_token
    kv.commit()
    kv.k[:, 0, :, :5] = formats.to_storage(randn(rng, layers, kvh, 5, hd), fmt)
    kv.v[:, 0, :, :5] = formats.to_storage(randn(rng, layers, kvh, 5, hd), fmt)
    kv.lengths[0] = 5
    data = kv.export(0, 1, 5)
    assert len(data) == 4 * kv.bytes_per_token
    kv.import_(1, 0, kv.export(0, 0, 1))
    assert kv.import_(1, 1, data) == 5
    np.testing.assert_array_equal(kv.k[:, 1, :, :5], kv.k[:, 0, :, :5])
    np.testing.assert_array_equal(kv.v[:, 1, :, :5], kv.v[:, 0, :, :5])


def _config(**overrides):
    config = dict(
        model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )
    return {**config, **overrides}


@pytest.mark.parametrize("head_dim", [12, 40])
def test_even_head_dim_loads(head_dim):
    assert ModelSpec.from_config(_config(head_dim=head_dim)).head_dim == head_dim


def test_odd_head_dim_is_a_model_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_config(head_dim=41)))
    with pytest.raises(ModelError, match="head_dim 41 is odd"):
        ModelSpec.from_file(tmp_path / "config.json")
    # implied by hidden_size / heads (here 60 / 4 = 15)
    with pytest.raises(ModelError, match="head_dim 15 is odd"):
        ModelSpec.from_config(_config(hidden_size=60))
    fields = {
        "general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 48,
        "llama.block_count": 1, "llama.vocab_size": 64, "llama.attention.key_length": 9, "llama.feed_forward_length": 96,
    }
    with pytest.raises(ModelError, match="head_dim 9 is odd"):
        ModelSpec.from_gguf(fields)
