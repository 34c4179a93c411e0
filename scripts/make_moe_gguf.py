"""Write a synthetic Qwen3-MoE GGUF at real width: random weights, the real Qwen3 tokenizer.

The shapes come from a config.json (default: Qwen3-Coder-30B-A3B-Instruct's, 48 layers of 128
experts, 8 active), all layers or the first --layers. Matrices are drawn at random (normal, std
fan_in**-0.5, as ellm's RandomCheckpoint) one slice of experts at a time and written as Q8_0
blocks by the gguf package's quantizer (norms and the router stay F32), so neither memory nor disk
ever holds an F16 copy (61 GB for 48 layers). Then `llama-quantize --allow-requantize` turns the
Q8_0 file into Q4_K_M (llama.cpp's mix: Q4_K, Q6_K for some tensors). The tokenizer (tokens,
merges, special ids, chat template) is the one in --tokenizer, so prompts tokenize as Qwen3's.

Files go to a cache folder and are reused: nothing is written when they exist. Sizes (48 layers):
Q8_0 ~32 GB, Q4_K_M ~18 GB, and ~15-30 minutes each on 2 cores. Benchmarks only, never tests.

    .venv/bin/python scripts/make_moe_gguf.py --layers 2           # a quick check (~2.5 GB)
    .venv/bin/python scripts/make_moe_gguf.py                       # all 48 layers, Q8_0 and Q4_K_M
    .venv/bin/python scripts/bench_compare.py --model-as-is "$(.venv/bin/python scripts/make_moe_gguf.py --print Q4_K_M)"

Shape legend (numpy order; GGUF lists dimensions the other way): h hidden, d head_dim, H query heads,
G kv heads, E experts, I moe_intermediate_size, V vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_native  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
DEFAULT_CONFIG = FIXTURES / "configs" / "qwen3-coder-30b-a3b-instruct.json"
DEFAULT_TOKENIZER = FIXTURES / "qwen3-tokenizer"
EXPERT_SLICE = 8  # experts drawn and quantized at a time (~150 MB of float32 at real width)
FILE_TYPE_MOSTLY_Q8_0 = 7  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q8_0


def cache_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "ellm" / "moe-gguf"


def tensor_plan(config: dict, layers: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(GGUF name, numpy shape, quantized) of every tensor, in file order."""
    h, V, d = config["hidden_size"], config["vocab_size"], config["head_dim"]
    H, G = config["num_attention_heads"], config["num_key_value_heads"]
    E, I = config["num_experts"], config["moe_intermediate_size"]
    plan = [("token_embd.weight", (V, h), True), ("output_norm.weight", (h,), False), ("output.weight", (V, h), True)]
    for i in range(layers):
        b = f"blk.{i}"
        plan += [
            (f"{b}.attn_norm.weight", (h,), False),
            (f"{b}.attn_q.weight", (H * d, h), True),
            (f"{b}.attn_k.weight", (G * d, h), True),
            (f"{b}.attn_v.weight", (G * d, h), True),
            (f"{b}.attn_output.weight", (h, H * d), True),
            (f"{b}.attn_q_norm.weight", (d,), False),
            (f"{b}.attn_k_norm.weight", (d,), False),
            (f"{b}.ffn_norm.weight", (h,), False),
            (f"{b}.ffn_gate_inp.weight", (E, h), False),  # the router stays F32, as convert_hf_to_gguf keeps it
            (f"{b}.ffn_gate_exps.weight", (E, I, h), True),
            (f"{b}.ffn_up_exps.weight", (E, I, h), True),
            (f"{b}.ffn_down_exps.weight", (E, h, I), True),
        ]
    return plan


def add_metadata(writer, config: dict, layers: int, tokenizer: Path) -> None:
    """Model hyperparameters (llama.cpp's qwen3moe keys) and the tokenizer."""
    writer.add_name("ellm-random-qwen3moe")
    writer.add_file_type(FILE_TYPE_MOSTLY_Q8_0)
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(float(config["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    add_tokenizer(writer, tokenizer, config["vocab_size"])


def add_tokenizer(writer, directory: Path, vocab_size: int) -> None:
    """A Hugging Face byte-level BPE tokenizer as GGUF metadata (convert_hf_to_gguf's rules for Qwen2/3)."""
    import gguf

    data = json.loads((directory / "tokenizer.json").read_text())
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]  # ids the vocabulary leaves unused
    types = [gguf.TokenType.USER_DEFINED] * vocab_size
    for token, index in data["model"]["vocab"].items():
        tokens[index], types[index] = token, gguf.TokenType.NORMAL
    for added in data["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    ids = {t["content"]: t["id"] for t in data["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]])
    writer.add_bos_token_id(ids["<|endoftext|>"])
    writer.add_eos_token_id(ids[settings["eos_token"]])
    writer.add_pad_token_id(ids[settings["pad_token"]])
    writer.add_add_bos_token(bool(settings.get("add_bos_token", False)))
    template = directory / "chat_template.jinja"
    writer.add_chat_template(template.read_text() if template.exists() else settings["chat_template"])


def slices(name: str, shape: tuple[int, ...], quantized: bool, rng: np.random.Generator):
    """The tensor's data in file order, a few experts (or rows) at a time: Q8_0 bytes or F32."""
    import gguf

    if not quantized:
        if len(shape) == 1:  # norm weights: near 1, as trained models have them
            yield (1.0 + 0.1 * rng.standard_normal(shape, np.float32)).astype(np.float32)
        else:
            yield (rng.standard_normal(shape, np.float32) * np.float32(shape[-1] ** -0.5))
        return
    rows = shape[0] if len(shape) == 3 else max(1, shape[0] // 16)
    step = EXPERT_SLICE if len(shape) == 3 else rows
    for start in range(0, shape[0], step):
        part = (min(step, shape[0] - start), *shape[1:])
        values = rng.standard_normal(part, np.float32) * np.float32(shape[-1] ** -0.5)
        yield gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)


def write_q8_0(dst: Path, config: dict, layers: int, tokenizer: Path, seed: int, log=print) -> Path:
    """Write the Q8_0 GGUF tensor by tensor, slice by slice (memory stays near one slice)."""
    import gguf

    writer = gguf.GGUFWriter(None, "qwen3moe")
    add_metadata(writer, config, layers, tokenizer)
    plan = tensor_plan(config, layers)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, shape, quantized in plan:
        if quantized:
            byte_shape = (*shape[:-1], shape[-1] // 32 * 34)  # 32 weights -> 34 bytes (f16 scale + 32 int8)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=q8)
        else:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    tmp = dst.with_name(dst.name + ".part")  # a crash never leaves a half-written file under the real name
    writer.write_header_to_file(tmp)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    rng = np.random.default_rng(seed)
    start = time.monotonic()
    for index, (name, shape, quantized) in enumerate(plan):
        writer.write_padding(fout, fout.tell())
        nbytes = 0
        for part in slices(name, shape, quantized, rng):
            part.tofile(fout)
            nbytes += part.nbytes
        writer.write_padding(fout, nbytes)
        if name.endswith("ffn_down_exps.weight"):
            log(f"  layer {name.split('.')[1]} written ({time.monotonic() - start:.0f} s)")
    writer.close()
    tmp.replace(dst)
    return dst


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a Qwen3-MoE config.json [default: %(default)s]")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER,
                        help="folder with tokenizer.json, tokenizer_config.json [default: %(default)s]")
    parser.add_argument("--layers", type=int, help="the first N layers only [default: all]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights [default: 0]")
    parser.add_argument("--out-dir", type=Path, default=cache_dir(), help="cache folder [default: %(default)s]")
    parser.add_argument("--formats", default="Q8_0,Q4_K_M", help="files to make: Q8_0 and/or Q4_K_M [default: Q8_0,Q4_K_M]")
    parser.add_argument("--llama-native", type=Path, default=llama_native.native_root(),
                        help="native llama.cpp build for llama-quantize [default: $LLAMA_NATIVE or ~/.cache/ellm/llama-native]")
    parser.add_argument("--print", metavar="FORMAT", help="print the path of that format's file and exit")
    args = parser.parse_args(argv)
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for fmt in args.formats + ([args.print] if args.print else []):
        if fmt not in ("Q8_0", "Q4_K_M"):
            parser.error(f"unknown format {fmt!r} (Q8_0 or Q4_K_M)")
    for path in (args.config, args.tokenizer / "tokenizer.json"):
        if not path.exists():
            parser.error(f"no such file {path}")
    return args


def output_path(args, config: dict, fmt: str) -> Path:
    layers = args.layers or config["num_hidden_layers"]
    return args.out_dir / f"{args.config.stem}-L{layers}-seed{args.seed}.{fmt}.gguf"


def main(argv=None) -> int:
    args = parse_args(argv)
    config = json.loads(args.config.read_text())
    if config.get("model_type") != "qwen3_moe":
        print(f"{args.config}: model_type {config.get('model_type')!r} is not qwen3_moe", file=sys.stderr)
        return 2
    layers = min(args.layers or config["num_hidden_layers"], config["num_hidden_layers"])
    if args.print:
        print(output_path(args, config, args.print))
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    q8 = output_path(args, config, "Q8_0")
    if not q8.exists():
        print(f"writing {q8} ({layers} layers, Q8_0)", file=sys.stderr)
        write_q8_0(q8, config, layers, args.tokenizer, args.seed, log=lambda m: print(m, file=sys.stderr))
    if "Q4_K_M" in args.formats:
        q4 = output_path(args, config, "Q4_K_M")
        if not q4.exists():
            if not llama_native.is_built(args.llama_native):
                print(f"no llama-quantize in {args.llama_native}/bin: build it with scripts/llama_native.py", file=sys.stderr)
                return 2
            print(f"writing {q4} (llama-quantize --allow-requantize Q4_K_M)", file=sys.stderr)
            llama_native.quantize(args.llama_native, q8, q4, "Q4_K_M", allow_requantize=True)
        if "Q8_0" not in args.formats:
            q8.unlink()
    for fmt in args.formats:
        print(output_path(args, config, fmt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
