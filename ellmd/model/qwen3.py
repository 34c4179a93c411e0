"""Qwen3 (dense): Llama plus an RMSNorm over each head of q and k, before rope.

Shapes: as llama.py; q_norm, k_norm [d] f32.
"""

from __future__ import annotations

from ellmd.kernels import formats
from ellmd.model import llama
from ellmd.model.llama import Llama
from ellmd.model.registry import Family, register


class Qwen3(Llama):
    @classmethod
    def sanitize_layer(cls, get, spec, prefix, index) -> dict:
        layer = super().sanitize_layer(get, spec, prefix, index)
        layer["q_norm"] = get(f"{prefix}.self_attn.q_norm.weight", formats.F32)
        layer["k_norm"] = get(f"{prefix}.self_attn.k_norm.weight", formats.F32)
        return layer


def layer_shapes(spec, index: int) -> dict[str, tuple[int, ...]]:
    d = spec.head_dim
    return {**llama.layer_shapes(spec, index), "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}


QK_NORM_GGUF_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

FAMILY = register(Family(
    model_type="qwen3", gguf_architecture="qwen3", model=Qwen3, layer_shapes=layer_shapes,
    gguf_layer_names=QK_NORM_GGUF_NAMES, honours=llama.FAMILY.honours,
    refuses={**llama.FAMILY.refuses, "use_sliding_window": False},
))
