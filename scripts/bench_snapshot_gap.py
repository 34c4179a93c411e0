"""Inter-token gaps of a decoding session while another session's long snapshot is written.

Session A generates (streamed, one token per decode step) while session B, whose slot holds
--tokens tokens of KV none of which is stored yet, is snapshotted (`session.snapshot`: every
chunk written, one LMDB transaction and its fsync). In one process, side by side:

  inline   the engine thread waits for the write, as it did when snapshots were written inside
           the loop (the write is the same: the writer's, waited for at once)
  writer   the engine thread copies B's KV and goes on; the store's writer thread writes it

Printed: A's gap alone (p50), its gaps during B's snapshot (p50, max, in ms and as a multiple of
the gap alone), the snapshot's time, the engine thread's CPU time inside the snapshot call (the
KV copy) and the write's CPU time on the writer thread (inline, the engine thread's as well). B's KV is random bytes imported into its slot (a
snapshot moves bytes, whatever they are; no 8k-token prefill is run).

    NUMBA_NUM_THREADS=1 .venv/bin/python scripts/bench_snapshot_gap.py --threads 1
    .venv/bin/python scripts/bench_snapshot_gap.py --tokens 4096 --repeat 5 --json
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

import numpy as np


sys.path.insert(0, str(Path(__file__).parent))
from bench_interleave import call, decode_gaps  # noqa: E402  (the same measurement of a decoding session)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of KV session B snapshots")
    parser.add_argument("--repeat", type=int, default=3, help="snapshots per mode (alternating)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from ellmd.engine import Engine
    from ellmd.runtime.residency import Residency
    from ellmd.runtime.runtime import Runtime
    from ellmd.runtime.store.lmdb import Store

    engine = Engine(args.model_path, sequence_length=args.tokens + 64, batch_size=2, threads=args.threads)
    per_token = engine.kv.bytes_per_token
    rng = np.random.default_rng(0)
    kv = rng.integers(0, 1 << 8, args.tokens * per_token, dtype=np.uint8)
    tokens = rng.integers(0, engine.spec.vocab_size, args.tokens).tolist()
    report = {"model": engine.model_path.name, "threads": engine.threads, "tokens": args.tokens,
              "kv_mib": round(args.tokens * per_token / 2**20, 1)}
    inline = {"on": False}
    snapshot_cpu: list[tuple[str, float]] = []
    real_snapshot = Residency.snapshot

    def snapshot(self, session, upto=None):
        """Residency.snapshot, its engine-thread CPU time kept; inline: waiting for the write too."""
        began = time.thread_time()
        write = real_snapshot(self, session, upto)
        if write is not None and inline["on"]:
            write.done.wait()
        if session.title == "snapshotted":
            snapshot_cpu.append(("inline" if inline["on"] else "writer", time.thread_time() - began))
        return write

    Residency.snapshot = snapshot
    write_cpu: list[tuple[str, float]] = []
    real_store_snapshot = Store.snapshot

    def store_snapshot(self, meta, *args, **kwargs):
        """Store.snapshot (on the writer thread), its CPU time kept: what an inline write cost the engine thread."""
        began = time.thread_time()
        result = real_store_snapshot(self, meta, *args, **kwargs)
        if meta["title"] == "snapshotted":
            write_cpu.append(("inline" if inline["on"] else "writer", time.thread_time() - began))
        return result

    Store.snapshot = store_snapshot
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        runtime = Runtime(engine, store, snapshot_every_turn=False)
        results = {"inline": [], "writer": []}

        def measure():
            try:
                a = call(runtime, "session.open", title="decoding")["session_id"]
                call(runtime, "session.append", session_id=a, tokens=tokens[:64])
                b = call(runtime, "session.open", title="snapshotted")["session_id"]
                call(runtime, "session.append", session_id=b, tokens=tokens[:1])  # a slot of its own
                gaps, _ = decode_gaps(runtime, a, 200)
                alone = [float(g) * 1000 for g in gaps[5:]]  # ms, after the first tokens' warm-up
                report["alone_p50_ms"] = round(statistics.median(alone), 2)
                session = runtime.sessions[b]
                engine.rewind(session.slot, 0)  # the engine is idle: fill B's slot from here
                engine.import_kv(session.slot, 0, kv)
                session.tokens = list(tokens)
                for run in range(2 * args.repeat):
                    mode = ("writer", "inline")[run % 2]
                    inline["on"] = mode == "inline"
                    session.stored_tokens, session.dirty = 0, True  # every chunk written again
                    print(f"A decodes while B's {args.tokens}-token snapshot is written ({mode})", file=sys.stderr)
                    written = {}
                    gaps, window = decode_gaps(runtime, a, engine.kv.sequence_length - 64 - 1,
                                               during=lambda: written.update(call(runtime, "session.snapshot", session_id=b)))
                    gaps = [float(g) * 1000 for g in gaps]  # ms
                    call(runtime, "session.rewind", session_id=a, tokens=64)
                    results[mode].append({"gaps": gaps, "snapshot_s": window["stop"] - window["start"],
                                          "bytes": written["bytes_written"]})
            finally:
                runtime.stop()

        threading.Thread(target=measure, daemon=True).start()
        runtime.run()  # on this thread, which warmed the kernels up (see Runtime.run)
        store.close()

    alone = report["alone_p50_ms"]
    for mode, runs in results.items():
        gaps = [g for r in runs for g in r["gaps"]]
        cpu = [s for m, s in snapshot_cpu if m == mode]
        report[mode] = {
            "gap_p50_ms": round(float(statistics.median(gaps)), 2), "gap_max_ms": round(float(max(gaps)), 2),
            "max_over_alone": round(float(max(gaps)) / alone, 1),
            "worst_run_max_over_alone": [round(float(max(r["gaps"])) / alone, 1) for r in runs],
            "snapshot_s": round(statistics.median(r["snapshot_s"] for r in runs), 3),
            "engine_cpu_in_snapshot_ms": round(statistics.median(cpu) * 1000, 1),
            "write_cpu_ms": round(statistics.median(s for m, s in write_cpu if m == mode) * 1000, 1),
            "bytes_written": runs[0]["bytes"],
        }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['model']}, {report['threads']} threads: A's gap alone p50 {alone} ms; "
          f"B's snapshot {report['kv_mib']} MiB")
    for mode in ("inline", "writer"):
        r = report[mode]
        print(f"  {mode:6}  A's gaps during it: p50 {r['gap_p50_ms']} ms, max {r['gap_max_ms']} ms "
              f"({r['max_over_alone']}x alone; per run {r['worst_run_max_over_alone']}); snapshot {r['snapshot_s']} s; "
              f"engine-thread CPU in the snapshot call {r['engine_cpu_in_snapshot_ms']} ms "
              f"(the copy; inline the write's {r['write_cpu_ms']} ms CPU is the engine thread's too)")


if __name__ == "__main__":
    main()
