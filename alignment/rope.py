"""Rotary embeddings vs transformers: every rope type of Llama and Qwen3 configs.

For each config the engine path (config.json dict -> ModelSpec -> rope_tables -> rope) is compared
with transformers' path (config class -> <Family>RotaryEmbedding, which runs ROPE_INIT_FUNCTIONS,
-> apply_rotary_pos_emb): the cos/sin tables (yarn's attention factor included) and q, k rotated
at sequential and scattered positions, up to 32k where the config allows.

Rope types covered: default (Llama 2, SmolLM2, Qwen3), linear, dynamic (below
max_position_embeddings: transformers rescales dynamic rope per forward beyond it, which a static
table cannot follow; reported, not checked), llama3 (Llama 3.1 / 3.2) and yarn (Qwen3 long
context); the tiny test checkpoints; and the Qwen3 configs in tests/fixtures/configs.

Shapes: q [n, H, d], k [n, G, d]; tables [L, d/2].
"""

from __future__ import annotations

try:
    from alignment import common
except ImportError:
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from alignment import common

import copy
import json

import numpy as np

TOL = 1e-4  # fp32 angles: identical inv_freq gives ~1e-7; one ulp of inv_freq at 32k gives ~1e-3
FIXTURE_CONFIGS = common.ROOT / "tests" / "fixtures" / "configs"


def _llama(name, head_dim, heads, kv_heads, theta, max_pos, scaling=None):
    return name, {
        "model_type": "llama", "hidden_size": head_dim * heads, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "rope_theta": theta,
        "max_position_embeddings": max_pos, "rope_scaling": scaling,
        "vocab_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    }


def _qwen3(name, head_dim, heads, kv_heads, theta, max_pos, scaling=None):
    name, config = _llama(name, head_dim, heads, kv_heads, theta, max_pos, scaling)
    config["model_type"] = "qwen3"
    config["hidden_size"] = 1024  # Qwen3's head_dim is not hidden / heads
    return name, config


# Configs as real config.json files spell them (transformers 4 style: rope_theta + rope_scaling).
CONFIGS = [
    _llama("Llama-2-7B (default)", 128, 32, 32, 10000.0, 4096),
    _llama("SmolLM2-135M (default)", 64, 9, 3, 100000.0, 8192),
    _llama("linear x4", 128, 32, 8, 10000.0, 16384, {"type": "linear", "factor": 4.0}),
    _llama("dynamic x2", 128, 32, 8, 10000.0, 4096, {"type": "dynamic", "factor": 2.0}),
    _llama(
        "Llama-3.1-8B (llama3)", 128, 32, 8, 500000.0, 131072,
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
    ),
    _llama(
        "Llama-3.2-1B (llama3)", 64, 32, 8, 500000.0, 131072,
        {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
    ),
    _qwen3("Qwen3-8B (default)", 128, 32, 8, 1000000.0, 40960),
    _qwen3(
        "Qwen3-8B yarn x4", 128, 32, 8, 1000000.0, 131072,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    ),
    _qwen3(
        "yarn with beta/attention_factor set", 64, 8, 2, 10000.0, 8192,
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096, "beta_fast": 16,
         "beta_slow": 2, "attention_factor": 1.2},
    ),
]


def transformers_config(config: dict):
    import transformers

    classes = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig}
    return classes[config["model_type"]](**copy.deepcopy(config))


def reference(config: dict, q: np.ndarray, k: np.ndarray, positions: np.ndarray):
    """transformers' cos, sin [n, d] and rotated q, k [n, heads, d]."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    classes = {"llama": LlamaRotaryEmbedding, "qwen3": Qwen3RotaryEmbedding, "qwen3_moe": Qwen3MoeRotaryEmbedding}
    rotary = classes[config["model_type"]](config=transformers_config(config))
    qt = torch.from_numpy(q).transpose(0, 1)[None]  # [1, H, n, d]
    kt = torch.from_numpy(k).transpose(0, 1)[None]
    with torch.no_grad():
        cos, sin = rotary(qt, torch.from_numpy(positions)[None])  # [1, n, d]
        q_rot, k_rot = apply_rotary_pos_emb(qt, kt, cos, sin)
    return cos[0].numpy(), sin[0].numpy(), q_rot[0].transpose(0, 1).numpy(), k_rot[0].transpose(0, 1).numpy()


def check_config(report, name: str, config: dict, rng, max_position: int | None = None) -> None:
    from ellmd.model.spec import ModelSpec

    rope_tables, rope, rope_ref = common.kernel("rope_tables"), common.kernel("rope"), common.kernel("rope_ref")
    spec = ModelSpec.from_config(copy.deepcopy(config))
    limit = min(max_position or spec.max_position_embeddings, spec.max_position_embeddings, 32768)
    positions = np.concatenate([np.arange(min(48, limit)), np.sort(rng.integers(0, limit, 80)), [limit - 1]]).astype(np.int64)
    H, G, d = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
    H, G = min(H, 8), min(G, 4)  # enough heads to catch a head-stride bug, small enough to be quick
    q = rng.standard_normal((len(positions), H, d)).astype(np.float32)
    k = rng.standard_normal((len(positions), G, d)).astype(np.float32)
    ref_cos, ref_sin, ref_q, ref_k = reference(config, q, k, positions)

    cos, sin = rope_tables(d, spec.rope_theta, spec.rope_scaling, spec.max_position_embeddings, limit)
    half = d // 2
    report.compare(f"{name}: cos table", cos[positions], ref_cos[:, :half], TOL)
    report.compare(f"{name}: sin table", sin[positions], ref_sin[:, :half], TOL)
    ours_q, ours_k = q.copy(), k.copy()
    rope(ours_q, positions, cos, sin)
    rope(ours_k, positions, cos, sin)
    report.compare(f"{name}: q rotated [{len(positions)},{H},{d}]", ours_q, ref_q, TOL)
    report.compare(f"{name}: k rotated [{len(positions)},{G},{d}]", ours_k, ref_k, TOL)
    numpy_q = q.copy()
    rope_ref(numpy_q, positions, cos, sin)
    report.compare(f"{name}: q rotated, numpy reference", numpy_q, ref_q, TOL)


def main(argv=None) -> int:
    p = common.parser(__doc__.splitlines()[0], variants=False)
    p.parse_args(argv)
    common.torch_setup()
    from alignment.checkpoints import VARIANTS, config_for

    report = common.Report("rope vs transformers RotaryEmbedding + apply_rotary_pos_emb")
    rng = np.random.default_rng(0)
    for name, config in CONFIGS:
        check_config(report, name, config, rng)
    for name in VARIANTS:  # the tiny checkpoints' configs, as transformers 5 writes them
        config = config_for(name).to_dict()
        check_config(report, f"tiny {name}", config, rng)
    for path in sorted(FIXTURE_CONFIGS.glob("*.json")):
        check_config(report, f"fixture {path.stem}", json.loads(path.read_text()), rng)

    # Beyond max_position_embeddings transformers recomputes dynamic rope from the batch's
    # longest position; a static table keeps the initial frequencies. Shown for information.
    name, config = CONFIGS[3]
    spec_max = config["max_position_embeddings"]
    positions = np.array([spec_max + 100, 2 * spec_max - 1], np.int64)
    d = config["head_dim"]
    q = rng.standard_normal((2, 1, d)).astype(np.float32)
    _, _, ref_q, _ = reference(config, q, q.copy(), positions)
    cos, sin = common.kernel("rope_tables")(d, config["rope_theta"], config["rope_scaling"], spec_max, 2 * spec_max)
    ours = q.copy()
    common.kernel("rope")(ours, positions, cos, sin)
    error = float(np.abs(ours - ref_q).max() / np.abs(ref_q).max())
    report.note(f"(info) dynamic x2 beyond max_position_embeddings: max rel {error:.2e} (not checked)")
    return report.exit_code()


if __name__ == "__main__":
    common.run(main)
