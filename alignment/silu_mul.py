"""SiLU-and-multiply kernel (SwiGLU) vs transformers' silu activation times up (fp32).

out = silu(gate) * up with gate_up = [gate | up] fused on the last axis, as the engine stores
the MLP's gate_proj and up_proj. Inputs span the range where exp overflows or underflows.

Shapes: gate_up [n, 2*I]; out [n, I].
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

TOL = 1e-5

# (rows, intermediate size, input scale)
CASES = [(1, 160, 1.0), (40, 160, 3.0), (3, 1536, 1.0), (64, 3072, 2.0), (4, 768, 30.0)]


def reference(gate_up: np.ndarray) -> np.ndarray:
    import torch
    from transformers.activations import ACT2FN

    t = torch.from_numpy(gate_up)
    gate, up = t.chunk(2, dim=-1)  # as Qwen3MoeExperts splits its fused gate_up_proj
    return (ACT2FN["silu"](gate) * up).numpy()


def main(argv=None) -> int:
    p = common.parser(__doc__.splitlines()[0], variants=False)
    p.parse_args(argv)
    common.torch_setup()
    silu_mul = common.kernel("silu_mul")
    silu_mul_ref = common.kernel("silu_mul_ref")
    report = common.Report("silu_mul vs transformers ACT2FN['silu'](gate) * up")
    rng = np.random.default_rng(0)
    for n, inter, scale in CASES:
        gate_up = (rng.standard_normal((n, 2 * inter)) * scale).astype(np.float32)
        ref = reference(gate_up)
        out = np.empty((n, inter), np.float32)
        silu_mul(gate_up, out)
        report.compare(f"silu_mul [{n},{2 * inter}] scale={scale:g}", out, ref, TOL)
        numpy_out = np.empty_like(out)
        silu_mul_ref(gate_up, numpy_out)
        report.compare("  numpy reference", numpy_out, ref, TOL)
    # Edge values: exp overflow for very negative gates, exact zero, large positive.
    edges = np.array([-1e4, -100.0, -88.0, -87.0, -20.0, -1e-8, 0.0, 1e-8, 20.0, 88.0, 100.0, 1e4], np.float32)
    gate_up = np.concatenate([edges, np.full_like(edges, 1.5)])[None, :]
    out = np.empty((1, len(edges)), np.float32)
    silu_mul(gate_up, out)
    report.compare("silu_mul edge values (-1e4 .. 1e4)", out, reference(gate_up), TOL)
    return report.exit_code()


if __name__ == "__main__":
    common.run(main)
