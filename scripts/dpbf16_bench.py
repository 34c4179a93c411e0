"""The GEMM block on vdpbf16ps (kernels/dpbf16.py) against the AMX block (bf16.py), one thread.

32 weight rows x k depths x n tokens over the same packed operands, driven as bf16._rows_product
drives the AMX block (depth blocks of bf16.DEPTH pairs, token blocks of 32), the two interleaved
round by round; the product repeated inside a call so that one round is ~10-50 ms. The best of the
rounds' process CPU time (time.process_time), so other work on a shared machine weighs less.
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

from ellmd.kernels import bf16, cpu, dpbf16, formats  # noqa: E402
from ellmd.kernels.formats import BF16  # noqa: E402

ROWS = bf16.AMX_ROWS


def driver(first, rest):
    """A jitted product over the packed tokens by one kind of block (first: the store, rest: the
    accumulating block), repeats times."""

    @numba.njit(nogil=True, fastmath=True)
    def product(w, wl, split, xh, xl, c, repeats):
        pairs, tokens = w.shape[1] // 2, xh.shape[1] // 2
        for _ in range(repeats):
            for kb in range(0, pairs, bf16.DEPTH):
                d = min(bf16.DEPTH, pairs - kb)
                for t in range(0, tokens, bf16.AMX_TOKENS):
                    if kb == 0:
                        first(w, wl, split, 0, xh, xl, t, c, kb, d)
                    else:
                        rest(w, wl, split, 0, xh, xl, t, c, kb, d)

    return product


def pack(x):
    """xh, xl [pairs, 2 * tokens] uint16 of x [tokens, k] (bf16.pack_activations' layout, in numpy)."""
    packed = []
    for half in bf16.split(x):
        bits = formats.to_storage(half, BF16)
        p = np.empty((x.shape[1] // 2, 2 * x.shape[0]), np.uint16)
        p[:, 0::2], p[:, 1::2] = bits[:, 0::2].T, bits[:, 1::2].T
        packed.append(p)
    return packed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30, help="products per round")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (best taken)")
    args = ap.parse_args()
    if "dpbf16" not in cpu.host_paths():
        sys.exit("this CPU has no AVX512-BF16: the dpbf16 block cannot run here")
    rng = np.random.default_rng(0)
    wf = rng.standard_normal((ROWS, args.k)).astype(np.float32)
    wh, wl = (formats.to_storage(h, BF16) for h in bf16.split(wf))
    xh, xl = pack(rng.standard_normal((args.tokens, args.k)).astype(np.float32))
    kinds = {"vdpbf16ps": driver(dpbf16.make_block(2, False), dpbf16.make_block(2, True))}
    if bf16.AMX:
        kinds["amx"] = driver(bf16._amx_2, bf16._amx_2_acc)
    flops = 2 * ROWS * args.tokens * args.k * args.repeats
    for split in (False, True):
        outs = {name: np.empty((ROWS, args.tokens), np.float32) for name in kinds}
        for name, product in kinds.items():
            product(wh, wl, split, xh, xl, outs[name], 1)  # compile, touch the pages
        if len(outs) == 2:  # the same product, to f32 summation order over k depths
            dp_out, amx_out = outs.values()
            assert np.abs(dp_out - amx_out).max() <= 1e-5 * np.abs(amx_out).max()
        best = dict.fromkeys(kinds, float("inf"))
        for _ in range(args.rounds):
            for name, product in kinds.items():
                start = time.process_time()
                product(wh, wl, split, xh, xl, outs[name], args.repeats)
                best[name] = min(best[name], time.process_time() - start)
        label = "split (GGUF halves)" if split else "bf16 weights"
        print(f"{label:20s} " + "  ".join(f"{name} {flops / s / 1e9:7.1f} GFLOP/s" for name, s in best.items()))


if __name__ == "__main__":
    main()
