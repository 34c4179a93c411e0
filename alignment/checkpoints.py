"""Tiny random Hugging Face checkpoints of every family, written with transformers in seconds.

Each variant exercises something the loader or the forward pass could get wrong: GQA (6 query
heads over 2 KV heads), head_dim != hidden / heads, an odd vocabulary (1001), tied and untied
embeddings, float32 and bfloat16 storage, sharded safetensors with an index, llama3 / linear /
yarn rope scaling, MoE top-2 of 8 experts with and without renormalisation, a dense layer in an
MoE model (mlp_only_layers).

Weights are re-drawn at a realistic scale (unit-variance projections, norm weights around 1,
embeddings at 0.25) so that attention is not uniform and the logits span several units: a
check against logits that are all ~0 would prove nothing.

The Qwen3 tokenizer from tests/fixtures/qwen3-tokenizer is copied in so the engine finds a
tokenizer; the checks feed token ids directly and keep them below the vocabulary size.

    python alignment/checkpoints.py --dir /tmp/ellm-ckpts        # write all variants
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = ROOT / "tests" / "fixtures" / "qwen3-tokenizer"

VOCAB = 1001
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=32,  # != 96 / 6 (alignment/head_dim.py covers head_dims that are not multiples of 16)
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
MOE_SHAPE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)

# name -> (model_type, config overrides, saved dtype, tied embeddings, sharded)
VARIANTS: dict[str, dict] = {
    "llama": dict(model_type="llama", dtype="float32", tied=False, sharded=False, config={}),
    "llama-llama3-tied-bf16": dict(
        model_type="llama",
        dtype="bfloat16",
        tied=True,
        sharded=False,
        config=dict(
            rope_parameters=dict(
                rope_type="llama3", rope_theta=50000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=256,
            )
        ),
    ),
    "llama-linear-sharded": dict(
        model_type="llama",
        dtype="float32",
        tied=False,
        sharded=True,
        config=dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
    ),
    "qwen3": dict(model_type="qwen3", dtype="float32", tied=True, sharded=True, config=dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    "qwen3-yarn-bf16": dict(
        model_type="qwen3",
        dtype="bfloat16",
        tied=False,
        sharded=False,
        config=dict(
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256)
        ),
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        dtype="float32",
        tied=False,
        sharded=True,
        config=dict(MOE_SHAPE, norm_topk_prob=True),
    ),
    "qwen3_moe-dense0-tied-bf16": dict(
        model_type="qwen3_moe",
        dtype="bfloat16",
        tied=True,
        sharded=False,
        config=dict(MOE_SHAPE, norm_topk_prob=False, mlp_only_layers=[0]),
    ),
}
# The plain variant of each family (what a family-parametrised test uses first).
FAMILY_VARIANTS = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}

EMBED_STD = 0.25
LM_HEAD_STD = 0.25
NORM_JITTER = 0.2
ROUTER_GAIN = 2.0
DONE = ".ellm-alignment-done"


def config_for(name: str):
    """The transformers config object of a variant."""
    import transformers

    variant = VARIANTS[name]
    kwargs = dict(SHAPE, tie_word_embeddings=variant["tied"], **variant["config"])
    classes = {
        "llama": transformers.LlamaConfig,
        "qwen3": transformers.Qwen3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }
    return classes[variant["model_type"]](**kwargs)


def randomize(model, seed: int) -> None:
    """Re-draw every parameter at a scale where the forward pass does something visible."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=generator, dtype=torch.float32) * std

    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            if name.endswith("norm.weight"):  # input/post/final norms and Qwen3's q/k norms
                value = 1.0 + normal(shape, NORM_JITTER)
            elif "embed_tokens" in name:
                value = normal(shape, EMBED_STD)
            elif name.startswith("lm_head"):
                value = normal(shape, LM_HEAD_STD)
            elif name.endswith("mlp.gate.weight"):  # the MoE router [E, h]
                value = normal(shape, ROUTER_GAIN / math.sqrt(shape[-1]))
            elif name.endswith("bias"):
                value = normal(shape, 0.1)
            else:  # projections [out, in] and stacked experts [E, out, in]: unit-variance outputs
                value = normal(shape, 1.0 / math.sqrt(shape[-1]))
            param.copy_(value)


def build(name: str, directory: Path, seed: int = 0) -> Path:
    """Write the variant `name` into `directory` (created); returns it."""
    import torch
    import transformers

    variant = VARIANTS[name]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = config_for(name)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed)
    if variant["tied"]:
        model.tie_weights()
    model = model.to(getattr(torch, variant["dtype"]))
    shard = "200KB" if variant["sharded"] else "10GB"
    model.save_pretrained(directory, max_shard_size=shard)
    for file in TOKENIZER_DIR.iterdir():
        shutil.copy(file, directory / file.name)
    (directory / DONE).write_text(_stamp(name, seed))
    return directory


def _stamp(name: str, seed: int = 0) -> str:
    """What a cached variant was built from: rebuilt when any of it changes."""
    recipe = {"variant": name, "seed": seed, "shape": SHAPE, "recipe": VARIANTS[name], "moe": MOE_SHAPE,
              "scales": [EMBED_STD, LM_HEAD_STD, NORM_JITTER, ROUTER_GAIN]}
    return json.dumps(recipe, sort_keys=True)


def ensure(root: Path, name: str) -> Path:
    """The variant's directory under `root`, written first if it is not there yet."""
    if name not in VARIANTS:
        raise KeyError(f"unknown checkpoint variant {name!r} (known: {', '.join(VARIANTS)})")
    directory = Path(root) / name
    done = directory / DONE
    if not done.exists() or done.read_text() != _stamp(name):
        if directory.exists():
            shutil.rmtree(directory)
        build(name, directory)
    return directory


def ensure_all(root: Path, names=None) -> dict[str, Path]:
    return {name: ensure(root, name) for name in (names or VARIANTS)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="where to write (one sub-directory per variant)")
    parser.add_argument("--variant", action="append", choices=list(VARIANTS), help="default: all")
    args = parser.parse_args(argv)
    for name, path in ensure_all(Path(args.dir), args.variant).items():
        files = sorted(p.name for p in path.iterdir())
        print(f"{name:28s} {path}  ({len(files)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
