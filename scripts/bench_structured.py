"""Decode throughput with and without a JSON Schema (constrained decoding's cost), with drafts
(speculative decoding, the default) and without.

One session decodes --max-tokens tokens from the same prompt (a list of twelve people in JSON, to
be repeated), in rounds that alternate four modes: plain (ignore_eos, so it runs the full length)
and constrained by a nested JSON Schema (an array of people, each with a bounded name, an age, an
e-mail pattern, an address object and enum tags, long enough to fill the run), each without drafts
and with them. The runtime computes each
step's first mask on a worker thread while the forward pass runs and applies it to the logits
after; a draft is cut where the grammar refuses a token, and each draft row's mask is computed
after the row before it. The bar is a cost of at most 10% of decode tok/s, schema against plain
with the same drafting. Also printed: what computing the masks alone takes per token (the
generated tokens replayed through a fresh matcher), i.e. the work the overlap hides.

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
NAMES = ["Ada Byron", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov", "Donald Knuth",
         "Frances Allen", "John Backus", "Niklaus Wirth", "Karen Jones", "Ken Thompson", "Leslie Lamport"]
CITIES = ["London", "Manchester", "New York", "Rotterdam", "Boston", "Stanford"]
PEOPLE = {"people": [
    {"name": name, "age": 30 + 3 * i, "email": f"{name.split()[0].lower()}@example.com",
     "address": {"city": CITIES[i % len(CITIES)], "zip": f"{10101 + 1234 * i:05d}"},
     "tags": [["friend", "family", "work"][i % 3], *(["work"] if i % 3 != 2 else [])]}
    for i, name in enumerate(NAMES)]}
# A reply that copies its context, as structured output often does (records extracted, a list
# reformatted), so that drafts exist in both modes. The texts differ (the 135M model indents its
# plain JSON and drifts from the list where the schema holds it to it): with drafts, the ratio
# carries how well each text drafts as well as the constraint's cost (the tokens/step columns).
PROMPT = f"Here are the people I know:\n{json.dumps(PEOPLE)}\nRepeat the list exactly, as JSON."


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


MODES = {  # name -> sampling arguments
    "plain": {"ignore_eos": True, "speculative": False},
    "schema": {"json_schema": SCHEMA, "speculative": False},
    "plain_drafts": {"ignore_eos": True},
    "schema_drafts": {"json_schema": SCHEMA},
}


def measure(runtime, session: str, start: int, mode: str, max_tokens: int) -> dict:
    """One generation of a mode from the session's prompt (rewound after): its figures."""
    cpu = time.process_time()  # all threads: the forward and the masks (steadier than wall time when busy)
    result = call(runtime, "session.generate", session_id=session, max_tokens=max_tokens, temperature=0,
                  stream=False, **MODES[mode])
    cpu_ms = (time.process_time() - cpu) / len(result["token_ids"]) * 1000
    call(runtime, "session.rewind", session_id=session, tokens=start)
    usage = result["usage"]
    row = {mode: usage["decode_tok_s"], f"{mode}_cpu_ms": round(cpu_ms, 2),
           f"{mode}_tokens": len(result["token_ids"]), f"{mode}_ids": result["token_ids"],
           f"{mode}_per_step": round((len(result["token_ids"]) - 1) / max(usage["decode_steps"], 1), 2)}
    if mode == "schema":  # the same tokens as with drafts (greedy)
        row["mask_us"] = round(mask_cost(runtime, result["token_ids"]), 1)
    if "json_schema" in MODES[mode] and result["finish_reason"] == "stop":
        json.loads(result["text"])  # a complete constrained text is JSON
    return row


def rounds(runtime, args) -> list[dict]:
    session = call(runtime, "session.open", system="You write JSON.")["session_id"]
    call(runtime, "session.append", session_id=session, message={"role": "user", "content": PROMPT})
    start = call(runtime, "session.info", session_id=session)["tokens"]
    results = []
    for index in range(args.rounds + 1):  # round 0 warms up (the matcher's tokenizer is built then)
        row = {}
        for mode in list(MODES)[:: 1 if index % 2 else -1]:
            row.update(measure(runtime, session, start, mode, args.max_tokens))
        texts = {mode: row.pop(f"{mode}_ids") for mode in MODES}
        row["same_text"] = all(texts[f"{mode}_drafts"] == texts[mode] for mode in ("plain", "schema"))  # drafts or not
        row["ratio"] = round(row["schema"] / row["plain"], 3)
        row["ratio_drafts"] = round(row["schema_drafts"] / row["plain_drafts"], 3)
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
    from ellmd.runtime.store.lmdb import Store

    engine = Engine(args.model_path or builtin_model_path(), sequence_length=2048, batch_size=1, threads=args.threads)
    report = {"model": engine.model_path.name, "threads": engine.threads, "max_tokens": args.max_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        runtime = Runtime(engine, store, snapshot_every_turn=False)

        def run_rounds():
            try:
                report["rounds"] = rounds(runtime, args)
            finally:
                runtime.stop()

        threading.Thread(target=run_rounds, daemon=True).start()
        runtime.run()  # on this thread, which warmed the kernels up (see Runtime.run)
        store.close()
    rows = report["rounds"]
    for key in (key for key in rows[0] if key != "same_text"):
        report[f"median_{key}"] = round(statistics.median(r[key] for r in rows), 3)
    for mode in MODES:  # the round least slowed by other processes, per mode
        report[f"best_{mode}"] = max(r[mode] for r in rows)
    report["best_ratio"] = round(report["best_schema"] / report["best_plain"], 3)
    report["best_ratio_drafts"] = round(report["best_schema_drafts"] / report["best_plain_drafts"], 3)
    report["cost_pct"] = round((1 - report["median_ratio"]) * 100, 1)
    report["cost_drafts_pct"] = round((1 - report["median_ratio_drafts"]) * 100, 1)
    report["same_text"] = all(r["same_text"] for r in rows)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print_table(report, engine.threads, args.max_tokens)


def print_table(report: dict, threads: int, max_tokens: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report['model']}: decode tok/s without a JSON Schema and with one, without drafts and "
                        f"with them ({threads} threads, {max_tokens} tokens, interleaved rounds)")
    columns = {"plain": "plain", "schema": "schema", "ratio": "schema/plain", "plain_drafts": "plain+drafts",
               "schema_drafts": "schema+drafts", "ratio_drafts": "schema/plain +drafts",
               "plain_drafts_per_step": "tok/step plain+d", "schema_drafts_per_step": "tok/step schema+d",
               "mask_us": "masks alone µs/tok"}
    table.add_column("round", justify="right")
    for title in columns.values():
        table.add_column(title, justify="right")
    for i, r in enumerate(report["rounds"], start=1):
        table.add_row(str(i), *(str(r[c]) for c in columns))
    table.add_row("median", *(str(report[f"median_{c}"]) for c in columns))
    table.add_row("best", *(str(report.get(f"best_{c}", "")) for c in columns))
    Console(width=max(Console().width, 150)).print(table)
    print(f"a JSON Schema costs {report['cost_pct']}% of decode tok/s without drafts, {report['cost_drafts_pct']}% "
          f"with them (medians of {len(report['rounds'])} rounds; bar: 10%); drafts "
          f"{'left the text as it was' if report['same_text'] else 'CHANGED THE TEXT'}")


if __name__ == "__main__":
    main()
