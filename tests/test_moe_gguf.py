"""scripts/make_moe_gguf.py at a tiny width: the file it writes is a Qwen3-MoE GGUF that ellm reads
(shapes, Q8_0 blocks, the real Qwen3 tokenizer and chat template) and runs. The full-width files are
made on demand by the benchmarks, never here; llama-quantize is not needed for the Q8_0 file.
"""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """The 30B-A3B config at a tiny width (the real vocabulary), 2 layers, written as Q8_0."""
    make = _script("make_moe_gguf")
    config = json.loads((FIXTURES / "configs" / "qwen3-coder-30b-a3b-instruct.json").read_text())
    config.update(hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96)
    root = tmp_path_factory.mktemp("moe-gguf")
    config_file = root / "tiny-moe.json"
    config_file.write_text(json.dumps(config))
    assert make.main(["--config", str(config_file), "--layers", "2", "--formats", "Q8_0", "--out-dir", str(root)]) == 0
    return config, root / "tiny-moe-L2-seed0.Q8_0.gguf"


def test_spec_and_block_types_follow_the_config(tiny_moe):
    import gguf

    from ellmd.model.weights import GGUFCheckpoint

    config, path = tiny_moe
    spec = GGUFCheckpoint(path).spec
    for key in ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size", "vocab_size", "rope_theta", "rms_norm_eps"):
        assert getattr(spec, key) == pytest.approx(config[key], rel=1e-6), key  # GGUF stores floats as f32
    assert spec.model_type == "qwen3_moe" and spec.num_hidden_layers == 2 and spec.norm_topk_prob
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.1.ffn_down_exps.weight"] == "Q8_0" and types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.ffn_gate_inp.weight"] == "F32" and types["blk.0.attn_q_norm.weight"] == "F32"
    down = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_down_exps.weight")
    values = gguf.quants.dequantize(down.data, down.tensor_type)  # [E, h, I]: std fan_in**-0.5, Q8_0-rounded
    assert values.shape == (8, 64, 32) and abs(values.std() - 32**-0.5) < 0.01


def test_tokenizer_is_qwen3s(tiny_moe):
    import tokenizers

    from ellmd.text.tokenizer import Tokenizer

    _, path = tiny_moe
    ours = Tokenizer.from_gguf(path)
    reference = tokenizers.Tokenizer.from_file(str(FIXTURES / "qwen3-tokenizer" / "tokenizer.json"))
    text = "<|im_start|>user\nHello, wörld! 12345 def f(x): return x**2<|im_end|>\n"
    assert ours.encode(text) == reference.encode(text, add_special_tokens=False).ids
    assert "<|im_start|>" in ours.chat_template and ours.eos_token == "<|im_end|>"


def test_ellm_loads_and_generates(tiny_moe):
    from ellmd.engine import Engine

    _, path = tiny_moe
    engine = Engine(path, sequence_length=64, threads=2)
    logits = engine.prefill(0, engine.tokenizer.encode("Hello there"), logits="last")
    step = engine.decode([0], [int(np.argmax(logits))])
    assert np.isfinite(logits).all() and np.isfinite(step).all() and logits.std() > 0



def _block_products(path, tokens, chunk):
    """{weight: (input rows, output rows)} of every matmul on block weights and every MoE block of a
    prefill of tokens in chunks of chunk, the chunks' rows joined in order."""
    from ellmd import kernels
    from ellmd.engine import Engine
    from ellmd.kernels import lanes, layer, moe, quant

    calls = {}
    engine = Engine(path, sequence_length=256, chunk_size=chunk, threads=2)
    names = {id(w): f"{i}.{name}" for i, layer in enumerate(engine.model.layers) for name, w in layer.items()}
    names[id(engine.model.lm_head)] = "lm_head"

    def recorder(kernel, weight_at, out_at):
        def run(*args):
            kernel(*args)
            if quant.is_blocks(args[weight_at]) or lanes.is_tiles(args[weight_at]):  # tiles on int16 (lanes.py)
                ins, outs = calls.setdefault(names[id(args[weight_at])], ([], []))
                ins.append(args[0].copy())
                outs.append(args[out_at].copy())

        return run

    with pytest.MonkeyPatch.context() as patch:  # the test's own patches (its kernel path) stay
        for module in (kernels, layer):  # the head's matmul (Llama.logits) and the layers' (kernels.layer)
            patch.setattr(module, "matmul", recorder(module.matmul, 1, 3))
        patch.setattr(moe, "moe_block", recorder(moe.moe_block, 5, 7))
        engine.prefill(0, tokens)
    return {w: (np.concatenate(ins), np.concatenate(outs)) for w, (ins, outs) in calls.items()}


@pytest.mark.parametrize("kernels", ["default", "vnni"])  # the integer paths (portable decodes blocks two ways)
def test_block_products_give_a_row_the_same_bits_in_any_chunk(tiny_moe, use_kernels, kernels):
    # one arithmetic per token on block weights: in a prefill of 150 tokens whole (the GEMM), or in
    # chunks of 70, 70 and 10 (the last one on the decode kernels), each product gives a row whose
    # input is the same bits the same output bits: the projections, the MoE blocks, the head
    use_kernels(kernels)
    _, path = tiny_moe
    tokens = np.random.default_rng(5).integers(0, 1000, 150)
    whole, chunked = (_block_products(path, tokens, size) for size in (256, 70))
    assert len(whole) == len(chunked) == 2 * 3 + 1  # per layer qkv, o and the MoE block; the head
    compared = 0
    for w, (x, out) in whole.items():
        same = (x == chunked[w][0]).all(axis=1)  # rows whose attention differed (a chunk's first) differ on
        assert np.array_equal(out[same], chunked[w][1][same])
        compared += same.sum()
    assert compared > 0.75 * (6 * 150 + 1)  # all but the rows an attention made differ


def test_last_logits_are_the_same_bits_however_the_prompt_was_split(tiny_moe, use_kernels):
    # one arithmetic per token: a whole prefill, a prefill in chunks, and a prefill of all but the
    # last token then a decode step give the last token the same logits, to the bit
    from ellmd.engine import Engine

    use_kernels("default")
    _, path = tiny_moe
    tokens = np.random.default_rng(5).integers(0, 1000, 150)
    whole, chunked = (Engine(path, sequence_length=256, chunk_size=size, threads=2) for size in (256, 70))
    last = [engine.prefill(0, tokens) for engine in (whole, chunked)]
    whole.kv.lengths[0] = 0  # the slot emptied, the same engine again: all but the last, then a decode step
    whole.prefill(0, tokens[:-1], logits="none")
    last.append(whole.decode([0], [int(tokens[-1])])[0].copy())
    assert np.array_equal(last[0], last[1]), "chunked prefill"
    assert np.array_equal(last[0], last[2]), "prefill then a decode step"
