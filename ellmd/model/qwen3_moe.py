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
from ellmd.kernels.moe import moe_block
from ellmd.model.qwen3 import Qwen3


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

    def fused_mlp(self, layer) -> tuple:
        if "router" not in layer:
            return super().fused_mlp(layer)
        gate, up, down = (kernel_view(layer[f"experts_{p}"], self.fmt) for p in ("gate", "up", "down"))
        return (layer["router"], gate, up, 0, down), True  # 0: up rows start at 0 of their own stack

    def mlp(self, layer, ws, n) -> None:
        if "router" not in layer:
            return super().mlp(layer, ws, n)
        spec = self.spec
        moe_block(
            ws.h[:n], layer["router"], spec.num_experts_per_tok, spec.norm_topk_prob,
            (layer["experts_gate"], layer["experts_up"]), layer["experts_down"], self.fmt, ws.moe_out[:n],
            ws.router_logits[:n], ws.expert_weights[:n], ws.expert_ids[:n], ws.moe_scratch,
        )
        ws.h[:n] = ws.moe_out[:n]
