"""The fused decode step (kernels.layer) against the kernel-by-kernel forward, for every family and storage."""

from __future__ import annotations

import sys
from collections import Counter

import numpy as np
import pytest
from numba.core.registry import CPUDispatcher
from numba.core.runtime import _nrt_python, rtsys

from ellmd.engine import Engine
from ellmd.engine.plan import Plan
from ellmd.kernels import cpu, lanes, quant
from ellmd.kernels.formats import BF16, F32, to_f32
from ellmd.model.llama import logical_shape

PROMPTS = [list(range(5, 17)), [3, 4], list(range(20, 41))]


def make_engine(path, weight_dtype):
    return Engine(path, weight_dtype=weight_dtype, kv_dtype="bf16", sequence_length=96, batch_size=3, chunk_size=16,
                  threads=2)


def decode_both_ways(engine):
    """Logits and KV of the same decode steps, kernel by kernel (False) and fused (True)."""
    results = {}
    for fused in (False, True):
        engine.plan.fused_decode = fused
        for slot, prompt in enumerate(PROMPTS):
            engine.rewind(slot, 0)
            engine.prefill(slot, prompt)
        steps = [engine.decode([0, 1, 2], [7, 8, 9]).copy(), engine.decode([2, 0], [1, 2]).copy()]
        steps += [engine.decode([1], [5]).copy()]
        results[fused] = steps, engine.kv.k.copy(), engine.kv.v.copy()
    return results


def integer_tolerance(blocks: bool) -> float:
    """The integer paths quantize activations: an f32 rounding difference between the two ways (e.g.
    a norm's sum order) can flip one code, a step of 1/32767 (int16) or 1/127 (int8) of its block's
    largest value, which moves a logit by up to ~1e-4 (int16) or ~1e-3 (int8) of the largest."""
    if not (blocks and cpu.INTEGER & cpu.ENABLED):
        return 2e-6
    return 1e-3 if "vnni" in cpu.ENABLED else 3e-4


def assert_same(results, tolerance=2e-6):
    """Logits within tolerance * their largest value; the bf16 KV within one last bit, or, where a
    flipped integer code moved a later layer's input (integer paths), within one bf16 step of each
    value plus the logits' tolerance of the largest (near zero a last bit is far smaller than that move)."""
    (want, want_k, want_v), (got, got_k, got_v) = results[False], results[True]
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=0, atol=tolerance * np.abs(a).max())
    for got_kv, want_kv in ((got_k, want_k), (got_v, want_v)):
        ulps = np.abs(got_kv.astype(np.int32) - want_kv.astype(np.int32))
        assert np.count_nonzero(ulps) <= 1e-3 * ulps.size
        if tolerance <= 2e-6:  # f32 rounding may flip a last bit (two: seen once, qwen3_moe f16 under load)
            assert ulps.max() <= 2
        else:
            got_f, want_f = to_f32(got_kv, BF16), to_f32(want_kv, BF16)  # a bf16 step of the value, plus the move
            assert np.all(np.abs(got_f - want_f) <= np.abs(want_f) * 2.0**-7 + tolerance * np.abs(want_f).max())


def assert_rows_as_alone(engine):
    """Each session's logits in a batch step equal its step alone, to the bit: no row's numbers
    depend on the rows beside it (matmul passes, attention splits, parallel thresholds)."""
    for slot, prompt in enumerate(PROMPTS):
        engine.rewind(slot, 0)
        engine.prefill(slot, prompt)
    together = engine.decode([0, 1, 2], [7, 8, 9]).copy()
    for slot, token in enumerate([7, 8, 9]):
        engine.rewind(slot, len(PROMPTS[slot]))
        assert np.array_equal(engine.decode([slot], [token])[0], together[slot]), f"slot {slot}"


# every family and every storage, each family on a float and a block format (each pair compiles
# the fused step anew: the full product would add minutes of compile to the suite)
CASES = [("llama", "f32"), ("llama", "q4_k"), ("qwen3", "bf16"), ("qwen3", "q8_0"), ("qwen3_moe", "f16"),
         ("qwen3_moe", "q4_k"), ("qwen3_moe-dense0-tied-bf16", "bf16"), ("qwen3_moe-dense0-tied-bf16", "q8_0")]


@pytest.mark.parametrize("variant,weight_dtype", CASES)
def test_fused_decode_equals_kernel_by_kernel(alignment_dir, variant, weight_dtype):
    engine = make_engine(alignment_dir / variant, weight_dtype)
    results = decode_both_ways(engine)
    assert_same(results, integer_tolerance(weight_dtype.startswith("q")))
    assert np.abs(results[True][0][0]).max() > 0.1  # the logits are not trivially equal
    assert_rows_as_alone(engine)


def mixed_formats(engine):
    """Give every layer fusions of parts in different formats: tuples that kernels.layer walks."""
    for index, layer_weights in enumerate(engine.model.layers):
        qkv = to_f32(layer_weights["qkv_proj"], engine.fmt)
        q_rows = engine.spec.num_attention_heads * engine.spec.head_dim
        layer_weights["qkv_proj"] = (quant.quantize(qkv[:q_rows], "Q8_0"), quant.quantize(qkv[q_rows:], "Q5_0"))
        if "gate_up_proj" in layer_weights:
            gate_up = to_f32(layer_weights["gate_up_proj"], engine.fmt)
            half = len(gate_up) // 2
            layer_weights["gate_up_proj"] = (quant.quantize(gate_up[:half], "Q4_0"), gate_up[half:].copy())
    engine.plan = Plan(engine.model, engine.kv, engine.chunk_size)


@pytest.mark.parametrize("kernels", ["vnni", "int16", "portable"])
def test_fused_decode_on_fusions_of_formats_and_kernel_paths(alignment_dir, use_kernels, kernels):
    use_kernels(kernels)
    engine = make_engine(alignment_dir / "qwen3_moe-dense0-tied-bf16", "f32")
    assert engine.fmt == F32
    mixed_formats(engine)
    assert any(len(attention[2]) == 2 for attention, _ in engine.plan.layers)  # qkv: two parts
    assert_same(decode_both_ways(engine), integer_tolerance(True))


def test_a_qkv_bias_joins_prefill_and_both_decodes_alike(alignment_dir):
    """attention_bias (a Llama config flag; no test checkpoint has it): the bias moves the logits, and a
    token's logits are the same bits from a prefill, a kernel-by-kernel decode step and a compiled one."""
    engine = make_engine(alignment_dir / "llama", "f32")
    prompt = PROMPTS[0]
    without = engine.prefill(0, prompt).copy()
    rng = np.random.default_rng(0)
    for layer_weights in engine.model.layers:
        rows = logical_shape(layer_weights["qkv_proj"])[0]
        layer_weights["qkv_bias"] = rng.normal(0, 0.5, rows).astype(np.float32)
    engine.plan = Plan(engine.model, engine.kv, engine.chunk_size)
    engine.rewind(0, 0)
    prefilled = engine.prefill(0, prompt).copy()
    assert np.abs(prefilled - without).max() > 1e-2 * np.abs(without).max()
    for fused in (False, True):
        engine.plan.fused_decode = fused
        engine.rewind(0, len(prompt) - 1)
        assert np.array_equal(engine.decode([0], [prompt[-1]])[0], prefilled), f"fused={fused}"


def count_numba_calls(monkeypatch) -> Counter:
    """Count the calls Python makes into compiled kernels (every njit function of ellmd.kernels)."""
    calls = Counter()
    modules = [sys.modules[name] for name in list(sys.modules) if name.startswith("ellmd.kernels")]
    for module in modules:  # (ellmd.kernels.matmul, the module: the package's `matmul` is the function)
        for name, value in list(vars(module).items()):
            if isinstance(value, CPUDispatcher):

                def counted(*args, _f=value, _name=name):
                    calls[_name] += 1
                    return _f(*args)

                monkeypatch.setattr(module, name, counted)
    return calls


def test_a_decode_step_makes_a_few_python_to_numba_calls(alignment_dir, monkeypatch):
    engine = make_engine(alignment_dir / "qwen3", "bf16")
    engine.prefill(0, PROMPTS[0])
    for fused in (False, True):  # each way compiled before the dispatchers are wrapped
        engine.plan.fused_decode = fused
        engine.decode([0], [1])
    calls = count_numba_calls(monkeypatch)
    engine.decode([0], [2])
    # the embedding, every layer, then the final norm and lm_head for the logits
    assert calls == Counter(_embed=1, decode_layer=engine.spec.num_hidden_layers, decode_logits=1), calls
    engine.plan.fused_decode = False
    calls.clear()
    engine.decode([0], [3])
    assert sum(calls.values()) >= 10 * engine.spec.num_hidden_layers, calls


def numba_allocations(step) -> int:
    """Allocations numba's runtime makes while step() runs.

    Every array argument a Python-to-numba call unboxes takes one (a small MemInfo header), so a
    step's count is that of its arguments plus what the kernels allocate.
    """
    _nrt_python.memsys_enable_stats()
    try:
        before = rtsys.get_allocation_stats()
        step()
        return rtsys.get_allocation_stats().alloc - before.alloc
    finally:
        _nrt_python.memsys_disable_stats()


def decode_allocations(engine) -> int:
    for slot, prompt in enumerate(PROMPTS):
        engine.rewind(slot, 0)
        engine.prefill(slot, prompt)
    engine.decode([0, 1, 2], [1, 2, 3])
    return numba_allocations(lambda: engine.decode([0, 1, 2], [4, 5, 6]))


@pytest.mark.parametrize("variant, weight_dtype", [("qwen3", "q8_0"), ("llama", "q4_k"), ("qwen3_moe", "bf16")])
def test_decode_allocates_nothing_in_numba(alignment_dir, variant, weight_dtype):
    """Block kernels take their accumulators from the workspace: a decode step on blocks makes no
    more allocations than on f32 weights of the same model, which is its arguments' unboxing."""
    engine = make_engine(alignment_dir / variant, weight_dtype)
    o_proj = engine.model.layers[0]["o_proj"]
    assert weight_dtype == "bf16" or quant.is_blocks(o_proj) or lanes.is_tiles(o_proj)  # tiles on int16 (lanes.py)
    fused = decode_allocations(engine)
    assert fused == decode_allocations(make_engine(alignment_dir / variant, "f32"))
    engine.plan.fused_decode = False  # the kernel-by-kernel step: block rows take heap accumulators
    if weight_dtype != "bf16":
        assert decode_allocations(engine) > fused + 10


@pytest.mark.parametrize("kernels", ["int16", "vnni", "portable"])
def test_moe_decode_on_blocks_allocates_nothing_in_numba(alignment_dir, use_kernels, kernels):
    """The routed experts take their accumulators and quantized activations from the MoE workspace,
    on every kernel path: as many allocations as on f32 experts (the arguments' unboxing)."""
    use_kernels(kernels)
    engine = make_engine(alignment_dir / "qwen3_moe", "q4_k")
    assert quant.block_name(engine.model.layers[0]["experts_down"]) in quant.VNNI_BLOCKS
    assert decode_allocations(engine) == decode_allocations(make_engine(alignment_dir / "qwen3_moe", "f32"))
