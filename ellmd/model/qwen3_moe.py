"""Qwen3-MoE: Qwen3 with a routed mixture of experts in place of the dense MLP.

Shapes (E experts, k experts per token, I moe_intermediate_size):
  router           [E, h]        f32 (small, and top-k choices are sensitive to its precision)
  experts_gate     [E, I, h]     storage format ([E, I, blocks] for GGUF blocks)
  experts_up       [E, I, h]     storage format
  experts_down     [E, h, I]     storage format
Gate and up stay two stacks: a GGUF's stacks are then views of the file (no copy of two thirds
of the weights), may have different block types, and the fused kernel reads them as two row
streams either way.
"""

from __future__ import annotations

import numpy as np

from ellmd.kernels import formats
from ellmd.kernels.formats import kernel_view
from ellmd.model import qwen3
from ellmd.model.qwen3 import Qwen3
from ellmd.model.registry import Family, register


class Qwen3Moe(Qwen3):
    @classmethod
    def sanitize_mlp(cls, get, spec, prefix, index) -> dict:
        if not spec.is_moe_layer(index):
            return super().sanitize_mlp(get, spec, prefix, index)
        mlp = f"{prefix}.mlp"
        if f"{mlp}.experts.gate_proj.weight" in get:  # GGUF stacks the experts of a layer in one tensor
            gate, up = get(f"{mlp}.experts.gate_proj.weight"), get(f"{mlp}.experts.up_proj.weight")
            down = get(f"{mlp}.experts.down_proj.weight")
        else:  # Hugging Face keeps one tensor per expert
            experts = range(spec.num_experts)
            gate = np.stack([get(f"{mlp}.experts.{e}.gate_proj.weight") for e in experts])
            up = np.stack([get(f"{mlp}.experts.{e}.up_proj.weight") for e in experts])
            down = np.stack([get(f"{mlp}.experts.{e}.down_proj.weight") for e in experts])
        return {
            "router": get(f"{mlp}.gate.weight", formats.F32),
            "experts_gate": np.ascontiguousarray(gate),
            "experts_up": np.ascontiguousarray(up),
            "experts_down": np.ascontiguousarray(down),
        }

    def mlp_weights(self, layer) -> tuple:
        """Routed experts' weights for kernels.layer.feed_forward: (router, gate, up, up0, down)."""
        if "router" not in layer:
            return super().mlp_weights(layer)
        gate, up, down = (kernel_view(layer[f"experts_{p}"], self.fmt) for p in ("gate", "up", "down"))
        return layer["router"], gate, up, 0, down  # 0: up rows start at 0 of their own stack


def layer_shapes(spec, index: int) -> dict[str, tuple[int, ...]]:
    shapes = qwen3.layer_shapes(spec, index)
    if not spec.is_moe_layer(index):
        return shapes
    h, I = spec.hidden_size, spec.moe_intermediate_size
    for name in ("gate_proj", "up_proj", "down_proj"):
        del shapes[f"mlp.{name}.weight"]
    shapes["mlp.gate.weight"] = (spec.num_experts, h)
    for e in range(spec.num_experts):
        shapes.update({f"mlp.experts.{e}.gate_proj.weight": (I, h), f"mlp.experts.{e}.up_proj.weight": (I, h),
                       f"mlp.experts.{e}.down_proj.weight": (h, I)})
    return shapes


def gguf_fields(get) -> dict:
    return {"num_experts": int(get("expert_count", 0)), "num_experts_per_tok": int(get("expert_used_count", 0)),
            "moe_intermediate_size": int(get("expert_feed_forward_length", 0)),
            "norm_topk_prob": bool(get("expert_weights_norm", True))}


FAMILY = register(Family(
    model_type="qwen3_moe", gguf_architecture="qwen3moe", model=Qwen3Moe, layer_shapes=layer_shapes,
    gguf_layer_names={**qwen3.QK_NORM_GGUF_NAMES, "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                      "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"},
    gguf_fields=gguf_fields,
    honours=(*qwen3.FAMILY.honours, "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
             "decoder_sparse_step", "mlp_only_layers"),
    refuses=qwen3.FAMILY.refuses,
))
