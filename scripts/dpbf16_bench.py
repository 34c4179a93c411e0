"""The GEMM block on vdpbf16ps (kernels/dpbf16.py) against the AMX block (bf16.py), one thread.

32 weight rows (padded as bf16.gemm pads the halves of block weights) x k depths x n tokens over the same packed operands
(bf16.pack_activations), by bf16._rows_product in depth passes as bf16._block_product makes them,
the two kinds interleaved round by round; the product repeated inside a call so that one round is
~10-50 ms. The best of the rounds' process CPU time (time.process_time), so other work on a shared
machine weighs less.
GFLOP/s count the useful flops, 2 x rows x tokens x k, whatever the halves cost (split: the
weights' two halves as for GGUF blocks, a third product).

    .venv/bin/python scripts/dpbf16_bench.py
    .venv/bin/python scripts/dpbf16_bench.py --k 4096 --tokens 512 --rounds 9
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ellmd.kernels import bf16, cpu, formats  # noqa: E402
from ellmd.kernels.formats import BF16  # noqa: E402

ROWS = bf16.AMX_ROWS


@numba.njit(nogil=True, fastmath=True)
def product(wh, wl, split, xh, xl, c, tiles, repeats):
    """c = the rows' products with the packed tokens, on AMX blocks (tiles) or vdpbf16ps, repeats times."""
    pairs, tokens = xh.shape[1] // (2 * bf16.TILE), c.shape[1]
    passes = (pairs * tokens * 8 + bf16.PASS_BYTES - 1) // bf16.PASS_BYTES
    depth = ((pairs + passes - 1) // passes + bf16.TILE - 1) // bf16.TILE * bf16.TILE
    for _ in range(repeats):
        for p0 in range(0, pairs, depth):
            bf16._rows_product(wh, wl, split, 0, ROWS, xh, xl, p0, min(depth, pairs - p0), tokens, c, p0 > 0, tiles)


@numba.njit(nogil=True)
def pack(x, xh, xl):
    bf16.pack_activations(x, 0, x.shape[0], x.shape[0], xh, xl)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=256, help="a multiple of 32")
    ap.add_argument("--repeats", type=int, default=30, help="products per round")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (best taken)")
    args = ap.parse_args()
    if "dpbf16" not in cpu.host_paths():
        sys.exit("this CPU has no AVX512-BF16: the dpbf16 block cannot run here")
    rng = np.random.default_rng(0)
    wf = np.zeros((ROWS, args.k + bf16.ROW_PAD), np.float32)
    wf[:, : args.k] = rng.standard_normal((ROWS, args.k))
    wh, wl = (formats.to_storage(h, BF16) for h in bf16.split(wf))
    xh, xl = (np.empty((args.tokens // bf16.TILE, args.k * bf16.TILE), np.uint16) for _ in range(2))
    pack(rng.standard_normal((args.tokens, args.k)).astype(np.float32), xh, xl)
    kinds = {"vdpbf16ps": False}  # name -> tiles
    if bf16.AMX:
        kinds["amx"] = True
    flops = 2 * ROWS * args.tokens * args.k * args.repeats
    for split in (False, True):
        outs = {name: np.empty((ROWS, args.tokens), np.float32) for name in kinds}
        for name, tiles in kinds.items():
            product(wh, wl, split, xh, xl, outs[name], tiles, 1)  # compile, touch the pages
        if len(outs) == 2:  # the same product, to f32 summation order over k depths
            dp_out, amx_out = outs.values()
            assert np.abs(dp_out - amx_out).max() <= 1e-5 * np.abs(amx_out).max()
        best = dict.fromkeys(kinds, float("inf"))
        for _ in range(args.rounds):
            for name, tiles in kinds.items():
                start = time.process_time()
                product(wh, wl, split, xh, xl, outs[name], tiles, args.repeats)
                best[name] = min(best[name], time.process_time() - start)
        label = "split (GGUF halves)" if split else "bf16 weights"
        print(f"{label:20s} " + "  ".join(f"{name} {flops / s / 1e9:7.1f} GFLOP/s" for name, s in best.items()))


if __name__ == "__main__":
    main()
