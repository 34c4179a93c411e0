"""Llama (SmolLM2, Llama 2/3): the base decoder that Qwen3 and Qwen3-MoE extend.

A family reads its checkpoint into the weights of kernels/layer.py's `layer`, where the layer is
defined once for every family (a family's extra blocks are weights there: Qwen3's q/k norms, the
routed experts), and computes the logits.

Shapes (h hidden, H query heads, G kv heads, d head_dim, I intermediate):
  qkv_proj               [(H+2G)*d, h]  storage format; q, k and v fused at load
  gate_up_proj           [2*I, h]     storage format; gate and up fused at load
A weight in a block format (ellmd.kernels.quant) is [rows, h / block size] of its block dtype;
a fusion of tensors of different formats is the tuple of its parts (kernels.matmul takes both).
On the int16 path, Q8_0 matrices are repacked at load to tiles of 16 rows (kernels.lanes: the same
bytes, the 16 rows' outputs in a vector's lanes), which decode and prefill share.
"""

from __future__ import annotations

import numpy as np

from ellmd import kernels
from ellmd.kernels import aligned, bf16, formats, lanes, quant
from ellmd.kernels.formats import kernel_view
from ellmd.model.registry import Family, register
from ellmd.model.spec import ModelSpec
from ellmd.model.weights import quantize_weight


class TensorSource:
    """Checkpoint tensors by Hugging Face name, in the engine's weight format unless told otherwise.

    blocks: None (every tensor in fmt), "keep" (GGUF block tensors stay in their blocks), or a
    block type such as "Q4_K" (blocks stay, float weight matrices are quantized to it at load).
    An explicit fmt (norms, routers: F32) always gets floats.
    """

    def __init__(self, checkpoint, fmt: int, blocks: str | None = None):
        self.checkpoint, self.fmt, self.blocks = checkpoint, fmt, blocks
        self.names = set(checkpoint.names())

    def __call__(self, name: str, fmt: int | None = None) -> np.ndarray:
        if fmt is not None or self.blocks is None:
            return self.checkpoint.get(name, self.fmt if fmt is None else fmt)
        array = self.checkpoint.get(name, self.fmt, keep_blocks=True)
        if self.blocks != "keep" and not quant.is_blocks(array) and array.ndim >= 2:
            array = quantize_weight(array, self.fmt, self.blocks)
        return array

    def __contains__(self, name: str) -> bool:
        return name in self.names


def fuse(parts: list, axis: int = 0):
    """Concatenate weights along their rows when they share a format, else keep the tuple of them."""
    if len({p.dtype for p in parts}) == 1:
        return np.concatenate(parts, axis=axis)
    if axis != 0:
        raise ValueError("weights of different formats fuse only along their first axis")
    return tuple(np.ascontiguousarray(p) for p in parts)


def logical_shape(w) -> tuple:
    """Shape of a weight in values ([rows, k]), whatever its format or fusion."""
    if isinstance(w, tuple):
        shapes = [logical_shape(p) for p in w]
        return (sum(s[0] for s in shapes), *shapes[0][1:])
    if lanes.is_tiles(w):
        return (lanes.rows(w), lanes.columns(w))
    if bf16.is_packed(w):
        return (bf16.TILE * w.shape[0], bf16.CHUNK * w.shape[1])
    return (*w.shape[:-1], quant.columns(w)) if w.ndim >= 2 else w.shape


def repacked(w, fmt: int):
    """A weight (or each part of a fusion) as lanes' tiles where lanes.wanted, as AMX's packed tiles
    where bf16.packs, else as it is; tiles and float matrices (bf16, f16, f32) start a cache line
    (aligned.py: the kernels' loads)."""
    if isinstance(w, tuple):
        return tuple(repacked(p, fmt) for p in w)
    if lanes.wanted(w):
        return aligned.on_line(lanes.repack(w))
    if bf16.packs(w, fmt):
        return bf16.pack(w)
    return aligned.on_line(w) if w.ndim == 2 and w.dtype in (np.uint16, np.float32) else w


class Llama:
    """Weights in engine layout, as kernels.layer's layer takes them, and the logits."""

    def __init__(self, spec: ModelSpec, weights: dict, fmt: int):
        self.spec = spec
        self.fmt = fmt
        self.embed_tokens = weights["embed_tokens"]
        self.norm = weights["norm"]
        # embed reads a tied table as it is (a row a token); the logits take it as tiles where lanes
        # want it (their copy; a GGUF's table is then a file mapping only embed's rows touch): on
        # the row kernel, Qwen3-1.7B's Q6_K head was a fifth of a decode step (Zen 1)
        head = weights["lm_head"]
        tied = head is weights["embed_tokens"]
        self.lm_head = repacked(head, fmt) if not tied or lanes.wanted(head) else head
        self.layers = [{name: repacked(w, fmt) for name, w in layer.items()} for layer in weights["layers"]]
        self.scale = float(spec.head_dim) ** -0.5

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def sanitize(cls, checkpoint, spec: ModelSpec, fmt: int, progress=None, blocks: str | None = None) -> dict:
        """Read a checkpoint's tensors and fuse them into engine layout (blocks: see TensorSource)."""

        get = TensorSource(checkpoint, fmt, blocks)
        embed = get("model.embed_tokens.weight")
        weights = {
            "embed_tokens": embed,
            "norm": get("model.norm.weight", formats.F32),
            "lm_head": embed if spec.tie_word_embeddings else get("lm_head.weight"),
            "layers": [],
        }
        for i in range(spec.num_hidden_layers):
            weights["layers"].append(cls.sanitize_layer(get, spec, f"model.layers.{i}", i))
            if progress:
                progress(i + 1, spec.num_hidden_layers)
        cls.check_shapes(weights, spec)
        return weights

    @classmethod
    def sanitize_layer(cls, get, spec: ModelSpec, prefix: str, index: int) -> dict:
        attn = f"{prefix}.self_attn"
        layer = {
            "input_layernorm": get(f"{prefix}.input_layernorm.weight", formats.F32),
            "post_attention_layernorm": get(f"{prefix}.post_attention_layernorm.weight", formats.F32),
            "qkv_proj": fuse([get(f"{attn}.{p}_proj.weight") for p in "qkv"]),
            "o_proj": np.ascontiguousarray(get(f"{attn}.o_proj.weight")),
        }
        if spec.attention_bias:
            layer["qkv_bias"] = np.concatenate([get(f"{attn}.{p}_proj.bias", formats.F32) for p in "qkv"])
        layer.update(cls.sanitize_mlp(get, spec, prefix, index))
        return layer

    @classmethod
    def sanitize_mlp(cls, get, spec: ModelSpec, prefix: str, index: int) -> dict:
        mlp = f"{prefix}.mlp"
        return {
            "gate_up_proj": fuse([get(f"{mlp}.gate_proj.weight"), get(f"{mlp}.up_proj.weight")]),
            "down_proj": np.ascontiguousarray(get(f"{mlp}.down_proj.weight")),
        }

    @staticmethod
    def check_shapes(weights: dict, spec: ModelSpec) -> None:
        from ellmd.errors import ModelError

        H, G, d, h = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, spec.hidden_size
        expected = {
            "embed_tokens": (spec.vocab_size, h),
            "lm_head": (spec.vocab_size, h),
            "norm": (h,),
        }
        for name, shape in expected.items():
            if logical_shape(weights[name]) != shape:
                raise ModelError(f"tensor {name} has shape {logical_shape(weights[name])}, the config implies {shape}")
        layer_expected = {"qkv_proj": ((H + 2 * G) * d, h), "o_proj": (h, H * d), "input_layernorm": (h,)}
        for i, layer in enumerate(weights["layers"]):
            for name, shape in layer_expected.items():
                if logical_shape(layer[name]) != shape:
                    raise ModelError(
                        f"layer {i} tensor {name} has shape {logical_shape(layer[name])}, the config implies {shape}"
                    )

    # ---- the layer (kernels.layer) ----------------------------------------------------------

    def layer_weights(self, index: int) -> tuple:
        """Layer `index` as kernels.layer's `layer` takes it: (attention weights, MLP weights).

        Weights in kernel views (f16 as int16), every matrix as a tuple of its parts; a norm or
        bias the family lacks is an empty array.
        """
        layer = self.layers[index]
        none = np.zeros(0, np.float32)
        attention = (
            index, layer["input_layernorm"], self.parts(layer["qkv_proj"]), layer.get("qkv_bias", none),
            layer.get("q_norm", none), layer.get("k_norm", none), self.parts(layer["o_proj"]),
            layer["post_attention_layernorm"],
        )
        return attention, self.mlp_weights(layer)

    def mlp_weights(self, layer) -> tuple:
        """A layer's MLP weights for kernels.layer.feed_forward: (gate_up parts, down parts)."""
        return self.parts(layer["gate_up_proj"]), self.parts(layer["down_proj"])

    def parts(self, w) -> tuple:
        """A weight as the tuple of its parts in kernel views."""
        return tuple(kernel_view(p, self.fmt) for p in (w if isinstance(w, tuple) else (w,)))

    def logits(self, ws, rows: np.ndarray, out: np.ndarray) -> None:
        """Final norm and lm_head for the residual rows that need logits."""
        count = len(rows)
        hidden = ws.h[:count]
        np.take(ws.x, rows, axis=0, out=ws.rows_x[:count], mode="clip")  # "raise" would buffer a copy
        kernels.rmsnorm(ws.rows_x[:count], self.norm, self.spec.rms_norm_eps, hidden)
        kernels.matmul(hidden, self.lm_head, self.fmt, out, ws.matmul_scratch)


def layer_shapes(spec: ModelSpec, index: int) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names (under model.layers.N) and shapes of a Llama layer."""
    h, d, I = spec.hidden_size, spec.head_dim, spec.intermediate_size
    H, G = spec.num_attention_heads, spec.num_key_value_heads
    return {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (H * d, h), "self_attn.k_proj.weight": (G * d, h),
        "self_attn.v_proj.weight": (G * d, h), "self_attn.o_proj.weight": (h, H * d),
        "mlp.gate_proj.weight": (I, h), "mlp.up_proj.weight": (I, h), "mlp.down_proj.weight": (h, I),
    }


FAMILY = register(Family(
    model_type="llama", gguf_architecture="llama", model=Llama, layer_shapes=layer_shapes, gguf_permuted_qk=True,
    honours=("attention_bias", "tie_word_embeddings", "rope_scaling", "head_dim"),
    refuses={"mlp_bias": False, "hidden_act": "silu"},
))
