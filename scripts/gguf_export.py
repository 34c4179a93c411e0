"""Write F16 GGUF files for llama.cpp from the weights ellm benchmarks, so both read the same numbers.

Two sources:
  export_gguf_as_f16    an existing GGUF (e.g. the built-in Q4_1 SmolLM2): every tensor dequantized
                        and rewritten as F16 (1-D norms stay F32), all metadata copied; llama.cpp's
                        own tensor layout is kept (its q/k row permutation stays, it is still a GGUF)
  export_random_gguf    an ellm RandomCheckpoint (random weights at a config's shapes): llama.cpp
                        tensor names, F16, and a vocabulary of type "none" (ids only, no tokenizer)

Both write tensor by tensor (the writer spools to a temporary file), so memory stays near one tensor.

Shape legend (numpy order, outermost first; GGUF stores the reverse):
  h hidden, d head_dim, H query heads, G kv heads, I intermediate, E experts, V vocab
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import numpy as np

# gguf value of general.file_type for "mostly F16" (llama.cpp's LLAMA_FTYPE_MOSTLY_F16)
FILE_TYPE_MOSTLY_F16 = 1

# Hugging Face -> llama.cpp tensor names (the inverse of ellm's GGUF reader tables)
HF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
HF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
}
# ellm model_type -> GGUF general.architecture
GGUF_ARCH = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}

Tensor = tuple[str, Callable[[], np.ndarray]]  # name, and a loader so only one tensor is in memory


def export_gguf_as_f16(src: Path, dst: Path, layers: int | None = None) -> Path:
    """Rewrite a GGUF with every tensor dequantized to F16 (norms F32), keeping its metadata and layout."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    blocks = int(reader.fields[f"{arch}.block_count"].contents())
    keep = min(layers or blocks, blocks)
    writer = gguf.GGUFWriter(dst, arch, use_temp_file=True)
    for key, field in reader.fields.items():
        # the writer adds the architecture itself; GGUF.* are the header, not metadata
        if key.startswith("GGUF.") or key in (
            "general.architecture", "general.file_type", "general.quantization_version", f"{arch}.block_count"
        ):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    writer.add_uint32(f"{arch}.block_count", keep)
    writer.add_file_type(FILE_TYPE_MOSTLY_F16)

    def loader(tensor):
        def load():
            shape = [int(d) for d in reversed(tensor.shape)]  # GGUF lists dimensions innermost first
            kind = tensor.tensor_type
            if kind == gguf.GGMLQuantizationType.F32:
                array = np.asarray(tensor.data, np.float32)
            elif kind == gguf.GGMLQuantizationType.F16:
                array = np.asarray(tensor.data).view(np.float16)
            else:
                array = gguf.quants.dequantize(tensor.data, kind)
            return array.reshape(shape)
        return load

    tensors = [
        (t.name, loader(t)) for t in reader.tensors
        if not (t.name.startswith("blk.") and int(t.name.split(".")[1]) >= keep)
    ]
    _write_tensors(writer, tensors, dst)
    return dst


def export_random_gguf(checkpoint, dst: Path) -> Path:
    """Write an ellm RandomCheckpoint as an F16 GGUF that llama.cpp loads (token ids only, no tokenizer)."""
    import gguf
    from ellmd.kernels import formats

    spec = checkpoint.spec
    arch = GGUF_ARCH[spec.model_type]
    writer = gguf.GGUFWriter(dst, arch, use_temp_file=True)
    writer.add_name(f"ellm-random-{spec.model_type}")
    writer.add_block_count(spec.num_hidden_layers)
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_attention_heads)
    writer.add_head_count_kv(spec.num_key_value_heads)
    writer.add_key_length(spec.head_dim)  # Qwen3's head_dim is not hidden / heads
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_vocab_size(spec.vocab_size)
    writer.add_file_type(FILE_TYPE_MOSTLY_F16)
    if spec.rope_scaling:
        scaling = spec.rope_scaling
        writer.add_rope_scaling_type(scaling.get("rope_type") or scaling.get("type"))
        writer.add_rope_scaling_factor(float(scaling.get("factor", 1.0)))
        if scaling.get("original_max_position_embeddings"):
            writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    if spec.model_type == "qwen3_moe":
        writer.add_expert_count(spec.num_experts)
        writer.add_expert_used_count(spec.num_experts_per_tok)
        writer.add_expert_feed_forward_length(spec.moe_intermediate_size)
    # llama.cpp's vocabulary type "none": n_vocab comes from {arch}.vocab_size, ids are fed directly
    writer.add_tokenizer_model("none")

    def hf(name: str, fmt: int) -> Callable[[], np.ndarray]:
        def load():
            array = checkpoint.get(name, fmt)
            if fmt != formats.F32:
                array = array.view(np.float16)
            if spec.model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = spec.num_attention_heads if "q_proj" in name else spec.num_key_value_heads
                array = _permute_rope_rows(array, heads)
            return array
        return load

    def experts(prefix: str, part: str) -> Callable[[], np.ndarray]:
        def load():  # [E, I, h] or [E, h, I]: one 3-D tensor per projection, as llama.cpp wants
            return np.stack([
                checkpoint.get(f"{prefix}.mlp.experts.{e}.{part}.weight", formats.F16).view(np.float16)
                for e in range(spec.num_experts)
            ])
        return load

    tensors: list[Tensor] = []
    names = set(checkpoint.names())
    for name, gguf_name in HF_GLOBAL_NAMES.items():
        if name in names:
            tensors.append((gguf_name, hf(name, formats.F32 if name == "model.norm.weight" else formats.F16)))
    for i in range(spec.num_hidden_layers):
        prefix = f"model.layers.{i}"
        for part, gguf_part in HF_LAYER_NAMES.items():
            name = f"{prefix}.{part}.weight"
            if name in names:
                one_d = "norm" in part or part == "mlp.gate"  # norms and the router stay F32
                tensors.append((f"blk.{i}.{gguf_part}.weight", hf(name, formats.F32 if one_d else formats.F16)))
        if spec.is_moe_layer(i):
            for part in ("gate_proj", "up_proj", "down_proj"):
                gguf_part = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}[part]
                tensors.append((f"blk.{i}.{gguf_part}.weight", experts(prefix, part)))
    _write_tensors(writer, tensors, dst)
    return dst


def _write_tensors(writer, tensors: list[Tensor], dst: Path) -> None:
    """Write header, metadata and tensors; the writer spools tensor data to a temporary file as it goes."""
    for name, load in tensors:
        array = load()
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=_gguf_dtype(name, array)))
    tmp = dst.with_name(dst.name + ".part")  # a crash never leaves a half-written file under the real name
    writer.write_header_to_file(tmp)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)


def _gguf_dtype(name: str, array: np.ndarray) -> np.dtype:
    """F32 for 1-D tensors (norms) and the MoE router, F16 for every other weight matrix."""
    return np.dtype(np.float32) if array.ndim == 1 or name.endswith("ffn_gate_inp.weight") else np.dtype(np.float16)


def _permute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the llama architecture (convert_hf_to_gguf's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
