"""Perplexity of SmolLM2-135M-Instruct (the built-in GGUF) on a text: `ellmd perplexity`'s figure
(f32 weights, bf16 KV by default) vs transformers fp32 on the same dequantized weights, the same
tokens and the same sliding windows, NLLs from torch's cross-entropy. Within 0.1%.

Shapes: a window's logits [w, V], V = 49152; NLL per scored token [n].
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

TOLERANCE = 1e-3  # relative, on the perplexity


def reference_nll(model, tokens: np.ndarray, spans) -> np.ndarray:
    """transformers' NLL of each scored token, window by window."""
    import torch

    out = []
    for begin, end, first in spans:
        window = tokens[begin:end]
        logits = torch.from_numpy(common.reference_logits(model, window))  # [w, V]
        targets = torch.from_numpy(window[1:].astype(np.int64))
        nll = torch.nn.functional.cross_entropy(logits[:-1].double(), targets, reduction="none").numpy()
        out.append(nll[first - begin - 1:])
    return np.concatenate(out)


def main(argv=None) -> int:
    p = common.parser(__doc__.splitlines()[0], variants=False)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--tokens", type=int, default=1536, help="score the text's first N tokens")
    p.add_argument("--kv-dtype", default="bf16")
    args = p.parse_args(argv)
    common.torch_setup()
    from ellmd import perplexity as ppl
    from ellmd.engine import builtin_model_path

    path = builtin_model_path()
    report = common.Report(f"perplexity of {path.name}, KV {args.kv_dtype}, vs transformers fp32")
    engine = common.make_engine(path, weight_dtype="f32", kv_dtype=args.kv_dtype, sequence_length=args.context,
                                batch_size=1, chunk_size=128)
    tokens = np.asarray(engine.tokenizer.encode(ppl.default_text(), add_special_tokens=True)[: args.tokens], np.int64)
    ours = ppl.perplexity(engine, tokens, args.context, args.stride)
    spans = ppl.windows(len(tokens), args.context, args.stride)
    nll = reference_nll(common.reference_model(path), tokens, spans)
    reference = float(np.exp(nll.mean()))
    report.check("tokens scored", ours.tokens_scored == len(nll), f"{ours.tokens_scored} vs {len(nll)}")
    error = abs(ours.perplexity / reference - 1)
    report.check(f"perplexity within {TOLERANCE:.1%}", error <= TOLERANCE,
                 f"ellm {ours.perplexity:.4f} +- {ours.stderr:.4f}, transformers {reference:.4f}: {error:.2e} relative")
    return report.exit_code()


if __name__ == "__main__":
    common.run(main)
