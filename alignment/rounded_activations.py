"""Rounded activations: the "bf16-round" path (bf16 products of activations rounded once to bf16,
the default) vs transformers fp32, within the error of transformers' own bf16 forward on the same weights.

bf16 checkpoints, native bf16 weights, f32 KV: a prefill of matmul.PREFILL_MIN_ROWS tokens (64; logits
at every position) in one chunk (the prefill GEMM), then 8 decode steps, as multi_token does. The two-halves
paths meet multi_token's 1e-3 of the largest logit; one bf16 value per activation cannot (bf16 keeps 8 bits: ~2e-3 of each product). The bound
is the reference's: transformers run in bf16 (its dtype for a bf16 checkpoint) on the same tokens,
compared with its fp32 forward, gives the error a bf16 computation is allowed here; ellm must be no
further from fp32 than that.

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

import numpy as np

STEPS = 8
VARIANTS = ["llama-llama3-tied-bf16", "qwen3-yarn-bf16"]


def relative_error(ours, reference) -> float:
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def bf16_reference_logits(path, tokens) -> np.ndarray:
    """transformers' logits [n, V] with the model in bf16 (weights as stored, every activation bf16)."""
    import copy

    import torch

    model = copy.deepcopy(common.reference_model(path)).to(torch.bfloat16)  # the cached fp32 model stays
    return common.reference_logits(model, tokens)


def main(argv=None) -> int:
    p = common.parser(__doc__.splitlines()[0], default_variants=VARIANTS)
    p.add_argument("--kernels", default="default", help="ELLM_KERNELS value to check, with bf16-round in it "
                   "[default: the default paths: AMX's where the CPU has AMX, else vdpbf16ps']")
    args = p.parse_args(argv)
    common.torch_setup()
    from ellmd.kernels.matmul import PREFILL_MIN_ROWS as prompt

    report = common.Report(f"rounded activations ({args.kernels}) vs transformers fp32, within transformers bf16's error")
    with common.kernel_paths(args.kernels):
        for index, name in enumerate(common.selected_variants(args)):
            path = common.checkpoint(args, name)
            engine = common.make_engine(path, weight_dtype=common.engine_dtype(name), sequence_length=prompt + STEPS,
                                        chunk_size=prompt)
            tokens = common.random_tokens(prompt + STEPS, seed=10 + index, vocab=engine.spec.vocab_size)
            ref = common.reference_logits(common.reference_model(path), tokens)  # [prompt + STEPS, V]
            bound = relative_error(bf16_reference_logits(path, tokens), ref)
            logits = engine.prefill(0, tokens[:prompt], logits="all")  # [prompt, V]
            steps = np.stack([engine.decode([0], [t])[0].copy() for t in tokens[prompt:]])  # [8, V]
            ours = relative_error(np.concatenate([logits, steps]), ref)
            report.check(f"{name}: prefill {prompt} + {STEPS} decode steps", ours <= bound,
                         f"max rel {ours:.2e}, transformers bf16 {bound:.2e}")
            report.check(f"{name}: not the two-halves arithmetic", ours > 1e-3,
                         f"max rel {ours:.2e} (two halves: ~1e-5)")
    return report.exit_code()


if __name__ == "__main__":
    common.run(main)
