"""GGUF blocks with outputs in lanes (kernels/lanes.py), Q8_0, Q5_0, Q4_0, Q4_1, Q4_K and Q6_K: the tiles hold
the GGUF's values, the GEMM/GEMV agrees with numpy, and every output is one chain of float steps,
whatever the batch."""

import json
from collections import Counter

import numpy as np
import pytest

from ellmd import kernels
from ellmd.kernels import cpu, lanes, quant

pytestmark = pytest.mark.skipif("int16" not in cpu.host_paths(),
                                reason="the int16 path needs AVX512-VNNI+BW or AVX2, which this CPU lacks")


@pytest.fixture
def rng():
    return np.random.default_rng(25)


@pytest.fixture
def int16_path(use_kernels):
    """The tiles on int16 codes whatever ELLM_KERNELS says (the int8 path has tests of its own)."""
    use_kernels("int16")


FORMATS = ["Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]


def weights(rng, m, k, name="Q8_0"):
    from test_quant import blocks

    return blocks(rng, name, m, k)


def product(x, tiles, m, workers=2):
    out = np.full((x.shape[0], m), np.nan, np.float32)
    lanes.linear_lanes(x, tiles, out, workers)
    return out


@pytest.mark.parametrize("name, size", [("Q8_0", 34), ("Q5_0", 22), ("Q4_0", 18), ("Q4_1", 20), ("Q4_K", 144),
                                        ("Q6_K", 210)])
def test_repack_keeps_the_values(rng, name, size):
    w = weights(rng, 37, 768, name)
    tiles = lanes.repack(w)
    assert tiles.shape == (3, w.shape[1])  # tiles of 16 rows
    assert lanes.is_tiles(tiles) and lanes.block_name(tiles) == name and lanes.columns(tiles) == 768
    assert tiles.dtype.itemsize == 16 * size + (64 if name == "Q4_K" else 0)  # Q4_K: 12 bytes of scales as 16
    assert not lanes.is_tiles(w) and not quant.is_blocks(tiles)
    values = lanes.dequantize_ref(tiles)
    np.testing.assert_array_equal(values[:37], quant.dequantize(w))
    assert not values[37:].any()  # rows past m: zero


def test_q8_0_tiles_keep_the_blocks(rng):
    w = weights(rng, 37, 576)
    tiles = lanes.repack(w)
    assert tiles.shape == (3, 18) and tiles.dtype.itemsize == 544  # 544 = 16 x 34: the same bytes a block
    scales, codes = lanes.tile_scales_ref(tiles), lanes.tile_codes_ref(tiles)
    np.testing.assert_array_equal(scales[:37], w["d"].view(np.float16).astype(np.float32))
    np.testing.assert_array_equal(codes[:37], w["qs"].reshape(37, -1))
    assert not scales[37:].any() and not codes[37:].any()  # rows past m: zero


@pytest.mark.parametrize("k", [576, 1536, 2048])
@pytest.mark.parametrize("n", [1, 3, 7, 64, 130])
@pytest.mark.parametrize("name", FORMATS)
def test_matches_numpy(rng, int16_path, name, n, k):
    if k % quant.BLOCK_SIZES[name]:
        k = 768
    m = 16 * 5 + 9  # a last tile of 9 rows
    w, x = weights(rng, m, k, name), rng.standard_normal((n, k)).astype(np.float32)
    tiles = lanes.repack(w)
    got = product(x, tiles, m)
    want = np.zeros((n, m), np.float32)
    lanes.linear_lanes_ref(x, tiles, want, 2)
    assert np.abs(got - want).max() <= 4e-6 * np.abs(want).max()
    exact = x.astype(np.float64) @ quant.dequantize(w).astype(np.float64).T  # int16 activations: ~1e-4 off at most
    assert np.abs(got - exact).max() <= 1e-4 * np.abs(exact).max()


@pytest.mark.parametrize("name", FORMATS)
def test_a_row_alike_in_every_batch(rng, int16_path, name):
    k, m = 1536, 16 * 7 + 5
    w, x = weights(rng, m, k, name), rng.standard_normal((130, k)).astype(np.float32)
    tiles = lanes.repack(w)
    whole = product(x, tiles, m)
    for i in range(130):  # alone (decode), one worker
        np.testing.assert_array_equal(product(x[i : i + 1], tiles, m, workers=1)[0], whole[i])
    for n in (3, 7, 64):  # other batches: other register blocks and left-over rows
        for i0 in (0, 5, 130 - n):
            np.testing.assert_array_equal(product(x[i0 : i0 + n], tiles, m, workers=1), whole[i0 : i0 + n])


@pytest.mark.parametrize("name", sorted(lanes.INT8_BLOCKS))
def test_tiles_on_int8_codes(rng, use_kernels, name):
    """On the "int8" path (AVX2) the tiles of 4- to 6-bit codes take int8 activation codes: numpy on
    those codes to float32 rounding, int8's error against the exact product (not int16's), and a row's bits the
    same alone (decode) as in any batch."""
    use_kernels("int16,int8")
    k, m = 1536, 16 * 5 + 9
    w, x = weights(rng, m, k, name), rng.standard_normal((130, k)).astype(np.float32)
    tiles = lanes.repack(w)
    assert lanes.int8_codes(tiles)
    whole = product(x, tiles, m)
    want = np.zeros((130, m), np.float32)
    lanes.linear_lanes_ref(x, tiles, want, 2)
    assert np.abs(whole - want).max() <= 4e-6 * np.abs(want).max()
    exact = x.astype(np.float64) @ quant.dequantize(w).astype(np.float64).T
    assert 1e-4 < np.abs(whole - exact).max() / np.abs(exact).max() <= 2e-2  # int16 codes: ~3e-5
    for i in (0, 1, 64, 129):  # alone (decode), one worker
        np.testing.assert_array_equal(product(x[i : i + 1], tiles, m, workers=1)[0], whole[i])
    for n in (3, 7, 64):  # other batches: other register blocks and left-over rows
        np.testing.assert_array_equal(product(x[5 : 5 + n], tiles, m, workers=1), whole[5 : 5 + n])


def f32_fma(a, b, c):
    """fma in float32: the product of two float32 is exact in float64, and the sum is rounded once to
    float32 (the float64 sum rounded again: a double rounding that differs from one rounding only at
    exact float32 half-way points, not met here)."""
    return (np.float32(a).astype(np.float64) * np.float32(b).astype(np.float64) + np.float32(c).astype(np.float64)).astype(np.float32)


def block_terms(name, tiles, xq, xd, xs, m):
    """Per (input row, output, block of the tiles): the exact integer sum and its float32 step, and
    the mins term (Q4_K: its float32 chain over the 8 sub-blocks and its step; Q4_1: the min and its
    step), None for no min."""
    n, k = xq.shape
    x = xq.astype(np.int64)
    if name in lanes.ONE_SCALE:
        nb, mins = k // 32, None
        if name == "Q8_0":
            codes, d = lanes.tile_codes_ref(tiles)[:m], lanes.tile_scales_ref(tiles)[:m]
        elif name == "Q5_0":
            d, codes = lanes.q5_tile_fields_ref(tiles)
            d, codes = d[:m], codes[:m].astype(np.int64) - 16
        else:
            d, low, codes = lanes.q4_tile_fields_ref(tiles)
            d, codes = d[:m], codes[:m].astype(np.int64) - (8 if low is None else 0)
            if low is not None:  # Q4_1: its min times the block's code sums times the activation scale
                xs32 = ((xs[:, 0::2] + xs[:, 1::2]) * xd).astype(np.float32)
                mins = (np.broadcast_to(low[None, :m], (n, m, nb)), np.broadcast_to(xs32[:, None, :], (n, m, nb)))
        isums = np.einsum("ibl,jbl->ijb", x.reshape(n, nb, 32), codes.reshape(m, nb, 32).astype(np.int64))
        return isums, (d[None] * xd[:, None, :]).astype(np.float32), mins
    nb = k // 256
    dx = xd[:, ::8]  # one activation scale per 256 values
    if name == "Q6_K":
        d, sc, codes = (a[:m] for a in lanes.k6_tile_fields_ref(tiles))
        weights = (codes.astype(np.int64) - 32).reshape(m, nb, 16, 16) * sc.astype(np.int64)[..., None]
        isums = np.einsum("ibl,jbl->ijb", x.reshape(n, nb, 256), weights.reshape(m, nb, 256))
        return isums, (d[None] * dx[:, None, :]).astype(np.float32), None
    d, dmin, sc, mn, codes = (a[:m] for a in lanes.k4_tile_fields_ref(tiles))
    weights = codes.astype(np.int64).reshape(m, nb, 8, 32) * sc.astype(np.int64)[..., None]
    isums = np.einsum("ibl,jbl->ijb", x.reshape(n, nb, 256), weights.reshape(m, nb, 256))
    xs32 = (xs[:, 0::2] + xs[:, 1::2]).reshape(n, nb, 8).astype(np.float32)  # code sums per 32
    mins = mn.astype(np.float32)  # [m, nb, 8]
    bias = (mins[None, :, :, 0] * xs32[:, None, :, 0]).astype(np.float32)
    for g in range(1, 8):
        bias = f32_fma(mins[None, :, :, g], xs32[:, None, :, g], bias)
    return isums, (d[None] * dx[:, None, :]).astype(np.float32), (bias, (-dmin[None] * dx[:, None, :]).astype(np.float32))


@pytest.mark.parametrize("name", FORMATS)
def test_the_arithmetic_of_an_output(rng, int16_path, name):
    n, k, m = 7, 1536, 40
    w, x = weights(rng, m, k, name), rng.standard_normal((n, k)).astype(np.float32)
    tiles = lanes.repack(w)
    got = product(x, tiles, m)
    xq, xd, xs = np.empty((n, k), np.int16), np.empty((n, k // 32), np.float32), np.empty((n, k // 16), np.float32)
    quant.quantize_activations(x, xq, xd, xs)  # the kernel's own
    isums, steps, mins = block_terms(name, tiles, xq, xd, xs, m)

    def chain(order):
        """acc = fma(float(isum_b), step_b, acc) (then the mins' fma), blocks in order."""
        acc = np.zeros((n, m), np.float32)
        for b in order:
            acc = f32_fma(isums[..., b].astype(np.float32), steps[..., b], acc)
            if mins is not None:
                acc = f32_fma(mins[0][..., b], mins[1][..., b], acc)
        return acc

    blocks = isums.shape[-1]
    np.testing.assert_array_equal(got, chain(range(blocks)))
    # the check tells the orders apart: the blocks summed backwards give other bits
    assert (chain(range(blocks - 1, -1, -1)) != got).any()


AVX2_RUN = """
import sys
import numpy as np
from ellmd.kernels import quant_int
quant_int.WORDS_VNNI = False  # the code of an AVX2 CPU: vpmaddwd + vpaddd on 256-bit halves
from ellmd.kernels import lanes
folder, m = sys.argv[1], int(sys.argv[2])
for name in sys.argv[3:]:
    x, tiles = np.load(f"{folder}/{name}-x.npy"), np.load(f"{folder}/{name}-tiles.npy")
    out = np.zeros((x.shape[0], m), np.float32)
    lanes.linear_lanes(x, tiles, out, 1)
    np.save(f"{folder}/{name}-out.npy", out)
"""


def test_avx2_code_gives_the_same_bits(rng, tmp_path, int16_path):
    """The AVX2 kernels (vpmaddwd, a smaller register block) compute each output as the AVX-512 ones:
    integer sums are exact, the float steps the same. Compiled in a process of its own, with a
    kernel cache of its own (the code differs from this CPU's under the same sources): beside the
    user's, by the sources' digest as theirs (kernels.cache_dir), so that a second run loads it."""
    import os
    import subprocess
    import sys

    k, m = 768, 16 * 4 + 3
    x = rng.standard_normal((9, k)).astype(np.float32)
    tiles = {name: lanes.repack(weights(rng, m, k, name)) for name in FORMATS}
    for name, t in tiles.items():
        np.save(tmp_path / f"{name}-x.npy", x)
        np.save(tmp_path / f"{name}-tiles.npy", t)
    if os.environ.get("NUMBA_CACHE_DIR"):  # the user's folder holds this CPU's code under the same names
        env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    else:
        env = {**os.environ, "XDG_CACHE_HOME": str(kernels.cache_base() / "avx2-words")}
    env["ELLM_KERNELS"] = "int16"  # int16 codes in both processes, as int16_path here
    subprocess.run([sys.executable, "-c", AVX2_RUN, str(tmp_path), str(m), *FORMATS], env=env, check=True, timeout=900)
    for name, t in tiles.items():
        np.testing.assert_array_equal(np.load(tmp_path / f"{name}-out.npy"), product(x, t, m), err_msg=name)


@pytest.mark.parametrize("name", FORMATS)
def test_shapes_that_disagree_are_refused(rng, name):
    k = 768
    tiles = lanes.repack(weights(rng, 32, k, name))
    for x, out in ((np.zeros((2, k + 256), np.float32), np.zeros((2, 32), np.float32)),  # another depth
                   (np.zeros((2, k), np.float32), np.zeros((2, 48), np.float32)),  # more outputs than rows
                   (np.zeros((2, k), np.float32), np.zeros((3, 32), np.float32))):
        with pytest.raises(ValueError, match="disagree"):
            lanes.linear_lanes(x, tiles, out, 1)


def engine_parts(engine, head=False):
    """The weight arrays of the layers (and of the output head)."""
    for w in [*([engine.model.lm_head] if head else []), *(w for layer in engine.model.layers for w in layer.values())]:
        yield from w if isinstance(w, tuple) else (w,)


# a Qwen3 whose widths Q4_K's 256-value super-blocks divide (the alignment checkpoints' widths get
# Q5_0 for q4_k, as llama.cpp does)
WIDE = {"model_type": "qwen3", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}


def block_engine(alignment_dir, tmp_path, variant, weight_dtype, **options):
    from ellmd.engine import Engine
    from ellmd.model.weights import RandomCheckpoint

    if variant != "wide":
        return Engine(alignment_dir / variant, weight_dtype=weight_dtype, **options)
    (tmp_path / "config.json").write_text(json.dumps(WIDE))
    return Engine(RandomCheckpoint(tmp_path / "config.json"), weight_dtype=weight_dtype, **options)


@pytest.mark.parametrize("variant, weight_dtype, held", [("qwen3", "q8_0", "Q8_0"), ("qwen3", "q4_k", "Q5_0"),
                                                          ("qwen3", "q4_0", "Q4_0"), ("wide", "q4_k", "Q4_K")])
def test_an_engine_holds_blocks_in_tiles_and_agrees_with_the_blocks(alignment_dir, tmp_path, int16_path, monkeypatch,
                                                                     variant, weight_dtype, held):
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 500, 150)]

    def logits(engine):
        return engine.prefill(0, prompt).copy(), engine.decode([0], [7])[0].copy()

    # f32 KV: a quantized KV would round the two engines' keys apart where they differ by an ulp
    options = dict(kv_dtype="f32", sequence_length=256, batch_size=2, chunk_size=128, threads=2)
    engine = block_engine(alignment_dir, tmp_path, variant, weight_dtype, **options)
    parts = [p for p in engine_parts(engine) if p.ndim >= 2]
    assert all(lanes.is_tiles(p) for p in parts)  # every matrix: rows a multiple of 16 here
    assert held in {lanes.block_name(p) for p in parts}
    got = logits(engine)
    monkeypatch.setattr(lanes, "wanted", lambda w: False)
    blocks = block_engine(alignment_dir, tmp_path, variant, weight_dtype, **options)
    assert not any(lanes.is_tiles(p) for p in engine_parts(blocks))
    # counted as the GGUF type, the same bytes (Q4_K: a tile's 12 x 16 bytes of scales as 16 x 16)
    grown = Counter({held: sum(64 * p.size for p in engine_parts(engine, head=True)
                               if lanes.is_tiles(p) and lanes.block_name(p) == "Q4_K")})
    head = engine.model.lm_head
    assert lanes.is_tiles(head) == (engine.spec.vocab_size % lanes.LANES == 0)  # a tied table too
    if lanes.is_tiles(head) and blocks.model.lm_head is blocks.model.embed_tokens:  # embed's blocks, the logits' tiles
        grown[lanes.block_name(head)] += head.nbytes
    for name, more in grown.items():
        assert engine.memory_budget()[f"weights:{name}"] == blocks.memory_budget()[f"weights:{name}"] + more
    # one quantization, float steps in other orders: ~1e-6 of a product apart (Q4_K at k = 2048: its
    # mins term cancels most of its codes' term), which this random model's layers amplify
    tolerance = 5e-4 if held == "Q4_K" else 1e-4
    for tiles_logits, blocks_logits in zip(got, logits(blocks)):
        assert np.abs(tiles_logits - blocks_logits).max() <= tolerance * np.abs(blocks_logits).max()


@pytest.mark.parametrize("variant, weight_dtype", [("llama", "q8_0"), ("qwen3_moe", "q8_0"), ("llama", "q4_k"),
                                                   ("wide", "q4_k")])
def test_a_tokens_logits_on_tiles_do_not_depend_on_how_it_was_computed(alignment_dir, tmp_path, int16_path, variant,
                                                                       weight_dtype):
    from test_one_arithmetic import PROMPT, assert_one_arithmetic, each_way

    engine = block_engine(alignment_dir, tmp_path, variant, weight_dtype, kv_dtype="bf16",
                          sequence_length=len(PROMPT) + 8, batch_size=3, chunk_size=2048, threads=2)
    assert any(lanes.is_tiles(p) for p in engine_parts(engine))
    assert_one_arithmetic(each_way(engine))


def test_a_tokens_logits_on_int8_tiles_do_not_depend_on_how_it_was_computed(alignment_dir, tmp_path, use_kernels):
    """The "int8" path: Q4_K tiles on int8 codes in prefill, in the fused decode step and beside other
    rows alike."""
    from test_one_arithmetic import PROMPT, assert_one_arithmetic, each_way

    use_kernels("int16,int8")
    engine = block_engine(alignment_dir, tmp_path, "wide", "q4_k", kv_dtype="bf16", sequence_length=len(PROMPT) + 8,
                          batch_size=3, chunk_size=2048, threads=2)
    assert any(lanes.is_tiles(p) and lanes.int8_codes(p) for p in engine_parts(engine))
    assert "int8 vpmaddubsw" in engine.describe_kernels()
    assert_one_arithmetic(each_way(engine))
