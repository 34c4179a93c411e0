"""Swap speed: evicting sessions to the store and resuming them, at 1k, 4k and 8k tokens.

For each size, one session's slot is filled with KV bytes (random: a swap moves bytes, whatever
they are; no forward pass is run) and its tokens, then, through the runtime's Residency (the code
the daemon runs):
  evict (all KV new)       snapshot of every chunk (write + LMDB commit, fsync) and the slot freed
  evict (snapshotted)      the same session once its turns were snapshotted: metadata only
  resume (warm store)      KV chunks checked (XXH3) and copied from LMDB's pages into the slot
Each figure is the median of --repeat runs (the first resume, which maps the store's pages into
the process, is left out). Prints MiB moved, GB/s, and the CPU time of a resume (all threads:
the steadier figure on a loaded machine).

    .venv/bin/python scripts/bench_swap.py                       # built-in model
    .venv/bin/python scripts/bench_swap.py --sizes 1024,8192 --repeat 9 --kv-dtype f16
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def timed(fn, cpu: list | None = None) -> float:
    """Wall seconds of fn(); its CPU seconds (every thread of the process) appended to `cpu`."""
    began, began_cpu = time.perf_counter(), time.process_time()
    fn()
    if cpu is not None:
        cpu.append(time.process_time() - began_cpu)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--sizes", default="1024,4096,8192", help="session lengths in tokens")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--kv-dtype", default="bf16")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    from rich.console import Console
    from rich.table import Table

    from ellmd.engine import Engine
    from ellmd.runtime.residency import Residency
    from ellmd.runtime.scheduler import Policy
    from ellmd.runtime.session import Session
    from ellmd.runtime.store.lmdb import Store

    engine = Engine(args.model_path, kv_dtype=args.kv_dtype, sequence_length=max(sizes) + 64, batch_size=1, threads=1)
    per_token = engine.kv.bytes_per_token
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        residency = Residency(engine, store, Policy(engine.chunk_size))
        for size in sizes:
            kv = rng.integers(0, 1 << 8, size * per_token, dtype=np.uint8)
            tokens = rng.integers(0, engine.spec.vocab_size, size).tolist()
            evict_new, evict_clean, resume, resume_cpu = [], [], [], []
            session = Session.new(residency.fingerprint, f"{size} tokens")
            residency.sessions[session.session_id] = session
            for run in range(args.repeat + 1):
                slot = residency.resident(session)  # a free slot: nothing of the session is stored
                engine.rewind(slot, 0)
                engine.import_kv(slot, 0, kv)
                session.tokens, session.dirty = list(tokens), True
                evict_new.append(timed(lambda: (residency.evict(session), residency.release(session))))
                session = residency.session(session.session_id)
                resume.append(timed(lambda: residency.resident(session), resume_cpu))
                session.dirty = True  # a turn's metadata changed, its KV is on disk already
                evict_clean.append(timed(lambda: (residency.evict(session), residency.release(session))))
                session.stored_tokens = 0  # the next run writes the whole KV again
            residency.delete(session)
            residency.wait_for_writes(session.session_id)
            rows.append((size, size * per_token, statistics.median(evict_new[1:]),
                         statistics.median(evict_clean[1:]), statistics.median(resume[1:]),
                         statistics.median(resume_cpu[1:]), resume[0]))
        residency.close()
        store.close()

    table = Table(title=f"{engine.model_path.name}: session swap, KV {args.kv_dtype} ({per_token} bytes/token), "
                        f"median of {args.repeat}")
    for column in ("tokens", "MiB", "evict, all KV new", "evict, snapshotted", "resume (warm store)",
                   "resume GB/s", "resume CPU", "first resume"):
        table.add_column(column, justify="right")
    for size, nbytes, new, clean, warm, cpu, first in rows:
        table.add_row(f"{size}", f"{nbytes / 2**20:.1f}", f"{new * 1000:.0f} ms ({nbytes / new / 1e9:.2f} GB/s)",
                      f"{clean * 1000:.1f} ms", f"{warm * 1000:.1f} ms", f"{nbytes / warm / 1e9:.1f}",
                      f"{cpu * 1000:.1f} ms", f"{first * 1000:.1f} ms")
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
