"""The model families: one entry each, registered by the family's own module.

An entry says everything the loaders need to know of a family: its config.json model_type, its
GGUF architecture and tensor names, the tensor shapes a config implies, and the config flags it
honours. A flag it cannot honour (`refuses`) is refused at load with a clear message, never
silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ellmd.errors import ModelError

# GGUF tensor names every family shares -> Hugging Face names (layer pieces: blk.N.<piece>.weight)
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    gguf_architecture: str  # GGUF's general.architecture
    model: type  # weights in engine layout (sanitize, layer_weights for kernels.layer) and the logits
    layer_shapes: Callable  # layer_shapes(spec, index) -> {HF name under model.layers.N: shape}
    gguf_layer_names: dict = field(default_factory=dict)  # layer pieces beyond GGUF_LAYER_NAMES
    gguf_fields: Callable | None = None  # gguf_fields(get) -> ModelSpec fields read from GGUF metadata
    gguf_permuted_qk: bool = False  # llama.cpp permuted q/k rows for its rope layout
    honours: tuple[str, ...] = ()  # config flags read beyond the shapes (documentation and tests)
    refuses: dict = field(default_factory=dict)  # config flag -> the only value this family can run

    def check_config(self, config: dict) -> None:
        """Refuse a config that sets a flag this family cannot honour."""
        for name, accepted in self.refuses.items():
            value = config.get(name, accepted)
            if value is not None and value != accepted:
                raise ModelError(f"{self.model_type}: config.json sets {name}={value!r}, which ellm cannot run "
                                 f"(only {name}={accepted!r}); refusing to load a different network")

    def gguf_name(self, name: str) -> str | None:
        """The Hugging Face name of a GGUF tensor, or None for one the family does not read."""
        if name in GGUF_GLOBAL_NAMES:
            return GGUF_GLOBAL_NAMES[name]
        parts = name.split(".")
        pieces = {**GGUF_LAYER_NAMES, **self.gguf_layer_names}
        if parts[0] != "blk" or len(parts) != 4 or parts[2] not in pieces:
            return None
        return f"model.layers.{parts[1]}.{pieces[parts[2]]}.{parts[3]}"


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.model_type] = family
    return family


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ModelError(f"unsupported model_type {model_type!r} (supported: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def gguf_family(architecture: str) -> Family:
    for entry in FAMILIES.values():
        if entry.gguf_architecture == architecture:
            return entry
    supported = ", ".join(f.gguf_architecture for f in FAMILIES.values())
    raise ModelError(f"unsupported GGUF architecture {architecture!r} (supported: {supported})")
