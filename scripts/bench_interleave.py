"""Inter-token latency of a decoding session while another session prefills a long input.

Session A generates (streamed, one token per decode step) while session B appends --prefill
tokens (a RAG result, a big tool output). The gaps between A's tokens are measured alone, then
during B's prefill under two policies, in one process:

  whole    every prefill chunk runs at the plan's full chunk size (decoding waits for it)
  chunked  the scheduler's budget: B's tokens ride along A's decode steps, as many per step as
           add about gap_ratio times the step's time alone (Policy.budget)

and printed as p50/p99 (ms) with B's prefill time. The bar: chunked p99 <= 2x the gap alone.
A keeps generating through B's prefill, its own context growing by thousands of tokens, so its
gaps alone are measured twice: over its first tokens, and again over the very positions it
decoded during B's chunked prefill (the like-for-like reference).

    .venv/bin/python scripts/bench_interleave.py                   # built-in SmolLM2, 4096 tokens
    .venv/bin/python scripts/bench_interleave.py --threads 2 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


def call(runtime, op, **args):
    return runtime.submit(op, args).future.result()


def percentiles(gaps: list[float]) -> dict:
    ms = np.asarray(gaps) * 1000
    return {"p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2),
            "max_ms": round(float(ms.max()), 2), "gaps": len(ms)}


def decode_gaps(runtime, session: str, max_tokens: int, during=None) -> tuple[list[float], dict]:
    """Generate in `session`, recording when each token arrives; with `during` (a callable run
    after the fifth token), keep only the gaps while it runs and cancel the generation after."""
    stamps, fifth, window = [], threading.Event(), {}

    def emit(event, data):
        if event == "token":
            stamps.append(time.perf_counter())
            if len(stamps) == 5:
                fifth.set()

    request = runtime.submit("session.generate", {"session_id": session, "max_tokens": max_tokens,
                                                  "ignore_eos": True, "temperature": 0}, emit)
    if during is not None:
        fifth.wait()
        window["start"] = time.perf_counter()
        window["result"] = during()
        window["stop"] = time.perf_counter()
        time.sleep(0.05)  # a token or two after it: the gap spanning its end
        request.cancelled.set()
    request.future.result()
    times = np.asarray(stamps)
    if during is not None:
        # The tokens inside the window, and the last before and first after it: the gaps spanning
        # its start and its end are the prefill's too.
        inside = times[(times > window["start"]) & (times <= window["stop"])]
        times = np.concatenate([times[times <= window["start"]][-1:], inside, times[times > window["stop"]][:1]])
    return list(np.diff(times)), window


def run(runtime, engine, args, a: str, b: str, gap_ratio) -> dict:
    print(f"A decodes while B prefills {args.prefill} tokens, gap ratio {gap_ratio}", file=sys.stderr)
    runtime.policy.gap_ratio = gap_ratio
    tokens = np.random.default_rng(1).integers(0, engine.spec.vocab_size, args.prefill).tolist()
    call(runtime, "session.rewind", session_id=a, tokens=args.prompt)
    call(runtime, "session.rewind", session_id=b, tokens=0)

    def prefill():
        began = time.perf_counter()
        call(runtime, "session.append", session_id=b, tokens=tokens)
        return time.perf_counter() - began

    gaps, window = decode_gaps(runtime, a, engine.kv.sequence_length - args.prompt - 1, during=prefill)
    return {**percentiles(gaps), "prefill_s": round(window["result"], 2),
            "prefill_tok_s": round(args.prefill / window["result"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--prefill", type=int, default=4096, help="tokens session B appends")
    parser.add_argument("--prompt", type=int, default=64, help="tokens session A holds before generating")
    parser.add_argument("--alone", type=int, default=200, help="tokens A generates alone")
    parser.add_argument("--gap-ratio", type=float, default=None, help="the chunked policy's (default: Policy's)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()

    from ellmd.engine import Engine
    from ellmd.runtime.runtime import Runtime
    from ellmd.runtime.scheduler import Policy
    from ellmd.runtime.store.lmdb import Store

    engine = Engine(args.model_path, sequence_length=2 * args.prefill, batch_size=2, threads=args.threads)
    chunked = Policy(engine.chunk_size).gap_ratio if args.gap_ratio is None else args.gap_ratio
    report = {"model": engine.model_path.name, "threads": engine.threads, "chunk_size": engine.chunk_size,
              "prefill_tokens": args.prefill, "gap_ratio": chunked}
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        runtime = Runtime(engine, store, snapshot_every_turn=False)
        done = threading.Event()

        def measure():
            try:
                a = call(runtime, "session.open", title="decoding")["session_id"]
                b = call(runtime, "session.open", title="prefilling")["session_id"]
                prompt = np.random.default_rng(0).integers(0, engine.spec.vocab_size, args.prompt).tolist()
                call(runtime, "session.append", session_id=a, tokens=prompt)
                print(f"A decodes {args.alone} tokens alone", file=sys.stderr)
                gaps, _ = decode_gaps(runtime, a, args.alone)
                report["alone"] = percentiles(gaps[5:])  # after the first tokens' warm-up
                call(runtime, "session.rewind", session_id=a, tokens=args.prompt)
                report["whole"] = run(runtime, engine, args, a, b, None)
                report["chunked"] = run(runtime, engine, args, a, b, chunked)
                span = report["chunked"]["gaps"]
                print(f"A decodes the same {span} positions alone", file=sys.stderr)
                call(runtime, "session.rewind", session_id=a, tokens=args.prompt)
                gaps, _ = decode_gaps(runtime, a, span + 5)
                report["alone_span"] = percentiles(gaps[4:])  # the window opened after A's fifth token
            finally:
                done.set()
                runtime.stop()

        threading.Thread(target=measure, daemon=True).start()
        runtime.run()  # on this thread, which warmed the kernels up (see Runtime.run)
        store.close()
    report["p99_ratio"] = round(report["chunked"]["p99_ms"] / report["alone"]["p99_ms"], 2)
    report["p99_over_alone_p50"] = round(report["chunked"]["p99_ms"] / report["alone"]["p50_ms"], 2)
    report["p99_ratio_span"] = round(report["chunked"]["p99_ms"] / report["alone_span"]["p99_ms"], 2)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report['model']}: A decodes while B prefills {args.prefill} tokens "
                        f"({engine.threads} threads, chunk {engine.chunk_size}, gap ratio {chunked})")
    for column in ("A's gaps", "p50 ms", "p99 ms", "max ms", "B's prefill"):
        table.add_column(column, justify="right" if column != "A's gaps" else "left")
    for name, label in (("alone", f"alone, its first {args.alone} tokens"),
                        ("alone_span", "alone, the positions of the chunked run")):
        r = report[name]
        table.add_row(label, str(r["p50_ms"]), str(r["p99_ms"]), str(r["max_ms"]), "")
    for name in ("whole", "chunked"):
        r = report[name]
        table.add_row(f"during B's prefill, {name} chunks", str(r["p50_ms"]), str(r["p99_ms"]), str(r["max_ms"]),
                      f"{r['prefill_s']} s ({r['prefill_tok_s']} tok/s)")
    Console().print(table)
    print(f"chunked p99 / alone p99: {report['p99_ratio']}x (first tokens), {report['p99_ratio_span']}x (same "
          f"positions); / alone p50: {report['p99_over_alone_p50']}x")


if __name__ == "__main__":
    main()
