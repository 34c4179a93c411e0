"""Speculative decoding from the session's history: a code edit, plain against speculative decoding.

A session holds a Python file of this repository (cut to about --tokens tokens) in a user message
asking for the whole file back with one small change, and the reply's opening (a code fence and the
file's first line: the built-in 135M model copies the file from there, with drifts of its own,
where it would otherwise describe it); each round forks it (its KV copied: no prefill) and
generates greedily, with drafts (`speculative: true`) and without, the two modes
alternating round by round in one process, on the built-in SmolLM2 model by default. The table
gives each mode's decode speed (tokens per second after the first, the runtime's own figure), the
drafts' acceptance rate, the tokens a decode step gave on average, the speed-up of the best rounds
(a round slowed by another process on the machine does not count) and whether every speculative
text equals the plain one.

    .venv/bin/python scripts/bench_speculative.py
    .venv/bin/python scripts/bench_speculative.py --rounds 3 --threads 2 --draft-tokens 4 8 16
    .venv/bin/python scripts/bench_speculative.py --ngram 1 3 --max-tokens 512
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUEST = ("Here is a Python file.\n```python\n{source}```\nReturn it with the function `{old}` renamed to "
           "`{new}`.")


def call(runtime, op, **args):
    return runtime.submit(op, args).future.result()


def source_of(engine, path: Path, tokens: int) -> str:
    """The file's first lines, up to about `tokens` tokens."""
    lines, count = [], 0
    for line in path.read_text().splitlines(keepends=True):
        count += len(engine.tokenizer.encode(line))
        if count > tokens:
            break
        lines.append(line)
    return "".join(lines)


def rounds(runtime, base: str, args, modes: list[tuple[str, dict]]) -> dict:
    """Fork the base session and generate once per mode, round after round; results by mode."""
    results = {name: [] for name, _ in modes}
    for index in range(args.rounds):
        for name, options in modes:
            fork = call(runtime, "session.fork", session_id=base)["session_id"]
            result = call(runtime, "session.generate", session_id=fork, max_tokens=args.max_tokens,
                          temperature=0.0, stream=False, **options)
            call(runtime, "session.delete", session_id=fork)
            usage = result["usage"]
            results[name].append((result["text"], usage))
            print(f"round {index + 1} {name}: {usage['generated_tokens']} tokens, {usage['decode_tok_s']} tok/s, "
                  f"accepted {usage['accepted_tokens']}/{usage['draft_tokens']}", file=sys.stderr)
    return results


def table(engine, args, results: dict, prompt_tokens: int):
    from rich.table import Table

    plain_texts = {text for text, _ in results["plain"]}
    plain_speed = max(u["decode_tok_s"] for _, u in results["plain"])
    out = Table(title=f"{engine.model_path.name}: a {prompt_tokens}-token code edit, greedy, {engine.threads} threads, "
                      f"{args.rounds} rounds per mode, interleaved")
    for column in ("mode", "tokens", "decode tok/s (best round)", "acceptance", "tokens per step", "speed-up",
                   "text as plain"):
        out.add_column(column, justify="right")
    for name, runs in results.items():
        usages = [u for _, u in runs]
        speed = max(u["decode_tok_s"] for u in usages)
        drafted, accepted = sum(u["draft_tokens"] for u in usages), sum(u["accepted_tokens"] for u in usages)
        steps = sum(u["decode_steps"] for u in usages)
        per_step = sum(u["generated_tokens"] - 1 for u in usages) / max(steps, 1)
        same = all(text in plain_texts for text, _ in runs) and len(plain_texts) == 1
        out.add_row(name, str(usages[0]["generated_tokens"]), f"{speed:.1f}",
                    f"{accepted / drafted:.1%}" if drafted else "-", f"{per_step:.2f}",
                    f"{speed / plain_speed:.2f}x", "yes" if same else "NO")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="default: the built-in SmolLM2-135M-Instruct")
    parser.add_argument("--file", type=Path, default=ROOT / "ellmd/runtime/turns.py")
    parser.add_argument("--rename", nargs=2, default=("snapshot_of", "state_of"), metavar=("OLD", "NEW"))
    parser.add_argument("--tokens", type=int, default=2000, help="the file cut to about this many tokens")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the file's tokens and 64")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--draft-tokens", type=int, nargs="*", default=[],
                        help="speculative modes with these longest drafts (default: the daemon's)")
    parser.add_argument("--ngram", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                        help="tuning: the n-gram sizes looked up (drafts.NGRAM_MIN/MAX in this process)")
    parser.add_argument("--show", action="store_true", help="print the plain text")
    args = parser.parse_args()

    from rich.console import Console

    from ellmd.engine import Engine
    from ellmd.runtime import drafts
    from ellmd.runtime.runtime import Runtime
    from ellmd.runtime.store.lmdb import Store

    if args.ngram:
        drafts.NGRAM_MIN, drafts.NGRAM_MAX = args.ngram
    engine = Engine(args.model_path, sequence_length=8192, batch_size=3, threads=args.threads)
    source = source_of(engine, args.file, args.tokens)
    args.max_tokens = args.max_tokens or len(engine.tokenizer.encode(source)) + 64
    modes = [("plain", {"speculative": False})]
    modes += [(f"draft {k}", {"draft_tokens": k}) for k in args.draft_tokens] or [("speculative", {})]
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        runtime = Runtime(engine, store, snapshot_every_turn=False)

        def measure():
            try:
                base = call(runtime, "session.open", title="code edit")["session_id"]
                content = REQUEST.format(source=source, old=args.rename[0], new=args.rename[1])
                prompt = engine.chat_template.render([{"role": "user", "content": content}], add_generation_prompt=True)
                prompt += "```python\n" + source.splitlines(keepends=True)[0]
                report["prompt"] = call(runtime, "session.append", session_id=base,
                                        tokens=engine.tokenizer.encode(prompt))["tokens"]
                report["results"] = rounds(runtime, base, args, modes)
            finally:
                runtime.stop()

        threading.Thread(target=measure, daemon=True).start()
        runtime.run()  # on this thread, which warmed the kernels up (see Runtime.run)
        store.close()
    if args.show:
        print(report["results"]["plain"][0][0])
    Console().print(table(engine, args, report["results"], report["prompt"]))


if __name__ == "__main__":
    main()
