"""ModelSpec: what the network is, with fields named after config.json keys."""

from __future__ import annotations

import dataclasses
import json
import math
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
        for name, (holds, rule) in RULES.items():
            if not holds(getattr(self, name)):
                raise FieldError(name, getattr(self, name), rule)
        for name, holds, rule in self.relations():
            if not holds:
                raise FieldError(name, getattr(self, name), rule)
        if self.head_dim % 2:
            # rotary embeddings turn pairs of dimensions; transformers fails on such a model too
            raise ModelError(f"head_dim {self.head_dim} is odd: rotary position embeddings need an even head_dim")

    def relations(self) -> list[tuple[str, bool, str]]:
        """(field, holds, rule) between fields, checked once each field is in its own range."""
        layers, vocab = range(self.num_hidden_layers), range(self.vocab_size)
        moe = self.model_type == "qwen3_moe" and self.num_experts > 0
        scaling = self.rope_scaling
        return [
            ("num_key_value_heads", self.num_attention_heads % self.num_key_value_heads == 0,
             f"must divide num_attention_heads ({self.num_attention_heads})"),
            ("intermediate_size", self.intermediate_size >= 1 or all(self.is_moe_layer(i) for i in layers),
             "must be >= 1 (the model has dense MLP layers)"),
            ("bos_token_id", self.bos_token_id is None or _is_int(self.bos_token_id) and self.bos_token_id in vocab,
             f"must be a token id in [0, {self.vocab_size})"),
            ("eos_token_id", all(_is_int(t) and t in vocab for t in self.eos_token_id),
             f"must be token ids in [0, {self.vocab_size})"),
            ("mlp_only_layers", all(_is_int(i) and i in layers for i in self.mlp_only_layers),
             f"must be layer indices in [0, {self.num_hidden_layers})"),
            ("num_experts_per_tok", not moe or 1 <= self.num_experts_per_tok <= self.num_experts,
             f"must be in [1, num_experts = {self.num_experts}]"),
            ("moe_intermediate_size", not moe or self.moe_intermediate_size >= 1, "must be >= 1 (the model has experts)"),
            ("rope_scaling", scaling is None or isinstance(scaling, dict) and _positive(scaling.get("factor", 1.0)),
             "must be a map whose factor is a number > 0"),
        ]

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
        if not isinstance(config, dict):
            raise ModelError(f"config.json must hold a JSON object, not {type(config).__name__}")
        registry.family(config.get("model_type")).check_config(config)
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in known}
        kwargs.setdefault("num_key_value_heads", config["num_attention_heads"])
        if kwargs.get("head_dim") is None:
            kwargs["head_dim"] = _quotient(config["hidden_size"], config["num_attention_heads"])
        # Newer transformers configs keep rope_theta inside rope_parameters.
        rope_parameters = config.get("rope_parameters") or {}
        if "rope_theta" not in config and "rope_theta" in rope_parameters:
            kwargs["rope_theta"] = rope_parameters["rope_theta"]
        if kwargs.get("rope_scaling") is None and rope_parameters.get("rope_type", "default") != "default":
            kwargs["rope_scaling"] = dict(rope_parameters)
        kwargs["eos_token_id"] = _as_list(config.get("eos_token_id"))
        kwargs["torch_dtype"] = str(config.get("torch_dtype") or config.get("dtype") or "float32")
        kwargs["mlp_only_layers"] = config.get("mlp_only_layers") or []
        if "num_experts" not in config and "num_local_experts" in config:  # transformers 5 spelling
            kwargs["num_experts"] = config["num_local_experts"]
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ModelError(f"config.json is missing a field: {e}") from None
        except FieldError as e:
            raise ModelError(f"config.json: {e.name} = {e.value!r}: {e.rule}") from None

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

        try:
            return cls._from_gguf(fields, arch, family, get)
        except FieldError as e:
            raise ModelError(f"GGUF metadata: {GGUF_KEYS.get(e.name, e.name)} (ellm's {e.name}) = {e.value!r}: "
                             f"{e.rule}") from None
        except (TypeError, ValueError) as e:  # a value of the wrong type (a string where a number goes)
            raise ModelError(f"GGUF metadata: a value of the wrong type ({e})") from None

    @classmethod
    def _from_gguf(cls, fields: dict, arch: str, family, get) -> "ModelSpec":
        def need(key):
            if get(key) is None:
                raise ModelError(f"GGUF metadata: {arch}.{key} is missing")
            return get(key)

        heads = int(need("attention.head_count"))
        hidden = int(need("embedding_length"))
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
            num_hidden_layers=int(need("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("attention.key_length", _quotient(hidden, heads))),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings=False,  # decided by the loader: no output.weight means tied
            bos_token_id=None if (bos := fields.get("tokenizer.ggml.bos_token_id")) is None else int(bos),
            eos_token_id=[int(t) for t in _as_list(fields.get("tokenizer.ggml.eos_token_id"))],
            **(family.gguf_fields(get) if family.gguf_fields else {}),
        )


def _as_list(value) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


class FieldError(ModelError):
    """A field out of its range: the constructor (from_config, from_gguf) names where it came from."""

    def __init__(self, name: str, value, rule: str):
        super().__init__(f"{name} = {value!r}: {rule}")
        self.name, self.value, self.rule = name, value, rule


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def _quotient(hidden, heads):
    """hidden_size // num_attention_heads, when both are positive integers (else their own check fails first)."""
    return hidden // heads if _is_int(hidden) and _is_int(heads) and heads > 0 else 0


def _at_least(minimum: int):
    return (lambda value: _is_int(value) and value >= minimum), f"must be an integer >= {minimum}"


def _flag():
    return (lambda value: isinstance(value, bool)), "must be true or false"


# field -> (test, rule): the range of every field the loader and the engine use
RULES = {
    "vocab_size": _at_least(1), "hidden_size": _at_least(1), "intermediate_size": _at_least(0),
    "num_hidden_layers": _at_least(1), "num_attention_heads": _at_least(1), "num_key_value_heads": _at_least(1),
    "head_dim": _at_least(1),
    "rms_norm_eps": ((lambda value: _positive(value) and value < 1), "must be a number in (0, 1)"),
    "rope_theta": (_positive, "must be a finite number > 0"),
    "max_position_embeddings": _at_least(1),
    "tie_word_embeddings": _flag(), "attention_bias": _flag(), "mlp_bias": _flag(), "norm_topk_prob": _flag(),
    "num_experts": _at_least(0), "num_experts_per_tok": _at_least(0), "moe_intermediate_size": _at_least(0),
    "decoder_sparse_step": _at_least(1),
    "eos_token_id": ((lambda value: isinstance(value, list)), "must be a token id or a list of them"),
    "mlp_only_layers": ((lambda value: isinstance(value, list)), "must be a list of layer indices"),
}
# ModelSpec field -> the GGUF metadata key it is read from (after the architecture's prefix)
GGUF_KEYS = {
    "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length", "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base", "max_position_embeddings": "context_length", "vocab_size": "vocab_size",
    "num_experts": "expert_count", "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length", "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
}
