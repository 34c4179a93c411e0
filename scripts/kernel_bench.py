"""Decode matmul kernels alone: weights per second of each block type, from cache and from memory.

One input row times a [m, 2048] weight matrix of each GGUF block type, on the kernel path
ELLM_KERNELS selects (cpu.py): a matrix that fits a core's L2 (the arithmetic's speed) and one
of ~1.2 GB (streamed from memory, as a decode step streams a model). Times are CPU time of the
process (divided by the threads), the best of 5 runs, so that other work on a shared machine
weighs less.

    .venv/bin/python scripts/kernel_bench.py                     # every block type, 1 thread
    .venv/bin/python scripts/kernel_bench.py --types Q4_K,Q6_K --threads 2
    ELLM_KERNELS=portable .venv/bin/python scripts/kernel_bench.py
    .venv/bin/python scripts/kernel_bench.py --prefill 512 --threads 2   # prefill: integer GEMM vs f32 panels

--prefill N times N input rows by a [PREFILL_ROWS, 2048] matrix of each type on the integer GEMM
and on the f32 panels (blocks decoded), the two interleaved (the measurement behind the integer GEMM
for blocks on every CPU class).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np
from numba import prange

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ellmd.kernels import cpu, quant, quant_int  # noqa: E402
from ellmd.kernels.matmul import _linear_int, _prefill_product, _worker_floats, linear_rows  # noqa: E402

K = 2048
CACHED_ROWS = 256  # ~300 KB of Q4_K: in L2
STREAMED_BYTES = 1.2e9
PREFILL_ROWS = 2048  # weight rows of the prefill comparison (Qwen3-1.7B's q and o projections)


@numba.njit(nogil=True, fastmath=True, parallel=True)
def _integer(x, xq, xd, xs, w, out, tasks):
    quant.quantize_activations(x, xq, xd, xs)
    m = w.shape[0]
    for t in prange(tasks):
        quant_int.rows_vnni(xq, xd, xs, w, out, t * m // tasks, (t + 1) * m // tasks)


@numba.njit(nogil=True, fastmath=True, parallel=True)
def _portable(x, w, out, tasks):
    m = w.shape[0]
    for t in prange(tasks):
        linear_rows(x, w, out, t * m // tasks, (t + 1) * m // tasks)


def random_blocks(rng, name: str, rows: int) -> np.ndarray:
    """Random codes with small positive f16 scales."""
    dtype = quant.BLOCK_DTYPES[name]
    blocks = K // quant.BLOCK_SIZES[name]
    w = np.frombuffer(rng.integers(0, 256, rows * blocks * dtype.itemsize, dtype=np.uint8).tobytes(), dtype)
    w = w.reshape(rows, blocks).copy()
    for field in ("d", "dmin", "m"):
        if field in dtype.names:
            w[field] = np.float16(rng.uniform(0.001, 0.01, w.shape)).view(np.uint16)
    return w


def best_seconds(run, repeats: int, threads: int) -> float:
    run()  # compile, touch the pages
    best = float("inf")
    for _ in range(5):
        start = time.process_time()
        for _ in range(repeats):
            run()
        best = min(best, (time.process_time() - start) / repeats / threads)
    return best


def prefill_rows(names, n: int, threads: int):
    """(type, integer GFLOP/s, f32 panels GFLOP/s) of an n-row prefill matmul of each type, the two
    kernels interleaved round by round (the best of each)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, K)).astype(np.float32)
    per = _worker_floats(K)
    work = np.zeros((threads, per), np.float32)
    xq = np.zeros((n, K), np.int8 if "vnni" in cpu.ENABLED else np.int16)
    for name in names:
        w = random_blocks(rng, name, PREFILL_ROWS)
        out = np.zeros((n, PREFILL_ROWS), np.float32)
        runs = (lambda: _linear_int(x, w, out, xq, threads),
                lambda: _prefill_product(x, w, out, work))
        best = [float("inf")] * 2
        for _ in range(3):
            for i, run in enumerate(runs):
                best[i] = min(best[i], best_seconds(run, 1, threads))
        yield name, *(2 * n * PREFILL_ROWS * K / s / 1e9 for s in best)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(quant.VNNI_BLOCKS), help="comma-separated GGUF block types")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefill", type=int, metavar="N", help="compare the prefill kernels on N input rows")
    args = parser.parse_args()
    names = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    unknown = [t for t in names if t not in quant.BLOCK_DTYPES]
    if unknown:
        parser.error(f"unknown block type {unknown[0]}; known: {', '.join(quant.BLOCK_DTYPES)}")
    numba.set_num_threads(args.threads)

    from rich.console import Console
    from rich.table import Table

    integer = bool(cpu.INTEGER & cpu.ENABLED)
    if args.prefill:
        if not integer:
            parser.error("--prefill compares the integer GEMM with the f32 panels: it needs an integer path")
        table = Table(title=f"prefill matmul, {args.prefill} x {K} input, {PREFILL_ROWS} rows, {args.threads} thread(s)")
        for column in ("type", "integer GFLOP/s", "f32 panels GFLOP/s", "ratio"):
            table.add_column(column, justify="right")
        for name, integer_rate, panels_rate in prefill_rows(names, args.prefill, args.threads):
            table.add_row(name, f"{integer_rate:.1f}", f"{panels_rate:.1f}", f"{integer_rate / panels_rate:.2f}")
        Console().print(table)
        return
    xq_dtype = np.int8 if "vnni" in cpu.ENABLED else np.int16
    path = ("vnni (int8)" if xq_dtype == np.int8 else "int16") if integer else "portable (float32)"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, K)).astype(np.float32)
    xq, xd, xs = np.zeros((1, K), xq_dtype), np.zeros((1, K // 32), np.float32), np.zeros((1, K // 16), np.float32)
    table = Table(title=f"decode matmul, 1 x {K} input, {args.threads} thread(s), {path} kernels")
    for column in ("type", "from", "rows", "Gweights/s", "GB/s"):
        table.add_column(column, justify="left" if column in ("type", "from") else "right")
    for name in names:
        row_bytes = K // quant.BLOCK_SIZES[name] * quant.BLOCK_DTYPES[name].itemsize
        for where, rows in (("L2", CACHED_ROWS), ("memory", int(STREAMED_BYTES // row_bytes))):
            w = random_blocks(rng, name, rows)
            out = np.zeros((1, rows), np.float32)
            if integer:
                def run():
                    _integer(x, xq, xd, xs, w, out, args.threads)
            else:
                def run():
                    _portable(x, w, out, args.threads)
            seconds = best_seconds(run, max(1, int(2e7 // (rows * K))), args.threads)
            table.add_row(name, where, f"{rows:,}", f"{rows * K / seconds / 1e9:.2f}", f"{w.nbytes / seconds / 1e9:.2f}")
            del w, out
    Console().print(table)


if __name__ == "__main__":
    main()
