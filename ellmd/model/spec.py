"""ModelSpec: what the network is, with fields named after config.json keys."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ellmd.errors import ModelError
from ellmd.model import registry


@dataclasses.dataclass
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: list[int] = dataclasses.field(default_factory=list)
    # qwen3_moe
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.head_dim % 2:
            # rotary embeddings turn pairs of dimensions; transformers fails on such a model too
            raise ModelError(f"head_dim {self.head_dim} is odd: rotary position embeddings need an even head_dim")

    def is_moe_layer(self, layer: int) -> bool:
        """True where Qwen3-MoE puts a sparse block instead of the dense MLP (transformers' rule)."""
        return (
            self.model_type == "qwen3_moe"
            and self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_config(cls, config: dict) -> "ModelSpec":
        """Build from a Hugging Face config.json dict."""
        registry.family(config.get("model_type")).check_config(config)
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in known}
        kwargs.setdefault("num_key_value_heads", config["num_attention_heads"])
        if kwargs.get("head_dim") is None:
            kwargs["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
        # Newer transformers configs keep rope_theta inside rope_parameters.
        rope_parameters = config.get("rope_parameters") or {}
        if "rope_theta" not in config and "rope_theta" in rope_parameters:
            kwargs["rope_theta"] = rope_parameters["rope_theta"]
        if kwargs.get("rope_scaling") is None and rope_parameters.get("rope_type", "default") != "default":
            kwargs["rope_scaling"] = dict(rope_parameters)
        kwargs["eos_token_id"] = _as_list(config.get("eos_token_id"))
        kwargs["torch_dtype"] = str(config.get("torch_dtype") or config.get("dtype") or "float32")
        kwargs["mlp_only_layers"] = list(config.get("mlp_only_layers") or [])
        if "num_experts" not in config and "num_local_experts" in config:  # transformers 5 spelling
            kwargs["num_experts"] = config["num_local_experts"]
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ModelError(f"config.json is missing a field: {e}") from None

    @classmethod
    def from_file(cls, path: Path) -> "ModelSpec":
        try:
            return cls.from_config(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise ModelError(f"{path}: no such file") from None
        except json.JSONDecodeError as e:
            raise ModelError(f"{path}: not valid JSON ({e})") from None
        except KeyError as e:
            raise ModelError(f"{path}: missing key {e}") from None

    @classmethod
    def from_gguf(cls, fields: dict) -> "ModelSpec":
        """Build from GGUF metadata (a plain dict of key -> value)."""
        arch = fields.get("general.architecture")
        family = registry.gguf_family(arch)

        def get(key, default=None):
            return fields.get(f"{arch}.{key}", default)

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        vocab = get("vocab_size") or len(fields.get("tokenizer.ggml.tokens", []))
        scaling = None
        scaling_type = get("rope.scaling.type")
        if scaling_type and scaling_type != "none":
            scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0))}
            if get("rope.scaling.original_context_length"):
                scaling["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
        return cls(
            model_type=family.model_type,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", 0)),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("attention.key_length", hidden // heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings=False,  # decided by the loader: no output.weight means tied
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=_as_list(fields.get("tokenizer.ggml.eos_token_id")),
            **(family.gguf_fields(get) if family.gguf_fields else {}),
        )


def _as_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]
