"""bf16 weights per kernel path, through matmul as the model calls it: f32 FMA (weights as stored),
vdpbf16ps on two halves (weights packed at load, "dpbf16") and vdpbf16ps on activations rounded once
("dpbf16,bf16-round").

Prefill: GFLOP/s of useful work (2 x tokens x m x k) at the matmul shapes of a model, the best of
the rounds (the paths interleaved within each round). Decode: GB/s of weights read for one token,
over enough copies of the matrix (~600 MB) that it streams from memory as a decode step does.
Wall time, so run it on a quiet machine.

    .venv/bin/python scripts/dpbf16_bench.py                      # Qwen3-1.7B shapes, 512 tokens
    .venv/bin/python scripts/dpbf16_bench.py --shapes smollm2 --tokens 2048
    .venv/bin/python scripts/dpbf16_bench.py --decode
"""

from __future__ import annotations

import argparse
import sys
import time
from importlib import import_module
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ellmd.kernels import bf16, cpu, formats  # noqa: E402
from ellmd.kernels.formats import BF16  # noqa: E402

matmul = import_module("ellmd.kernels.matmul")  # ellmd.kernels re-exports a function named matmul

SHAPES = {  # [m, k] of each matmul (fused q/k/v and gate/up, as the engine fuses them)
    "qwen3-1.7b": [(4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144)],
    "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
}
PATHS = {"f32 FMA": {"int16"}, "vdpbf16ps halves": {"int16", "dpbf16"},
         "vdpbf16ps rounded": {"int16", "dpbf16", "bf16-round"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--tokens", type=int, default=512, help="prefill tokens [512]")
    parser.add_argument("--decode", action="store_true", help="decode GB/s (one token) in place of prefill")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if "dpbf16" not in cpu.host_paths():
        sys.exit("this CPU has no AVX512-BF16 (vdpbf16ps): only the f32 kernels run here")
    rng = np.random.default_rng(0)
    unit = "GB/s" if args.decode else "GFLOP/s"
    table = Table(title=f"bf16 weights, {'decode (1 token)' if args.decode else f'prefill ({args.tokens} tokens)'}, "
                        f"{unit} [CPU class {cpu.CLASS}]")
    table.add_column("[m, k]")
    for name in PATHS:
        table.add_column(name, justify="right")
    for m, k in SHAPES[args.shapes]:
        w = formats.to_storage(rng.standard_normal((m, k)).astype(np.float32), BF16)
        n = 1 if args.decode else args.tokens
        x = rng.standard_normal((n, k)).astype(np.float32)
        out = np.empty((n, m), np.float32)
        scratch = np.empty(matmul.prefill_scratch_size(m, k), np.float32)
        copies = max(1, int(600e6 // w.nbytes)) if args.decode else 1
        held = {"f32 FMA": [w] + [w.copy() for _ in range(copies - 1)]}
        held["vdpbf16ps halves"] = held["vdpbf16ps rounded"] = [bf16.pack(c) for c in held["f32 FMA"]]
        best = dict.fromkeys(PATHS, float("inf"))
        for _ in range(args.rounds + 1):  # the first round compiles
            for name, paths in PATHS.items():
                start = time.perf_counter()
                for c in held[name]:
                    matmul.matmul(x, c, BF16, out, scratch, frozenset(paths))
                best[name] = min(best[name], (time.perf_counter() - start) / len(held[name]))
        per_second = {name: (w.nbytes if args.decode else 2 * n * m * k) / t / 1e9 for name, t in best.items()}
        table.add_row(f"[{m}, {k}]", *(f"{per_second[name]:.1f}" for name in PATHS))
    Console().print(table)


if __name__ == "__main__":
    main()
