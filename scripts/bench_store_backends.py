"""The store's backends side by side: LMDB and the directory backend, without a model.

Writes one session of --tokens tokens of synthetic KV (--bytes-per-token each), then per round:
a whole snapshot, a 32-token turn's snapshot, a load back into a buffer (checksums checked) and a
lease taken and released; the backends alternate round by round (a noisy machine shifts both
alike). Prints a table of medians and the directory / LMDB ratio.

    .venv/bin/python scripts/bench_store_backends.py                          # 8192 tokens, Qwen3-0.6B's KV
    .venv/bin/python scripts/bench_store_backends.py --tokens 2048 --bytes-per-token 23040 --dir /mnt/nfs/tmp
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ellmd.runtime.store import open_store

FINGERPRINT = {"model": "bench", "tokenizer": "bench", "template": "bench", "kv": "bench"}


def timed(run) -> float:
    began = time.perf_counter()
    run()
    return (time.perf_counter() - began) * 1000


def round_of(store, kv: np.ndarray, tokens: list[int], per_token: int, round_index: int) -> dict:
    """One round on one store: its timings in ms."""
    session_id = f"s{round_index}"
    meta = {"session_id": session_id, "fingerprint": FINGERPRINT}
    export = lambda a, b: kv[a * per_token:b * per_token]  # noqa: E731 (the store's export callback)
    figures = {"whole snapshot": timed(lambda: store.snapshot(meta, tokens, export, 0, per_token))}
    longer = tokens + tokens[:32]
    longer_kv = np.concatenate([kv, kv[:32 * per_token]])
    figures["turn snapshot (32 tokens)"] = timed(lambda: store.snapshot(
        meta, longer, lambda a, b: longer_kv[a * per_token:b * per_token], len(tokens), per_token))
    target = np.empty(len(longer) * per_token, np.uint8)

    def write_chunk(start, data):
        target[start * per_token:start * per_token + len(data)] = np.frombuffer(data, np.uint8)

    figures["load (resume)"] = timed(lambda: store.load(session_id, write_chunk, per_token))
    assert np.array_equal(target, longer_kv)
    figures["lease take + release"] = timed(lambda: (store.take_lease(session_id, store.holder, 10),
                                                     store.release_lease(session_id, store.holder)))
    store.delete(session_id)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--bytes-per-token", type=int, default=114_688)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the stores are made [default: a temporary directory]")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    per_token = args.bytes_per_token
    kv = np.random.default_rng(0).integers(0, 256, args.tokens * per_token, dtype=np.uint8)
    tokens = list(range(args.tokens))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        stores = {backend: open_store(backend, Path(tmp) / backend, replica="bench") for backend in ("lmdb", "directory")}
        results = {backend: [] for backend in stores}
        for index in range(args.rounds):
            for backend, store in stores.items():
                results[backend].append(round_of(store, kv, tokens, per_token, index))
        for store in stores.values():
            store.close()

    table = Table(title=f"store backends: a {args.tokens}-token session, {per_token} KV bytes per token "
                        f"({args.tokens * per_token / 2**20:.0f} MiB), median of {args.rounds} alternating rounds")
    for column in ("measure", "lmdb ms", "directory ms", "directory / lmdb"):
        table.add_column(column, justify="left" if column == "measure" else "right")
    for measure in results["lmdb"][0]:
        lmdb, directory = (statistics.median(r[measure] for r in results[b]) for b in ("lmdb", "directory"))
        table.add_row(measure, f"{lmdb:.2f}", f"{directory:.2f}", f"{directory / lmdb:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
