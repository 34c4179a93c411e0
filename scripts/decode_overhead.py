"""Decode step overhead: the fused step (kernels.layer) beside the kernel-by-kernel one, in one process.

Usage (from the repository root):

    .venv/bin/python scripts/decode_overhead.py --model builtin --weight-dtype bf16
    .venv/bin/python scripts/decode_overhead.py --model ../bench-gguf/SmolLM2-135M-Instruct.Q4_K_M.gguf
    .venv/bin/python scripts/decode_overhead.py --model tests/fixtures/configs/qwen3-1.7b.json
    .venv/bin/python scripts/decode_overhead.py --model tests/fixtures/configs/qwen3-30b-a3b.json --layers 4

For each way of decoding: tok/s of greedy decode steps after a 64-token context (rounds
alternate between the two ways, so that machine noise hits both alike), the Python-to-numba
calls of one step, and the time of a step spent in Python outside those calls (each call
timed from Python, so its argument unboxing counts as inside). A profile of the same loop:
`py-spy record --native -- .venv/bin/python scripts/decode_overhead.py ... --only fused`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
from numba.core.registry import CPUDispatcher

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ellmd.engine import Engine  # noqa: E402
from ellmd.model.weights import RandomCheckpoint  # noqa: E402

CONTEXT = 64


def decode_rate(engine, fused: bool, tokens: int) -> float:
    engine.plan.fused_decode = fused
    engine.rewind(0, CONTEXT)
    token = 1
    start = time.perf_counter()
    for _ in range(tokens):
        token = int(np.argmax(engine.decode([0], [token])[0]))
    return tokens / (time.perf_counter() - start)


def calls_and_outside(engine, fused: bool, steps: int = 20) -> tuple[float, float]:
    """(Python-to-numba calls per step, ms per step in Python outside them)."""
    engine.plan.fused_decode = fused
    engine.rewind(0, CONTEXT)
    engine.decode([0], [1])
    calls, inside = Counter(), [0.0]
    patched = []
    for name in [m for m in sys.modules if m.startswith("ellmd.kernels")]:
        module = sys.modules[name]
        for attr, value in list(vars(module).items()):
            if isinstance(value, CPUDispatcher):

                def timed(*args, _f=value, _attr=attr):
                    calls[_attr] += 1
                    start = time.perf_counter()
                    result = _f(*args)
                    inside[0] += time.perf_counter() - start
                    return result

                patched.append((module, attr, value))
                setattr(module, attr, timed)
    try:
        start = time.perf_counter()
        for token in range(steps):
            engine.decode([0], [token + 2])
        total = time.perf_counter() - start
    finally:
        for module, attr, value in patched:
            setattr(module, attr, value)
    return sum(calls.values()) / steps, (total - inside[0]) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin", help="builtin, a GGUF file, a checkpoint folder or a config.json")
    parser.add_argument("--weight-dtype", default=None)
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers (config.json only)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=["fused", "kernels"], help="run one way only (for a profiler)")
    args = parser.parse_args()
    if args.model.endswith(".json"):
        source = RandomCheckpoint(Path(args.model), layers=args.layers)
    else:
        source = None if args.model == "builtin" else args.model
    start = time.perf_counter()
    engine = Engine(source, weight_dtype=args.weight_dtype, sequence_length=CONTEXT + args.tokens + 32,
                    chunk_size=CONTEXT, threads=args.threads)
    print(f"{engine.model_path.name} {engine.weight_formats}: {engine.spec.num_hidden_layers} layers; "
          f"start {time.perf_counter() - start:.1f} s "
          f"(compile {engine.timings['compile']:.1f} s)")
    engine.prefill(0, list(range(1, CONTEXT + 1)))
    ways = {"kernels": False, "fused": True}
    if args.only:
        ways = {args.only: ways[args.only]}
    rates = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, fused in ways.items():
            rates[name].append(decode_rate(engine, fused, args.tokens))
    for name, fused in ways.items():
        calls, outside = calls_and_outside(engine, fused)
        print(f"  {name:8s} {np.mean(rates[name]):8.2f} tok/s (± {np.std(rates[name]):.2f})  "
              f"{calls:6.1f} Python->numba calls/step  {outside:6.3f} ms/step in Python outside them")
    if len(ways) == 2:
        print(f"  fused / kernel by kernel: {np.mean(rates['fused']) / np.mean(rates['kernels']):.3f}x")


if __name__ == "__main__":
    main()
