"""Q8_0 weights with outputs in lanes (kernels/lanes.py): the tiles hold the GGUF's bytes, the
GEMM/GEMV agrees with numpy, and every output is one chain of float steps, whatever the batch."""

import numpy as np
import pytest

from ellmd.kernels import cpu, lanes, quant

pytestmark = pytest.mark.skipif("int16" not in cpu.host_paths(),
                                reason="the int16 path needs AVX512-VNNI+BW or AVX2, which this CPU lacks")


@pytest.fixture
def rng():
    return np.random.default_rng(25)


def weights(rng, m, k):
    return quant.quantize(rng.standard_normal((m, k)).astype(np.float32) * 0.05, "Q8_0")


def product(x, tiles, m, workers=2):
    out = np.full((x.shape[0], m), np.nan, np.float32)
    lanes.linear_lanes(x, tiles, out, workers)
    return out


def test_repack_keeps_the_blocks(rng):
    w = weights(rng, 37, 576)
    tiles = lanes.repack_q8_0(w)
    assert tiles.shape == (3, 18, 544) and tiles.dtype == np.uint8  # 544 = 16 x 34: the same bytes a block
    scales, codes = lanes.tile_scales_ref(tiles), lanes.tile_codes_ref(tiles)
    np.testing.assert_array_equal(scales[:37], w["d"].view(np.float16).astype(np.float32))
    np.testing.assert_array_equal(codes[:37], w["qs"].reshape(37, -1))
    assert not scales[37:].any() and not codes[37:].any()  # rows past m: zero


@pytest.mark.parametrize("k", [576, 1536, 2048])
@pytest.mark.parametrize("n", [1, 3, 7, 64, 130])
def test_matches_numpy(rng, n, k):
    m = 16 * 5 + 9  # a last tile of 9 rows
    w, x = weights(rng, m, k), rng.standard_normal((n, k)).astype(np.float32)
    tiles = lanes.repack_q8_0(w)
    got = product(x, tiles, m)
    want = np.zeros((n, m), np.float32)
    lanes.linear_lanes_ref(x, tiles, want, 2)
    assert np.abs(got - want).max() <= 4e-6 * np.abs(want).max()
    exact = x.astype(np.float64) @ quant.dequantize(w).astype(np.float64).T  # int16 activations: ~1e-4 off at most
    assert np.abs(got - exact).max() <= 1e-4 * np.abs(exact).max()


def test_a_row_alike_in_every_batch(rng):
    k, m = 1536, 16 * 7 + 5
    w, x = weights(rng, m, k), rng.standard_normal((130, k)).astype(np.float32)
    tiles = lanes.repack_q8_0(w)
    whole = product(x, tiles, m)
    for i in range(130):  # alone (decode), one worker
        np.testing.assert_array_equal(product(x[i : i + 1], tiles, m, workers=1)[0], whole[i])
    for n in (3, 7, 64):  # other batches: other register blocks and left-over rows
        for i0 in (0, 5, 130 - n):
            np.testing.assert_array_equal(product(x[i0 : i0 + n], tiles, m, workers=1), whole[i0 : i0 + n])


def f32_chain(isums, steps, order):
    """The float32 chain acc = fma(float(isum_b), step_b, acc) over blocks in `order`, from 0: the
    product float32 x float32 is exact in float64 and the fma rounds once to float32 (the float64
    sum rounded again: a double rounding that differs from one rounding only at exact float32
    half-way points, not met here)."""
    acc = np.zeros(isums.shape[:-1], np.float32)
    for b in order:
        acc = (isums[..., b].astype(np.float32).astype(np.float64) * steps[..., b].astype(np.float64)
               + acc.astype(np.float64)).astype(np.float32)
    return acc


def test_the_arithmetic_of_an_output(rng):
    n, k, m = 7, 1536, 40
    w, x = weights(rng, m, k), rng.standard_normal((n, k)).astype(np.float32)
    tiles = lanes.repack_q8_0(w)
    got = product(x, tiles, m)
    xq, xd = np.empty((n, k), np.int16), np.empty((n, k // 32), np.float32)
    quant.quantize_activations(x, xq, xd, np.empty((n, k // 16), np.float32))  # the kernel's own
    codes, scales = lanes.tile_codes_ref(tiles)[:m], lanes.tile_scales_ref(tiles)[:m]
    nb = k // 32
    isums = np.einsum("ibl,jbl->ijb", xq.astype(np.int64).reshape(n, nb, 32), codes.reshape(m, nb, 32).astype(np.int64))
    steps = (scales[None, :, :] * xd[:, None, :]).astype(np.float32)  # one float32 product
    np.testing.assert_array_equal(got, f32_chain(isums, steps, range(nb)))
    # the check tells the orders apart: the blocks summed backwards give other bits
    assert (f32_chain(isums, steps, range(nb - 1, -1, -1)) != got).any()


AVX2_RUN = """
import sys
import numpy as np
from ellmd.kernels import quant_int
quant_int.WORDS_VNNI = False  # the code of an AVX2 CPU: vpmaddwd + vpaddd on 256-bit halves
from ellmd.kernels import lanes
x, tiles = np.load(sys.argv[1]), np.load(sys.argv[2])
out = np.zeros((x.shape[0], int(sys.argv[4])), np.float32)
lanes.linear_lanes(x, tiles, out, 1)
np.save(sys.argv[3], out)
"""


def test_avx2_code_gives_the_same_bits(rng, tmp_path):
    """The AVX2 kernel (vpmaddwd, a smaller register block) computes each output as the AVX-512 one:
    integer sums are exact, the float steps the same. Compiled in a process of its own, with its
    own kernel cache (the code differs from this CPU's under the same sources)."""
    import os
    import subprocess
    import sys

    k, m = 576, 16 * 4 + 3
    w, x = weights(rng, m, k), rng.standard_normal((9, k)).astype(np.float32)
    tiles = lanes.repack_q8_0(w)
    files = [str(tmp_path / name) for name in ("x.npy", "tiles.npy", "out.npy")]
    np.save(files[0], x)
    np.save(files[1], tiles)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    subprocess.run([sys.executable, "-c", AVX2_RUN, *files, str(m)], env=env, check=True, timeout=600)
    np.testing.assert_array_equal(np.load(files[2]), product(x, tiles, m))


def test_shapes_that_disagree_are_refused(rng):
    tiles = lanes.repack_q8_0(weights(rng, 32, 576))
    for x, out in ((np.zeros((2, 608), np.float32), np.zeros((2, 32), np.float32)),  # another depth
                   (np.zeros((2, 576), np.float32), np.zeros((2, 48), np.float32)),  # more outputs than rows
                   (np.zeros((2, 576), np.float32), np.zeros((3, 32), np.float32))):
        with pytest.raises(ValueError, match="disagree"):
            lanes.linear_lanes(x, tiles, out, 1)


def engine_parts(engine):
    for layer in engine.model.layers:
        for w in layer.values():
            yield from w if isinstance(w, tuple) else (w,)


def q8_0_engine(path, **options):
    from ellmd.engine import Engine

    return Engine(path, weight_dtype="q8_0", **options)


@pytest.fixture
def int16_path(use_kernels):
    use_kernels("int16")


def test_an_engine_holds_q8_0_in_tiles_and_agrees_with_the_blocks(alignment_dir, int16_path, monkeypatch):
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 500, 150)]

    def logits(engine):
        return engine.prefill(0, prompt).copy(), engine.decode([0], [7])[0].copy()

    # f32 KV: a quantized KV would round the two engines' keys apart where they differ by an ulp
    options = dict(kv_dtype="f32", sequence_length=256, batch_size=2, chunk_size=128, threads=2)
    engine = q8_0_engine(alignment_dir / "qwen3", **options)
    parts = list(engine_parts(engine))
    assert all(lanes.is_tiles(p) for p in parts if p.ndim >= 2)  # every matrix: rows a multiple of 16 here
    got = logits(engine)
    monkeypatch.setattr(lanes, "wanted", lambda w: False)
    blocks = q8_0_engine(alignment_dir / "qwen3", **options)
    assert not any(lanes.is_tiles(p) for p in engine_parts(blocks))
    for key in ("weights", "weights:Q8_0"):  # the same bytes, counted as Q8_0
        assert engine.memory_budget()[key] == blocks.memory_budget()[key]
    for tiles_logits, blocks_logits in zip(got, logits(blocks)):  # one quantization, sums in other orders
        assert np.abs(tiles_logits - blocks_logits).max() <= 1e-4 * np.abs(blocks_logits).max()


@pytest.mark.parametrize("variant", ["llama", "qwen3_moe"])
def test_a_tokens_logits_on_tiles_do_not_depend_on_how_it_was_computed(alignment_dir, int16_path, variant):
    from test_one_arithmetic import PROMPT, assert_one_arithmetic, each_way

    engine = q8_0_engine(alignment_dir / variant, kv_dtype="bf16", sequence_length=len(PROMPT) + 8, batch_size=3,
                         chunk_size=2048, threads=2)
    assert any(lanes.is_tiles(p) for p in engine_parts(engine))
    assert_one_arithmetic(each_way(engine))
