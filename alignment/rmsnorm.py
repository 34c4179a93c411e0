"""RMSNorm kernel vs transformers' LlamaRMSNorm and Qwen3RMSNorm (fp32).

Checks the hidden-size norm (rows of the residual stream, in place and out of place, below and
above the kernel's parallel threshold, tiny and huge inputs where eps and overflow matter) and
Qwen3's per-head q/k norm, against transformers and against the kernel's numpy reference.

Shapes: x [n, h]; q [n, H, d] for the per-head norm.
"""

from __future__ import annotations

try:
    from alignment import common
except ImportError:  # run as a script from another directory
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from alignment import common

import numpy as np

TOL = 1e-5  # kernels in fp32: only summation order differs

# (rows, width, eps, input scale)
CASES = [
    (1, 96, 1e-6, 1.0),
    (37, 96, 1e-6, 1.0),
    (5, 576, 1e-5, 1.0),  # SmolLM2's hidden size and eps
    (64, 2048, 1e-6, 1.0),  # above the parallel threshold
    (8, 1024, 1e-6, 1e3),  # large activations (deep residual streams)
    (8, 1024, 1e-5, 1e-3),  # eps comparable to mean(x**2)
]


def reference(x: np.ndarray, weight: np.ndarray, eps: float, norm_class) -> np.ndarray:
    import torch

    module = norm_class(x.shape[-1], eps=eps)
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(weight))
        return module(torch.from_numpy(x)).numpy()


def main(argv=None) -> int:
    p = common.parser(__doc__.splitlines()[0], variants=False)
    p.parse_args(argv)
    common.torch_setup()
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    rmsnorm = common.kernel("rmsnorm")
    rmsnorm_ref = common.kernel("rmsnorm_ref")
    rmsnorm_heads = common.kernel("rmsnorm_heads")
    report = common.Report("rmsnorm vs transformers LlamaRMSNorm / Qwen3RMSNorm")
    rng = np.random.default_rng(0)

    for n, h, eps, scale in CASES:
        x = (rng.standard_normal((n, h)) * scale).astype(np.float32)
        w = (1.0 + 0.2 * rng.standard_normal(h)).astype(np.float32)
        ref = reference(x, w, eps, LlamaRMSNorm)
        out = np.empty_like(x)
        rmsnorm(x, w, eps, out)
        report.compare(f"rmsnorm [{n},{h}] eps={eps:g} scale={scale:g}", out, ref, TOL)
        inplace = x.copy()
        rmsnorm(inplace, w, eps, inplace)
        report.compare(f"  in place", inplace, ref, TOL)
        numpy_out = np.empty_like(x)
        rmsnorm_ref(x, w, eps, numpy_out)
        report.compare(f"  numpy reference", numpy_out, ref, TOL)

    # Qwen3's q/k norm: one RMSNorm over head_dim for every (token, head), in place.
    for n, heads, d in [(1, 6, 24), (23, 16, 128), (64, 32, 128)]:
        q = rng.standard_normal((n, heads, d)).astype(np.float32) * 3
        w = (1.0 + 0.2 * rng.standard_normal(d)).astype(np.float32)
        ref = reference(q, w, 1e-6, Qwen3RMSNorm)
        ours = q.copy()
        rmsnorm_heads(ours, w, 1e-6)
        report.compare(f"rmsnorm_heads [{n},{heads},{d}]", ours, ref, TOL)
    return report.exit_code()


if __name__ == "__main__":
    common.run(main)
