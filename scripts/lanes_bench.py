"""GGUF blocks with outputs in lanes (kernels/lanes.py) against the row integer GEMM and the f32 GEMM.

One thread (run with NUMBA_NUM_THREADS=1): n input rows times a [m, k] weight at the shapes of
SmolLM2-135M and Qwen3-1.7B, on linear_lanes (the blocks repacked to tiles), matmul._linear_int16
(rows_vnni on the blocks) and gemm.product (bf16 weights), interleaved round by round; the best
CPU time of the calling thread (time.thread_time), so other work on a shared machine weighs less.
GFLOP/s for n > 1; for n = 1 (decode) GB/s of the weights in their GGUF size (Q8_0: 34 bytes per
32 values, Q4_K 144 per 256). Q4_K skips the shapes whose depth 256 does not divide.

    NUMBA_NUM_THREADS=1 .venv/bin/python scripts/lanes_bench.py --rows 512 --format Q4_K
    NUMBA_NUM_THREADS=1 .venv/bin/python scripts/lanes_bench.py --rows 1 --repeats 20

--from-memory times decode as a model's step meets it: one row, the weights streamed from memory
(enough copies of each matrix, ~600 MB, rotated), on every kernel thread, wall time, lanes alone:

    .venv/bin/python scripts/lanes_bench.py --from-memory --format Q4_K
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ellmd.kernels import cpu, gemm, lanes, quant  # noqa: E402

matmul = importlib.import_module("ellmd.kernels.matmul")  # the module (the package exports its function)

SHAPES = ((576, 1536), (1536, 576), (576, 576), (2048, 6144), (6144, 2048))  # (k, m)
KERNELS = ("lanes", "rows_vnni", "gemm f32 (bf16 w)")


def best_seconds(run, repeats: int) -> float:
    run()  # compile, touch the pages
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        run()
        best = min(best, time.thread_time() - start)
    return best


def weights(block: str, m: int, k: int, rng) -> np.ndarray:
    """A [m, k] weight in block: quantized random values, or random Q6_K blocks with small scales
    (the gguf package has no Q6_K quantizer; the kernels' speed does not depend on the values)."""
    if block != "Q6_K":
        return quant.quantize(rng.standard_normal((m, k)).astype(np.float32) * 0.05, block)
    dtype = quant.BLOCK_DTYPES[block]
    w = rng.integers(0, 256, (m, k // 256, dtype.itemsize), np.uint8).view(dtype)[..., 0]
    w["d"] = rng.uniform(1e-4, 2e-4, w.shape).astype(np.float16).view(np.uint16)
    return w


def rates(n: int, k: int, m: int, block: str, repeats: int, rng) -> list[float]:
    """GFLOP/s (n > 1) or GB/s of weights (n = 1) of each kernel of KERNELS at one shape."""
    x = rng.standard_normal((n, k)).astype(np.float32)
    w = weights(block, m, k, rng)
    tiles = lanes.repack(w)
    bf16 = (rng.standard_normal((m, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    out = np.zeros((n, m), np.float32)
    work = np.zeros((1, gemm.PANEL * k), np.float32)
    runs = (lambda: lanes.linear_lanes(x, tiles, out, 1), lambda: matmul._linear_int16(x, w, out, 1),
            lambda: gemm.product(x, bf16, out, work))
    best = [float("inf")] * len(runs)
    for _ in range(3):
        for i, run in enumerate(runs):
            best[i] = min(best[i], best_seconds(run, repeats))
    if n > 1:
        return [2 * n * m * k / s / 1e9 for s in best]
    return [size / s / 1e9 for size, s in zip((w.nbytes, w.nbytes, bf16.nbytes), best)]


def memory_rate(k: int, m: int, block: str, repeats: int, rng) -> float:
    """GB/s of weights (their GGUF size) of lanes decode, one row, the tiles streamed from memory."""
    w = weights(block, m, k, rng)
    copies = [lanes.repack(w)]
    copies += [copies[0].copy() for _ in range(max(0, int(600e6 // copies[0].nbytes) - 1))]
    x = rng.standard_normal((1, k)).astype(np.float32)
    out = np.zeros((1, m), np.float32)
    threads = numba.get_num_threads()
    lanes.linear_lanes(x, copies[0], out, threads)  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for tiles in copies:
            lanes.linear_lanes(x, tiles, out, threads)
        best = min(best, (time.perf_counter() - start) / len(copies))
    return w.nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512, help="input rows n (1: decode)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per kernel and round")
    parser.add_argument("--format", choices=sorted(lanes.REPACK), default="Q8_0", help="the weights' GGUF block type")
    parser.add_argument("--from-memory", action="store_true",
                        help="decode (one row) of lanes alone with the weights streamed from memory, every thread")
    args = parser.parse_args()
    if "int16" not in cpu.host_paths():
        parser.error("the lanes kernel needs the int16 path (AVX512-VNNI+BW or AVX2)")
    from rich.console import Console
    from rich.table import Table

    rng = np.random.default_rng(0)
    depth = quant.BLOCK_SIZES[args.format]
    if args.from_memory:
        table = Table(title=f"{args.format}, decode from memory, {numba.get_num_threads()} threads, {cpu.CLASS}")
        table.add_column("(k, m)", justify="right")
        table.add_column("lanes GB/s of weights", justify="right")
        for k, m in (shape for shape in SHAPES if shape[0] % depth == 0):
            table.add_row(f"({k}, {m})", f"{memory_rate(k, m, args.format, args.repeats, rng):.1f}")
        Console().print(table)
        return

    unit = "GFLOP/s" if args.rows > 1 else "GB/s of weights"
    table = Table(title=f"{args.format}, {args.rows} input rows, one thread, {unit}, {cpu.CLASS}")
    for column in ("(k, m)", *KERNELS, "lanes / rows_vnni"):
        table.add_column(column, justify="right")
    for k, m in (shape for shape in SHAPES if shape[0] % depth == 0):
        found = rates(args.rows, k, m, args.format, args.repeats, rng)
        table.add_row(f"({k}, {m})", *(f"{r:.1f}" for r in found), f"{found[0] / found[1]:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
