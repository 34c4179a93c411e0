"""Decode at long context per KV format: ellm --kv-dtype bf16 and q8_0 against native llama.cpp
with -ctk/-ctv q8_0 (flash attention on), the same GGUF weights and threads.

    # tg64 after 8,192 tokens on the SmolLM2-135M and Qwen3-1.7B-shaped Q8_0 GGUFs of --gguf-dir
    .venv/bin/python scripts/bench_kv_decode.py --threads 2

    # a quick check that everything runs
    .venv/bin/python scripts/bench_kv_decode.py --context 512 --decode 8 --rounds 1

    # the decode attention kernel alone (1 thread, 8k keys, the two models' head shapes): GB/s of KV read
    .venv/bin/python scripts/bench_kv_decode.py --kernel

tgN after C: every system holds C tokens of context (prefilled untimed; ellm prefills once and
rewinds to C before each run, llama-bench -d C prefills each run), then decodes N tokens one at a
time, greedy. The systems run one after another in rounds (ellm's KV formats, then llama.cpp's),
so that a machine whose speed drifts weighs on all alike; the table shows each one's best and
median tok/s over the rounds and the ratios of the issue's bar: ellm q8_0 over ellm bf16 and
over llama.cpp q8_0.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # llama_native sits beside this script
import llama_native  # noqa: E402

GGUF_DIR = Path.home() / ".cache" / "ellm" / "bench-gguf"
MODELS = ("SmolLM2-135M-Instruct.Q8_0.gguf", "qwen3-1.7b-seed0.Q8_0.gguf")
# the kernel mode's shapes: (query heads, kv heads, head_dim, layers)
KERNEL_SHAPES = {"SmolLM2-135M": (9, 3, 64, 30), "Qwen3-1.7B": (16, 8, 128, 28)}
log = Console(stderr=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", type=Path, metavar="GGUF",
                        help=f"a GGUF, repeatable [default: {', '.join(MODELS)} in --gguf-dir]")
    parser.add_argument("--gguf-dir", type=Path, default=GGUF_DIR, help=f"[default: {GGUF_DIR}]")
    parser.add_argument("--threads", type=int, default=2, help="threads of every system [default: 2]")
    parser.add_argument("--context", type=int, default=8192, help="tokens held before decoding [default: 8192]")
    parser.add_argument("--decode", type=int, default=64, help="tokens decoded per run [default: 64]")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each system, interleaved [default: 3]")
    parser.add_argument("--kv-dtypes", default="bf16,q8_0", help="ellm's KV formats [default: bf16,q8_0]")
    parser.add_argument("--llama-cache-types", default="q8_0,f16", help="llama.cpp's -ctk/-ctv [default: q8_0,f16]")
    parser.add_argument("--llama-native", type=Path, default=llama_native.native_root(),
                        help="folder of the native llama.cpp build (scripts/llama_native.py)")
    parser.add_argument("--kernel", action="store_true", help="time the decode attention kernel alone instead")
    args = parser.parse_args(argv)
    args.kv_dtypes = [name for name in args.kv_dtypes.split(",") if name]
    args.llama_cache_types = [name for name in args.llama_cache_types.split(",") if name]
    args.model = args.model or [args.gguf_dir / name for name in MODELS]
    return args


# ---- whole decode steps ---------------------------------------------------------------------


class EllmDecode:
    """An engine holding `context` tokens in slot 0; run() decodes from there and rewinds back."""

    def __init__(self, gguf: Path, kv_dtype: str, args):
        from ellmd.cli import load_engine

        self.engine = load_engine(gguf, weight_dtype=None, kv_dtype=kv_dtype, sequence_length=args.context + args.decode,
                                  batch_size=1, chunk_size=512, threads=args.threads, quiet=True)
        tokens = np.random.default_rng(0).integers(0, self.engine.spec.vocab_size, args.context)
        self.first = int(np.argmax(self.engine.prefill(0, tokens, logits="last")))
        self.context, self.steps = args.context, args.decode
        self.run()  # warm-up

    def run(self) -> float:
        """tok/s of `steps` greedy decode steps after the held context."""
        self.engine.rewind(0, self.context)
        token = self.first
        start = time.perf_counter()
        for _ in range(self.steps):
            token = int(np.argmax(self.engine.decode([0], [token])[0]))
        return self.steps / (time.perf_counter() - start)


def llama_decode(gguf: Path, cache_type: str, args) -> float:
    """tok/s of one llama-bench run: tg `decode` after `context` tokens, flash attention on."""
    records = llama_native.bench(args.llama_native, gguf, threads=args.threads, prompts=[], decode=args.decode,
                                 depth=args.context, repetitions=1, flash_attn=True, cache_type=cache_type)
    return float(records[0]["avg_ts"])


def measure_model(gguf: Path, args) -> dict[str, list[float]]:
    """tok/s per system ("ellm bf16", "llama.cpp q8_0", ...) over the rounds."""
    runners = {}
    for kv_dtype in args.kv_dtypes:
        log.print(f"{gguf.name}: ellm --kv-dtype {kv_dtype}, prefilling {args.context} tokens")
        runners[f"ellm {kv_dtype}"] = EllmDecode(gguf, kv_dtype, args).run
    for cache_type in args.llama_cache_types:
        runners[f"llama.cpp {cache_type}"] = lambda cache_type=cache_type: llama_decode(gguf, cache_type, args)
    rates = {name: [] for name in runners}
    for round_ in range(args.rounds):
        for name, run in runners.items():
            rates[name].append(run())
            log.print(f"  round {round_ + 1}: {name} {rates[name][-1]:.2f} tok/s")
    runners.clear()
    gc.collect()
    return rates


def ratio(rates, a: str, b: str) -> str:
    if a not in rates or b not in rates:
        return ""
    return f"{max(rates[a]) / max(rates[b]):.2f}x"


def report(results: dict[str, dict[str, list[float]]], args) -> None:
    table = Table(title=f"tg{args.decode} after {args.context} tokens, {args.threads} threads, {args.rounds} rounds")
    for column in ("model", "system", "best tok/s", "median tok/s", "/ ellm bf16", "/ llama.cpp q8_0"):
        table.add_column(column, justify="left" if column in ("model", "system") else "right")
    for model, rates in results.items():
        for name, values in rates.items():
            table.add_row(model, name, f"{max(values):.2f}", f"{statistics.median(values):.2f}",
                          ratio(rates, name, "ellm bf16"), ratio(rates, name, "llama.cpp q8_0"))
    Console(width=120).print(table)


# ---- the attention kernel alone -------------------------------------------------------------


def kernel_case(heads: int, kvh: int, hd: int, kv_dtype: str, context: int, rng):
    """attention_decode's arguments for one query row over `context` random keys of one slot."""
    from ellmd.kernels import attention, kv_blocks
    from ellmd.kernels.formats import to_storage

    fmt = kv_blocks.KV_DTYPES[kv_dtype]
    held = [rng.standard_normal((1, kvh, context, hd)).astype(np.float32) for _ in range(2)]
    if kv_blocks.is_block_format(fmt):
        k, v = (kv_blocks.quantize_ref(x, fmt) for x in held)
    else:
        k, v = (to_storage(x, fmt) for x in held)
    q = rng.standard_normal((1, heads, hd)).astype(np.float32)
    shapes = attention.decode_scratch_shapes(1, heads, hd, 1, context)
    scratch = [np.zeros(shapes[name], np.float32) for name in ("partial_m", "partial_l", "partial_acc", "tile")]
    args = (q, k, v, fmt, np.zeros(1, np.int64), np.array([context], np.int64), hd**-0.5, np.empty_like(q), *scratch)
    return args, k.nbytes + v.nbytes


def kernel_report(args) -> None:
    """Each (shape, KV format)'s decode attention alone on one thread, interleaved, best of the rounds."""
    import numba

    from ellmd.kernels.attention import attention_decode

    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    cases = {(model, kv): kernel_case(heads, kvh, hd, kv, args.context, rng)
             for model, (heads, kvh, hd, _) in KERNEL_SHAPES.items() for kv in args.kv_dtypes}
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(max(args.rounds, 5)):
        for key, (call, _) in cases.items():
            attention_decode(*call)  # compiled on the first round
            start = time.perf_counter()
            for _ in range(10):
                attention_decode(*call)
            best[key] = min(best[key], (time.perf_counter() - start) / 10)
    table = Table(title=f"decode attention alone, 1 thread, {args.context} keys, one layer")
    for column in ("model", "KV", "us / layer", "ms / step", "GB/s of KV", "/ bf16"):
        table.add_column(column, justify="left" if column in ("model", "KV") else "right")
    for (model, kv), (_, nbytes) in cases.items():
        seconds = best[(model, kv)]
        base = best.get((model, "bf16"))
        table.add_row(model, kv, f"{seconds * 1e6:.0f}", f"{seconds * KERNEL_SHAPES[model][3] * 1e3:.1f}",
                      f"{nbytes / seconds / 1e9:.2f}", f"{base / seconds:.2f}x" if base else "")
    Console(width=120).print(table)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.kernel:
        kernel_report(args)
        return
    missing = [str(path) for path in args.model if not path.is_file()]
    if missing:
        sys.exit(f"no such GGUF: {', '.join(missing)} (scripts/bench_compare.py --gguf-dir writes them)")
    if args.llama_cache_types and not llama_native.is_built(args.llama_native):
        sys.exit(f"no native llama.cpp in {args.llama_native} (build it: scripts/llama_native.py)")
    report({path.name.removesuffix(".gguf"): measure_model(path, args) for path in args.model}, args)


if __name__ == "__main__":
    main()
