"""The family registry: one entry per family, and config flags a family cannot run refused at load."""

from __future__ import annotations

import pytest

from ellmd.errors import ModelError
from ellmd.model import FAMILIES
from ellmd.model.registry import gguf_family
from ellmd.model.spec import ModelSpec

TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def test_every_family_loads_from_its_model_type_and_its_gguf_architecture():
    assert set(FAMILIES) == {"llama", "qwen3", "qwen3_moe"}
    for model_type, family in FAMILIES.items():
        assert ModelSpec.from_config({"model_type": model_type, **TINY}).model_type == model_type
        assert gguf_family(family.gguf_architecture) is family


@pytest.mark.parametrize("model_type, flag, value", [
    ("llama", "mlp_bias", True), ("qwen3", "mlp_bias", True), ("llama", "hidden_act", "gelu"),
    ("qwen3", "use_sliding_window", True), ("qwen3_moe", "use_sliding_window", True),
])
def test_a_flag_the_family_cannot_run_is_refused_by_name(model_type, flag, value):
    with pytest.raises(ModelError, match=f"{flag}={value!r}.*cannot run"):
        ModelSpec.from_config({"model_type": model_type, **TINY, flag: value})


def test_the_default_values_of_refused_flags_load():
    spec = ModelSpec.from_config({"model_type": "qwen3", **TINY, "mlp_bias": False, "hidden_act": "silu",
                                  "use_sliding_window": False})
    assert spec.num_key_value_heads == 2


def test_unknown_families_are_refused_with_the_supported_ones():
    with pytest.raises(ModelError, match="unsupported model_type 'gpt2'.*llama, qwen3, qwen3_moe"):
        ModelSpec.from_config({"model_type": "gpt2", **TINY})
    with pytest.raises(ModelError, match="unsupported GGUF architecture 'gpt2'.*qwen3moe"):
        ModelSpec.from_gguf({"general.architecture": "gpt2"})


def test_gguf_tensor_names_are_the_familys():
    llama, qwen3, moe = FAMILIES["llama"], FAMILIES["qwen3"], FAMILIES["qwen3_moe"]
    assert llama.gguf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert llama.gguf_name("blk.3.attn_q_norm.weight") is None  # llama has no per-head norm
    assert qwen3.gguf_name("blk.3.attn_q_norm.weight") == "model.layers.3.self_attn.q_norm.weight"
    assert qwen3.gguf_name("blk.0.ffn_up_exps.weight") is None
    assert moe.gguf_name("blk.0.ffn_up_exps.weight") == "model.layers.0.mlp.experts.up_proj.weight"
    assert moe.gguf_name("output.weight") == "lm_head.weight"
    assert llama.gguf_permuted_qk and not qwen3.gguf_permuted_qk


def test_layer_shapes_follow_the_family():
    spec = ModelSpec.from_config({"model_type": "qwen3_moe", **TINY, "num_experts": 4, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 16, "mlp_only_layers": [0]})
    dense, sparse = (FAMILIES["qwen3_moe"].layer_shapes(spec, i) for i in (0, 1))
    assert dense["mlp.gate_proj.weight"] == (48, 32) and "mlp.gate.weight" not in dense
    assert sparse["mlp.gate.weight"] == (4, 32) and sparse["mlp.experts.3.down_proj.weight"] == (32, 16)
    assert sparse["self_attn.q_norm.weight"] == (8,) and "mlp.gate_proj.weight" not in sparse
    assert "self_attn.q_norm.weight" not in FAMILIES["llama"].layer_shapes(spec, 0)
