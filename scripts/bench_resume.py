"""Resume versus recompute: what the store buys a long session.

Builds one session of --tokens tokens through the runtime (prefill), snapshots it, closes it (the
slot is freed, the session stays in the store), resumes it (KV chunks copied back, no forward
pass), then times one more turn's snapshot. Prints a table: prefill time, resume time and their
ratio, the snapshot time of the whole session and of one turn, and bytes on disk per token.

    .venv/bin/python scripts/bench_resume.py                      # built-in model, 8192 tokens
    .venv/bin/python scripts/bench_resume.py --model-path DIR --tokens 4096 --threads 2
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np


def call(runtime, op, **args):
    return runtime.submit(op, args).future.result()


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kv-dtype", default="bf16")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from ellmd.engine import Engine
    from ellmd.runtime.runtime import Runtime
    from ellmd.runtime.store.lmdb import Store

    engine = Engine(args.model_path, kv_dtype=args.kv_dtype, sequence_length=args.tokens + 64, batch_size=1,
                    threads=args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        runtime = Runtime(engine, store, snapshot_every_turn=False)
        runtime.start()
        session = call(runtime, "session.open", title="long")["session_id"]
        tokens = np.random.default_rng(0).integers(0, engine.spec.vocab_size, args.tokens).tolist()
        began = time.perf_counter()
        call(runtime, "session.append", session_id=session, tokens=tokens)
        prefill_s = time.perf_counter() - began
        full = call(runtime, "session.snapshot", session_id=session)
        call(runtime, "session.close", session_id=session)
        resume = call(runtime, "session.resume", session_id=session)
        call(runtime, "session.append", session_id=session, tokens=tokens[:32])
        turn = call(runtime, "session.snapshot", session_id=session)
        on_disk = directory_bytes(Path(tmp) / "store")
        runtime.stop()
        store.close()

    table = Table(title=f"{engine.model_path.name}: a {args.tokens}-token session, KV {args.kv_dtype}, {engine.threads} threads")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("prefill (recompute)", f"{prefill_s * 1000:.0f} ms"),
        ("resume from the store", f"{resume['ms']:.0f} ms"),
        ("resume / prefill", f"1 / {prefill_s * 1000 / resume['ms']:.0f}"),
        ("snapshot of the whole session", f"{full['ms']:.0f} ms ({full['bytes_written'] / 2**20:.1f} MiB)"),
        ("snapshot of one 32-token turn", f"{turn['ms']:.1f} ms ({turn['chunks_written']} chunk)"),
        ("KV bytes per token", f"{engine.kv.bytes_per_token}"),
        ("bytes on disk per token", f"{on_disk / (args.tokens + 32):.0f}"),
    ]
    for row in rows:
        table.add_row(*row)
    Console().print(table)


if __name__ == "__main__":
    main()
