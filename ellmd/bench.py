"""`ellmd bench`: prefill and decode throughput, in the spirit of llama-bench.

pp N     prefill of N tokens into an empty slot, tokens/s
ppN@C    prefill of N tokens appended to a slot already holding C tokens (an agent's next turn)
tg N     decode of N tokens one at a time after a context of C tokens, tokens/s
Each test runs `repetitions` times; the table shows the mean and the standard deviation.
"""

from __future__ import annotations

import statistics
import time

import numpy as np


def run_bench(engine, prefill_sizes, decode_tokens, context, repetitions, appends=()) -> list[dict]:
    """Measure prefill, appends ((N, C) pairs) and decode on slot 0 of an engine; one row per test."""
    rng = np.random.default_rng(0)
    vocab = engine.spec.vocab_size
    rows = []
    for n in prefill_sizes:
        tokens = rng.integers(0, vocab, n)
        rates = []
        for _ in range(repetitions):
            engine.rewind(0, 0)
            start = time.perf_counter()
            engine.prefill(0, tokens, logits="last")
            rates.append(n / (time.perf_counter() - start))
        rows.append(summarize(f"pp{n}", n, 0, rates))
    for n, held in appends:
        history, tokens = rng.integers(0, vocab, held), rng.integers(0, vocab, n)
        engine.rewind(0, 0)
        if held:
            engine.prefill(0, history, logits="none")  # once: each repetition rewinds to it
        rates = []
        for _ in range(repetitions):
            engine.rewind(0, held)
            start = time.perf_counter()
            engine.prefill(0, tokens, logits="last")
            rates.append(n / (time.perf_counter() - start))
        rows.append(summarize(f"pp{n}@{held}", n, held, rates))
    if decode_tokens:
        rates = []
        for _ in range(repetitions):
            engine.rewind(0, 0)
            logits = engine.prefill(0, rng.integers(0, vocab, max(context, 1)), logits="last")
            token = int(np.argmax(logits))
            start = time.perf_counter()
            for _ in range(decode_tokens):
                token = int(np.argmax(engine.decode([0], [token])[0]))
            rates.append(decode_tokens / (time.perf_counter() - start))
        rows.append(summarize(f"tg{decode_tokens}", decode_tokens, context, rates))
    engine.rewind(0, 0)
    return rows


def parse_appends(text: str) -> list[tuple[int, int]]:
    """"256@0,256@8192" -> [(256, 0), (256, 8192)]; ValueError naming a bad item."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        n, sep, held = item.partition("@")
        if not (sep and n.isdigit() and held.isdigit() and int(n) > 0):
            raise ValueError(f"{item!r} is not N@C (N new tokens on top of C held ones, e.g. 256@8192)")
        pairs.append((int(n), int(held)))
    return pairs


def summarize(test: str, tokens: int, context: int, rates: list[float]) -> dict:
    """One table row: the mean and standard deviation of the measured rates."""
    return {
        "test": test,
        "tokens": tokens,
        "context": context,
        "tok_s": round(statistics.mean(rates), 2),
        "std": round(statistics.stdev(rates), 2) if len(rates) > 1 else 0.0,
    }


def render_table(rows, title: str):
    from rich.table import Table

    table = Table(title=title)
    for column in ("test", "context", "tok/s"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["test"], str(row["context"]), f"{row['tok_s']:.2f} ± {row['std']:.2f}")
    return table
