"""--weight-dtype q8_0|q4_0|q4_k: a float checkpoint quantized at load vs transformers fp32 on
the same blocks dequantized (by the gguf package), f32 KV.

The reference checkpoint is a copy of the tiny one whose weight matrices are replaced by
dequantize(quantize_weight(w)): the very blocks the engine holds (it quantizes with the same
function, and the check asserts that its fused blocks are these). Widths that 256 does not
divide take Q5_0 under q4_k, as llama-quantize does. Compared: the logits of a prefill over
random tokens and of decode steps after it, within the bf16 tolerance of the suite with the
portable kernels and the int16 path (the default where the CPU has AVX512-VNNI or AVX2);
--kernels vnni (int8 activations, see quantized.py) within VNNI_TOL.

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

import shutil
from pathlib import Path

import numpy as np

TOL = 2e-2  # the alignment suite's bound for bf16 weights
VNNI_TOL = 1e-1  # int8 activations: measured up to 3.4e-2 on these checkpoints
DTYPES = ("q8_0", "q4_0", "q4_k")


def dequantized_copy(src: Path, dst: Path, dtype: str) -> Path:
    """A copy of checkpoint src whose weight matrices went through quantize_weight (f32 files)."""
    from safetensors.numpy import save_file

    from ellmd.engine.engine import BLOCK_WEIGHT_DTYPES
    from ellmd.kernels import formats, quant
    from ellmd.model.weights import SafetensorsCheckpoint, quantize_weight

    checkpoint = SafetensorsCheckpoint(src)
    native = checkpoint.native_format()
    tensors = {}
    for name in checkpoint.names():
        array = checkpoint.get(name, native)
        if array.ndim >= 2:
            array = quantize_weight(array, native, BLOCK_WEIGHT_DTYPES[dtype])
        tensors[name] = formats.to_f32(array, native) if not quant.is_blocks(array) else quant.dequantize(array)
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():  # config, tokenizer, generation config: the weights are rewritten
        if file.is_file() and not file.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(file, dst / file.name)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def check(report, directory: Path, variant: str, dtype: str, tol: float) -> None:
    from safetensors.numpy import load_file

    from ellmd.kernels import lanes, quant

    tag = f"{variant} {dtype}"
    engine = common.make_engine(directory, weight_dtype=dtype, kv_dtype="f32", sequence_length=64, reuse=False)
    copy = dequantized_copy(directory, common._temporary_root() / f"{variant}-{dtype}-dequantized", dtype)
    q = engine.model.layers[0]["qkv_proj"]
    q = q[0] if isinstance(q, tuple) else q
    H, d = engine.spec.num_attention_heads, engine.spec.head_dim
    want = load_file(str(copy / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    name, values = (f"{lanes.block_name(q)} tiles", lanes.dequantize_ref(q)) if lanes.is_tiles(q) else (quant.block_name(q), quant.dequantize(q))
    report.compare(f"{tag}: engine's q blocks are the reference's ({name})", values[: H * d], want, tol=0)
    reference = common.reference_model(copy)
    tokens = common.random_tokens(12, seed=5, vocab=engine.spec.vocab_size)
    prompt, steps = tokens[:9], tokens[9:]
    ours = [engine.prefill(0, prompt, logits="all")]
    for token in steps:
        ours.append(engine.decode([0], [token]).copy())
    ours = np.concatenate(ours)  # [12, V]
    ref = common.reference_logits(reference, tokens)
    report.compare(f"{tag}: prefill logits", ours[: len(prompt)], ref[: len(prompt)], tol=tol)
    report.compare(f"{tag}: decode logits", ours[len(prompt) :], ref[len(prompt) :], tol=tol)


def main(argv=None) -> int:
    p = common.parser(__doc__.splitlines()[0], default_variants=["llama", "qwen3-yarn-bf16"])
    p.add_argument("--dtype", action="append", choices=DTYPES, help="default: all")
    p.add_argument("--kernels", choices=common.KERNEL_CHOICES, default="default", help=common.KERNEL_HELP)
    args = p.parse_args(argv)
    common.torch_setup()

    with common.kernel_paths(args.kernels):
        report = common.Report(f"float checkpoints quantized at load ({args.kernels} kernels) vs transformers on the dequantized blocks")
        for variant in common.selected_variants(args):
            directory = common.checkpoint(args, variant)
            for dtype in args.dtype or DTYPES:
                check(report, directory, variant, dtype, VNNI_TOL if common.int8_activations() else TOL)
    return report.exit_code()


if __name__ == "__main__":
    common.run(main)
