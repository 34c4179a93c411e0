"""The MoE block (ellmd.kernels.moe): fused and grouped paths against the numpy reference.

moe_experts takes the fused path up to FUSED_MAX_TOKENS tokens, and for any number of tokens on
block experts; float experts beyond it are grouped by expert. Both read the same stored expert values as the reference, so tolerances are float32 arithmetic's,
except on the integer paths (cpu.py), where block weights meet activations quantized per 32 values.
"""

import numpy as np
import pytest

from ellmd.kernels import cpu, moe, quant
from ellmd.kernels.activations import silu_mul_ref
from ellmd.kernels.formats import BF16, F16, F32, to_f32, to_storage
from arrays import randn

FORMATS = [F32, BF16, F16]
TOL = dict(rtol=1e-5, atol=2e-5)


@pytest.fixture
def rng():
    return np.random.default_rng(99)


def expert_stacks(rng, fmt, experts, hidden, inter):
    gate_up = to_storage(randn(rng, experts, 2 * inter, hidden, scale=hidden**-0.5), fmt)  # [E, 2*I, h]
    down = to_storage(randn(rng, experts, hidden, inter, scale=inter**-0.5), fmt)  # [E, h, I]
    return gate_up, down


def block_stacks(rng, gate_type, up_type, down_type, experts, hidden, inter):
    """GGUF block stacks [E, rows, blocks]; gate and up separate when their types differ (a tuple)."""

    def q(rows, cols, name):
        if name == "BF16":  # a float stack beside blocks
            return to_storage(randn(rng, experts, rows, cols, scale=cols**-0.5), BF16)
        if name in ("Q5_K", "Q6_K"):  # no quantizer for these here: random blocks with small scales
            dtype = quant.BLOCK_DTYPES[name]
            shape = (experts, rows, cols // quant.BLOCK_SIZES[name])
            blocks = rng.integers(0, 256, (*shape, dtype.itemsize), np.uint8).view(dtype)[..., 0]
            for field in ("d", "dmin"):
                if field in dtype.names:
                    blocks[field] = np.float16(0.02 * cols**-0.5 if field == "d" else 0.01).view(np.uint16)
            return blocks
        return quant.quantize(randn(rng, experts, rows, cols, scale=cols**-0.5), name)

    down = q(hidden, inter, down_type)
    if gate_type == up_type:
        return q(2 * inter, hidden, gate_type), down
    return (q(inter, hidden, gate_type), q(inter, hidden, up_type)), down


# (tokens, experts, top_k, hidden, inter): widths that are not multiples of the kernels' row block (16)
# or of the 2-row / 4-input unrolling; a batch where tokens share experts; the grouped path (n > 16)
SHAPES = [(1, 8, 2, 32, 48), (1, 128, 8, 72, 40), (5, 16, 4, 64, 37), (16, 4, 2, 48, 24), (17, 8, 2, 33, 20),
          (40, 8, 2, 48, 32)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,experts,top_k,hidden,inter", SHAPES)
def test_moe_experts_matches_reference(rng, fmt, n, experts, top_k, hidden, inter):
    x = randn(rng, n, hidden)
    weights, chosen = np.empty((n, top_k), np.float32), np.empty((n, top_k), np.int64)
    moe.route(randn(rng, n, experts, scale=2.0), top_k, True, weights, chosen)
    gate_up, down = expert_stacks(rng, fmt, experts, hidden, inter)
    scratch = moe.moe_scratch(64, top_k, experts, hidden, inter)
    got, want = np.full((n, hidden), np.nan, np.float32), np.empty((n, hidden), np.float32)
    moe.moe_experts(x, chosen, weights, gate_up, down, fmt, got, scratch)
    moe.moe_experts_ref(x, chosen, weights, gate_up, down, fmt, want, scratch)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("fmt", [F32, BF16])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("n,experts,top_k,hidden,inter", SHAPES)
def test_moe_block_matches_reference(rng, fmt, normalize, n, experts, top_k, hidden, inter):
    x = randn(rng, n, hidden)
    router = randn(rng, experts, hidden, scale=2.0 * hidden**-0.5)  # [E, h]
    gate_up, down = expert_stacks(rng, fmt, experts, hidden, inter)
    scratch = moe.moe_scratch(64, top_k, experts, hidden, inter)
    results = []
    for block in (moe.moe_block, moe.moe_block_ref):
        out = np.full((n, hidden), np.nan, np.float32)
        logits = np.empty((n, experts), np.float32)
        weights, chosen = np.empty((n, top_k), np.float32), np.empty((n, top_k), np.int64)
        block(x, router, top_k, normalize, gate_up, down, fmt, out, logits, weights, chosen, scratch)
        results.append((out, logits, weights, chosen))
    (out, logits, weights, chosen), (want_out, want_logits, want_weights, want_chosen) = results
    np.testing.assert_allclose(logits, want_logits, **TOL)
    np.testing.assert_array_equal(chosen, want_chosen)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out, want_out, **TOL)


def test_moe_block_tokens_sharing_experts_sum_their_own_outputs(rng):
    """Two tokens routed to the same experts with different weights: each gets its own mix, not the other's."""
    hidden, inter, experts = 32, 24, 4
    gate_up, down = expert_stacks(rng, F32, experts, hidden, inter)
    x = randn(rng, 3, hidden)
    chosen = np.array([[1, 2], [2, 1], [1, 3]], np.int64)
    weights = np.array([[0.75, 0.25], [0.5, 0.5], [1.0, 0.0]], np.float32)
    scratch = moe.moe_scratch(4, 2, experts, hidden, inter)
    got, want = np.empty((3, hidden), np.float32), np.empty((3, hidden), np.float32)
    moe.moe_experts(x, chosen, weights, gate_up, down, F32, got, scratch)
    for i in range(3):  # one token at a time: nothing to share
        moe.moe_experts_ref(x[i : i + 1], chosen[i : i + 1], weights[i : i + 1], gate_up, down, F32, want[i : i + 1], scratch)
    np.testing.assert_allclose(got, want, **TOL)
    assert np.abs(got[0] - got[1]).max() > 1e-3  # the same experts, different weights


# llama-quantize's Q4_K_M mixes (Q4_K gate/up, Q6_K down), Q8_0, gate and up of different types, and
# blocks beside a bf16 stack (each on its own kernels: the same input quantized for one, not the other)
BLOCK_CASES = [("Q4_K", "Q4_K", "Q6_K", 256, 512), ("Q8_0", "Q8_0", "Q8_0", 64, 96), ("Q4_K", "Q5_K", "Q4_K", 256, 256),
               ("Q5_0", "Q5_0", "Q4_1", 96, 64), ("Q8_0", "BF16", "Q4_0", 64, 64)]


def run_blocks(rng, n, gate_type, up_type, down_type, hidden, inter):
    """(moe_block, moe_block_ref) outputs on random block stacks, then the input, routing and stacks.
    From 40 tokens (a prefill chunk), 5 experts: each has more rows than a slice of the fused path."""
    experts, top_k = (16 if n < 40 else 5), 4
    gate_up, down = block_stacks(rng, gate_type, up_type, down_type, experts, hidden, inter)
    x = randn(rng, n, hidden)
    router = randn(rng, experts, hidden, scale=2.0 * hidden**-0.5)
    scratch = moe.moe_scratch(max(n, 32), top_k, experts, hidden, inter)
    outs = []
    for block in (moe.moe_block, moe.moe_block_ref):
        out = np.full((n, hidden), np.nan, np.float32)
        logits, weights = np.empty((n, experts), np.float32), np.empty((n, top_k), np.float32)
        chosen = np.empty((n, top_k), np.int64)
        block(x, router, top_k, True, gate_up, down, BF16, out, logits, weights, chosen, scratch)
        outs.append(out)
    return outs, (x, chosen, weights, gate_up, down)


@pytest.mark.parametrize("n", [1, 3, 20, 40])
@pytest.mark.parametrize("gate_type,up_type,down_type,hidden,inter", BLOCK_CASES)
def test_moe_block_on_blocks_matches_dequantized_reference(rng, monkeypatch, n, gate_type, up_type, down_type, hidden,
                                                           inter):
    # the portable kernels: float32 products of the blocks
    monkeypatch.setattr(cpu, "ENABLED", frozenset())
    (got, want), _ = run_blocks(rng, n, gate_type, up_type, down_type, hidden, inter)
    np.testing.assert_allclose(got, want, **TOL)


def quantized(x, dtype):
    """x as the integer paths meet it: codes of dtype per 32 values times their scale (float64)."""
    xq, xd, _ = quant.quantize_activations_ref(x, dtype)
    return (xq.astype(np.float64).reshape(len(x), -1, 32) * xd[..., None]).reshape(x.shape)


def integer_reference(x, experts, weights, gate_up, down, dtype):
    """moe_experts_ref as the integer paths compute it (quant_int.rows_vnni_ref): each token's input and
    each (token, expert) silu output quantized per 32 values, times the blocks dequantized by gguf."""
    out = np.zeros(x.shape)
    for e in np.unique(experts):
        parts = (gate_up[0][e], gate_up[1][e]) if isinstance(gate_up, tuple) else (gate_up[e],)
        w_parts = [to_f32(part, BF16).T.astype(np.float64) for part in parts]
        w_down = quant.dequantize(down[e]).T.astype(np.float64)
        for i, j in zip(*np.nonzero(experts == e)):
            xi = [quantized(x[i : i + 1], dtype) if quant.is_blocks(part) else x[i : i + 1] for part in parts]
            gu = np.concatenate([a @ w for a, w in zip(xi, w_parts)], axis=1)
            act = np.empty((1, gu.shape[1] // 2), np.float32)
            silu_mul_ref(gu.astype(np.float32), act)
            out[i] += weights[i, j] * (quantized(act, dtype) @ w_down)[0]
    return out.astype(np.float32)


# int16 codes: ~5e-5 of the largest output from the float32 products, the rest f32 rounding (which
# can flip a code); int8 codes: ~1% from them, which integer_reference reproduces
INTEGER = {"int16": (np.int16, 3e-4, 3e-4), "vnni": (np.int8, 1e-3, 0.02)}


@pytest.mark.parametrize("n", [1, 3, 16, 20, 40])
@pytest.mark.parametrize("kernels", ["int16", "vnni"])
@pytest.mark.parametrize("gate_type,up_type,down_type,hidden,inter", BLOCK_CASES)
def test_moe_block_on_integer_paths_matches_quantized_reference(rng, use_kernels, kernels, n, gate_type, up_type,
                                                                down_type, hidden, inter):
    """The fused path (block experts: any n; beside a bf16 stack: n <= 16) and the grouped one run
    the experts' blocks on the integer kernels: the activations quantized per pair for gate and up
    (alike for the pairs of a token), and per pair for down."""
    use_kernels(kernels)
    dtype, tolerance, float_tolerance = INTEGER[kernels]
    (got, want_float), (x, chosen, weights, gate_up, down) = run_blocks(rng, n, gate_type, up_type, down_type,
                                                                        hidden, inter)
    want = integer_reference(x, chosen, weights, gate_up, down, dtype)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * scale)
    error = np.abs(got - want_float).max() / scale
    assert error < float_tolerance
    if kernels in cpu.ENABLED:  # the codes' rounding shows: the float32 kernels come within ~5e-7
        assert error > 5e-6


def test_a_prefill_chunk_on_block_experts_is_one_call(rng, monkeypatch):
    """Many tokens on block experts take the fused path (each expert's weights read once for all its
    tokens), never a matmul per expert; float experts beyond FUSED_MAX_TOKENS take the grouped path."""
    n, experts, top_k, hidden, inter = 40, 5, 4, 64, 96
    x = randn(rng, n, hidden)
    router = randn(rng, experts, hidden, scale=2.0 * hidden**-0.5)
    scratch = moe.moe_scratch(n, top_k, experts, hidden, inter)
    logits, weights = np.empty((n, experts), np.float32), np.empty((n, top_k), np.float32)
    chosen, out = np.empty((n, top_k), np.int64), np.empty((n, hidden), np.float32)
    matmuls = []
    monkeypatch.setattr(moe, "matmul", lambda *args: matmuls.append(args[1].shape))
    gate_up, down = block_stacks(rng, "Q8_0", "Q8_0", "Q8_0", experts, hidden, inter)  # types of BLOCK_CASES
    moe.moe_block(x, router, top_k, True, gate_up, down, BF16, out, logits, weights, chosen, scratch)
    assert matmuls == []
    gate_up, down = expert_stacks(rng, BF16, experts, hidden, inter)
    moe.moe_block(x, router, top_k, True, gate_up, down, BF16, out, logits, weights, chosen, scratch)
    assert len(matmuls) == 1 + 2 * experts  # the router, then gate_up and down of every expert (each has tokens)
