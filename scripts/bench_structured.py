"""Decode throughput with and without a JSON Schema (constrained decoding's cost).

One session decodes --max-tokens tokens from the same prompt, in alternating rounds: plain
(ignore_eos, so it runs the full length) and constrained by a nested JSON Schema (an array of
people, each with a bounded name, an age, an e-mail pattern, an address object and enum tags,
long enough to fill the run). The runtime computes each mask on a worker thread while the forward
pass runs and applies it to the logits after; the bar is a cost of at most 10% of decode tok/s.
Also printed: what computing the masks alone takes per token (the generated tokens replayed
through a fresh matcher), i.e. the work the overlap hides.

    .venv/bin/python scripts/bench_structured.py                 # built-in SmolLM2, 5 rounds
    .venv/bin/python scripts/bench_structured.py --rounds 9 --threads 2 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["friend", "family", "work"]}, "maxItems": 3},
    },
    "required": ["name", "age", "email", "address", "tags"],
    "additionalProperties": False,
}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 12}},
          "required": ["people"], "additionalProperties": False}
PROMPT = "List twelve people I know, with their addresses, as JSON."


def call(runtime, op, **args):
    return runtime.submit(op, args).future.result()


def mask_cost(runtime, token_ids: list[int]) -> float:
    """Microseconds per token to compute the masks of a generation alone (no forward beside it)."""
    constraint = runtime.grammars.compile("json_schema", SCHEMA)
    began = time.perf_counter()
    for token in token_ids:
        constraint.allowed()
        constraint.consume(token)
    return (time.perf_counter() - began) / len(token_ids) * 1e6


def rounds(runtime, args) -> list[dict]:
    session = call(runtime, "session.open", system="You write JSON.")["session_id"]
    call(runtime, "session.append", session_id=session, message={"role": "user", "content": PROMPT})
    start = call(runtime, "session.info", session_id=session)["tokens"]
    results = []
    for index in range(args.rounds + 1):  # round 0 warms up (the matcher's tokenizer is built then)
        row = {}
        for mode in ("plain", "schema") if index % 2 else ("schema", "plain"):
            extra = {"json_schema": SCHEMA} if mode == "schema" else {"ignore_eos": True}
            extra["speculative"] = False  # a constrained generation does not draft: compare one token a step
            cpu = time.process_time()  # all threads: the forward and the masks (steadier than wall time when busy)
            result = call(runtime, "session.generate", session_id=session, max_tokens=args.max_tokens,
                          temperature=0, stream=False, **extra)
            row[f"{mode}_cpu_ms"] = round((time.process_time() - cpu) / len(result["token_ids"]) * 1000, 2)
            call(runtime, "session.rewind", session_id=session, tokens=start)
            row[mode] = result["usage"]["decode_tok_s"]
            row[f"{mode}_tokens"] = len(result["token_ids"])
            if mode == "schema":
                row["mask_us"] = round(mask_cost(runtime, result["token_ids"]), 1)
                if result["finish_reason"] == "stop":
                    json.loads(result["text"])  # a complete constrained text is JSON
        row["ratio"] = round(row["schema"] / row["plain"], 3)
        print(f"round {index}: {row}", file=sys.stderr)
        if index:
            results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="A checkpoint directory or GGUF (default: built-in SmolLM2)")
    parser.add_argument("--rounds", type=int, default=5, help="A/B rounds after a warm-up round")
    parser.add_argument("--max-tokens", type=int, default=256, help="Tokens per generation")
    parser.add_argument("--threads", type=int, default=None, help="Kernel threads (default: all cores)")
    parser.add_argument("--json", action="store_true", help="Print the figures as JSON")
    args = parser.parse_args()

    from ellmd.engine import Engine
    from ellmd.engine.engine import builtin_model_path
    from ellmd.runtime.runtime import Runtime
    from ellmd.runtime.store import Store

    engine = Engine(args.model_path or builtin_model_path(), sequence_length=1024, batch_size=1, threads=args.threads)
    report = {"model": engine.model_path.name, "threads": engine.threads, "max_tokens": args.max_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        runtime = Runtime(engine, store, snapshot_every_turn=False)

        def measure():
            try:
                report["rounds"] = rounds(runtime, args)
            finally:
                runtime.stop()

        threading.Thread(target=measure, daemon=True).start()
        runtime.run()  # on this thread, which warmed the kernels up (see Runtime.run)
        store.close()
    rows = report["rounds"]
    for key in ("plain", "schema", "ratio", "mask_us", "plain_cpu_ms", "schema_cpu_ms"):
        report[f"median_{key}"] = round(statistics.median(r[key] for r in rows), 3)
    report["cost_pct"] = round((1 - report["median_ratio"]) * 100, 1)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report['model']}: decode with and without a nested JSON Schema "
                        f"({engine.threads} threads, {args.max_tokens} tokens, interleaved rounds)")
    columns = ("plain", "schema", "ratio", "schema_tokens", "mask_us", "plain_cpu_ms", "schema_cpu_ms")
    for column in ("round", "plain tok/s", "schema tok/s", "schema / plain", "schema tokens", "masks alone µs/token",
                   "plain CPU ms/token", "schema CPU ms/token"):
        table.add_column(column, justify="right")
    for i, r in enumerate(rows, start=1):
        table.add_row(str(i), *(str(r[c]) for c in columns))
    table.add_row("median", *(str(report.get(f"median_{c}", "")) for c in columns))
    Console().print(table)
    print(f"constrained decoding costs {report['cost_pct']}% of decode tok/s (median of {len(rows)} rounds; bar: 10%)")


if __name__ == "__main__":
    main()
