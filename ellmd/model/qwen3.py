"""Qwen3 (dense): Llama plus an RMSNorm over each head of q and k, before rope.

Shapes: as llama.py; q_norm, k_norm [d] f32.
"""

from __future__ import annotations

from ellmd import kernels
from ellmd.kernels import formats
from ellmd.model.llama import Llama


class Qwen3(Llama):
    @classmethod
    def sanitize_layer(cls, get, spec, prefix, index) -> dict:
        layer = super().sanitize_layer(get, spec, prefix, index)
        layer["q_norm"] = get(f"{prefix}.self_attn.q_norm.weight", formats.F32)
        layer["k_norm"] = get(f"{prefix}.self_attn.k_norm.weight", formats.F32)
        return layer

    def qk_norm(self, layer, q, k) -> None:
        eps = self.spec.rms_norm_eps
        kernels.rmsnorm_heads(q, layer["q_norm"], eps)  # q [n, H, d] in place
        kernels.rmsnorm_heads(k, layer["k_norm"], eps)  # k [n, G, d] in place
