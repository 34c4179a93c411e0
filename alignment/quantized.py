"""SmolLM2-135M-Instruct with its weights kept in GGUF blocks: ellm reading the blocks vs
transformers fp32 on the same blocks dequantized (by the gguf package), f32 KV.

Two files: the built-in GGUF (Q4_1 layers, a Q8_0 embedding), and a rewrite of it whose
tensors mix every block type the gguf package can write, several in one layer as
llama-quantize's Q4_K_M mixes them (so q, k and v cannot be fused into one matrix):
  attn_q Q5_0, attn_k Q5_1, attn_v Q8_0, attn_output Q4_0, ffn_gate Q4_1, ffn_up Q5_0,
  ffn_down Q4_K, token_embd Q8_0 (Q5_K and Q6_K blocks are checked kernel by kernel in tests).
The prompts: the first SmolLM2 prompts (--prompts) and a passage long enough (LONG_PROMPT, ~170
tokens) that its chunks of 64 go through the prefill GEMM (on AMX where the CPU has it) rather
than the decode kernels. For each prompt: prompt and decode logits within the bf16 tolerance of the alignment suite, and
the greedy continuation token for token, with the default kernels (the int16 path where the CPU
has AVX512-VNNI or AVX2: activations quantized to int16, one scale per 256 values where 256
divides the width, else per 32) or --kernels portable (f32 FMA).

--kernels vnni checks the int8 path instead (activations quantized to int8 per 32 values, as
llama.cpp's q8 x q8): an approximation by design (~1% of each product), so its bound is VNNI_TOL,
and greedy tokens may part from the reference only where its top-2 logit margin is below VNNI_MARGIN.

Shapes: logits [n, V].
"""

from __future__ import annotations

try:
    from alignment import common
except ImportError:
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from alignment import common

from pathlib import Path

import numpy as np

from alignment.smollm2_greedy import PROMPTS, Recorder, _diverge

NEW_TOKENS = 24
TOL = 2e-2  # the alignment suite's bound for bf16 weights (kv_dtype_report, multi_token)
VNNI_TOL = 1e-1  # measured 5.5e-2 on the built-in model (int8 activations in all 30 layers)
# a near-tie: int8 activations move decode logits by 1.2-2.1 (max abs), and the exact values depend
# on the summation order (the thread count splits attention), so flips were seen at margins 0.08 and 0.63
VNNI_MARGIN = 1.0
LONG_PROMPT = [{"role": "user", "content": (
    "Read this and summarize it in one sentence. The lighthouse stood on a rock at the mouth of the bay, "
    "and for a hundred years its keepers climbed the spiral stairs every evening to light the lamp. They "
    "trimmed the wicks, polished the lenses and wound the clockwork that turned the light, so that ships "
    "coming in from the open sea could find the narrow channel between the reefs. In winter the storms "
    "threw spray over the gallery and the keepers wrote in their logbooks by candlelight, counting the "
    "ships that passed and the hours of fog. When electricity came to the coast the lamp was replaced by "
    "a bulb on a timer, and the last keeper rowed ashore with his logbooks under his arm.")}]
MIX = {
    "attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "Q8_0", "attn_output": "Q4_0",
    "ffn_gate": "Q4_1", "ffn_up": "Q5_0", "ffn_down": "Q4_K", "token_embd": "Q8_0",
}


def requantize_gguf(src: Path, dst: Path, mix: dict[str, str]) -> Path:
    """Rewrite a GGUF with each tensor whose role (blk.N.<role>.weight) is in mix quantized to it.

    Values come from the source's blocks dequantized; metadata and tensor order are kept.
    """
    import gguf

    from ellmd.kernels import quant

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        role = tensor.name.split(".")[-2]
        shape = [int(d) for d in reversed(tensor.shape)]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if role in mix:
            blocks = quant.quantize(values, mix[role])
            raw = blocks.view(np.uint8).reshape(shape[0], -1)
            writer.add_tensor(tensor.name, raw, raw_dtype=gguf.GGMLQuantizationType[mix[role]])
        else:
            writer.add_tensor(tensor.name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def check_file(report, path: Path, prompts: int, kernels: str) -> None:
    from ellmd.engine import SamplingParams
    from ellmd.kernels import lanes, quant

    reference = common.reference_model(path)
    tokenizer = common.reference_tokenizer(path)
    engine = common.make_engine(path, weight_dtype=None, kv_dtype="f32", sequence_length=256, chunk_size=64)
    formats = engine.weight_formats
    qkv = engine.model.layers[0]["qkv_proj"]
    parts = qkv if isinstance(qkv, tuple) else (qkv,)
    kept = all(quant.is_blocks(p) or lanes.is_tiles(p) for p in parts)  # tiles on the int16 path (lanes.py)
    report.check(f"{path.name}: weights kept in blocks", kept, f"{formats}; q, k, v in {len(parts)} matrices")
    eos = sorted(set(engine.spec.eos_token_id))
    for index, messages in enumerate(PROMPTS[:prompts] + [LONG_PROMPT]):
        tag = f"{path.stem} {kernels} prompt {index}"
        ids = common.chat_ids(tokenizer, messages, add_generation_prompt=True)
        ref_tokens = common.reference_greedy(reference, ids, NEW_TOKENS, eos_token_id=eos)
        engine.rewind(0, 0)
        with Recorder(engine) as recorder:
            tokens = list(engine.generate(0, ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)))
        logits = np.concatenate(recorder.logits)  # [P + N - 1, V]
        ref_logits = common.reference_logits(reference, ids + tokens[:-1])
        int8 = common.int8_activations()
        tol = VNNI_TOL if int8 else TOL
        report.compare(f"{tag}: prompt logits", logits[: len(ids)], ref_logits[: len(ids)], tol=tol)
        report.compare(f"{tag}: decode logits", logits[len(ids) :], ref_logits[len(ids) :], tol=tol)
        same = tokens == ref_tokens or (int8 and _margin(tokens, ref_tokens, ref_logits, len(ids)) < VNNI_MARGIN)
        report.check(f"{tag}: greedy tokens", same, _diverge(tokens, ref_tokens, ref_logits, len(ids)))


def _margin(ours, ref, ref_logits, prompt_len) -> float:
    """The reference's top-2 logit margin where the greedy tokens first differ."""
    at = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    row = prompt_len - 1 + at
    if row >= len(ref_logits):
        return float("inf")
    top = np.sort(ref_logits[row])[-2:]
    return float(top[1] - top[0])


def main(argv=None) -> int:
    p = common.parser(__doc__.splitlines()[0], variants=False)
    p.add_argument("--prompts", type=int, default=3, help="how many of the SmolLM2 prompts to run")
    p.add_argument("--kernels", choices=common.KERNEL_CHOICES, default="default", help=common.KERNEL_HELP)
    p.add_argument("--builtin-only", action="store_true", help="skip the file of mixed block types")
    args = p.parse_args(argv)
    common.torch_setup()
    from ellmd.engine import builtin_model_path

    with common.kernel_paths(args.kernels):
        report = common.Report(f"SmolLM2 with weights in GGUF blocks ({args.kernels} kernels) vs transformers on the dequantized blocks")
        paths = [builtin_model_path()]
        if not args.builtin_only:
            paths.append(requantize_gguf(paths[0], common._temporary_root() / "smollm2-mixed-blocks.gguf", MIX))
        for path in paths:
            check_file(report, path, args.prompts, args.kernels)
    return report.exit_code()


if __name__ == "__main__":
    common.run(main)
