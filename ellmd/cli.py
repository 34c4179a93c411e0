"""`ellmd`: the daemon-side command line (generate, bench; the daemon commands come with the runtime)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from ellmd.errors import EllmError

app = typer.Typer(
    help="ellm daemon side: run models on the CPU from a preallocated KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ModelPath = typer.Option(None, "--model-path", "-m", help="HF checkpoint directory or .gguf file [default: built-in SmolLM2-135M-Instruct]")
WeightDtype = typer.Option(None, help="Weight precision in memory: bf16, f16 or f32 [default: the checkpoint's own; bf16 for quantized GGUF]")
KvDtype = typer.Option("bf16", help="KV cache precision: bf16, f16 or f32")
Threads = typer.Option(None, help="Kernel and BLAS threads [default: all cores]")
ChunkSize = typer.Option(512, help="Tokens per forward pass in prefill (activation buffers are sized for it)")


def fail(message: str, code: int = 1):
    typer.echo(f"ellmd: error: {message}", err=True)
    raise typer.Exit(code)


def load_engine(model_path, *, weight_dtype, kv_dtype, sequence_length, batch_size, chunk_size, threads, quiet=False):
    """Build an Engine with a progress display on stderr and print its memory budget."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ellmd.engine import Engine

    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description:<18}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=console, transient=False, disable=quiet,
    ) as bars:
        tasks = {}

        def progress(phase, done, total):
            if phase not in tasks:
                tasks[phase] = bars.add_task(phase, total=total)
            bars.update(tasks[phase], completed=done, total=total)

        engine = Engine(
            model_path, weight_dtype=weight_dtype, kv_dtype=kv_dtype, sequence_length=sequence_length,
            batch_size=batch_size, chunk_size=chunk_size, threads=threads, progress=progress,
        )
    if not quiet:
        console.print(describe_engine(engine), highlight=False)
    return engine


def format_name(fmt: int) -> str:
    from ellmd.kernels.formats import FORMAT_NAMES

    return {v: k for k, v in FORMAT_NAMES.items()}[fmt]


def describe_engine(engine) -> str:
    budget, spec, kv = engine.memory_budget(), engine.spec, engine.kv
    mib = 2**20
    return (
        f"model     {engine.model_path.name}: {spec.model_type}, {spec.num_hidden_layers} layers, "
        f"hidden {spec.hidden_size}, vocab {spec.vocab_size}\n"
        f"memory    weights {budget['weights'] / mib:.1f} MiB ({format_name(engine.fmt)}) + "
        f"KV {budget['kv'] / mib:.1f} MiB ({budget['kv_bytes_per_token']} B/token x {kv.sequence_length} tokens "
        f"x {kv.slots} slots, {format_name(kv.fmt)}) + workspace {budget['workspace'] / mib:.1f} MiB\n"
        f"start-up  load {engine.timings['load']:.1f}s, KV commit {engine.timings['kv_commit']:.1f}s, "
        f"kernel compile {engine.timings['compile']:.1f}s, {engine.threads} threads"
    )


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt: a user message, or plain text with --raw"),
    model_path: Optional[Path] = ModelPath,
    raw: bool = typer.Option(False, help="Plain completion: no chat template"),
    system: Optional[str] = typer.Option(None, help="System message (chat mode)"),
    max_tokens: int = typer.Option(128, help="Tokens to generate at most"),
    temperature: float = typer.Option(0.0, help="0 is greedy"),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass"),
    top_k: int = typer.Option(0, help="Sample among the k most likely tokens (0: all)"),
    min_p: float = typer.Option(0.0, help="Drop tokens below min_p x the top probability"),
    repetition_penalty: float = typer.Option(1.0, help="Penalise tokens already in the prompt or output"),
    seed: Optional[int] = typer.Option(None, help="Random seed, for reproducible sampling"),
    stop: list[str] = typer.Option([], help="Stop string (repeatable)"),
    weight_dtype: Optional[str] = WeightDtype,
    kv_dtype: str = KvDtype,
    threads: Optional[int] = Threads,
    chunk_size: int = ChunkSize,
    sequence_length: Optional[int] = typer.Option(None, help="KV capacity [default: prompt + max tokens]"),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object: text, token_ids, prompt_token_ids, timings"),
):
    """One-shot generation, streamed to stdout (or one JSON object with --json)."""
    from ellmd.engine import SamplingParams
    from ellmd.text.detokenizer import IncrementalDetokenizer, StopMatcher

    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            repetition_penalty=repetition_penalty, seed=seed, stop=stop,
        )
    except ValueError as e:
        fail(str(e))
    try:
        engine = load_engine(
            model_path, weight_dtype=weight_dtype, kv_dtype=kv_dtype, sequence_length=sequence_length or 4096,
            batch_size=1, chunk_size=chunk_size, threads=threads, quiet=json_output,
        )
        tokenizer = engine.tokenizer
        if raw:
            prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
        else:
            if engine.chat_template is None:
                fail(f"{engine.model_path.name} has no chat template: use --raw")
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            text = engine.chat_template.render(messages, add_generation_prompt=True)
            prompt_ids = tokenizer.encode(text)
        detok, stopper = IncrementalDetokenizer(tokenizer, skip_special_tokens=True), StopMatcher(stop)
        generated, pieces = [], []
        start = time.perf_counter()
        first = None
        for token in engine.generate(0, prompt_ids, params):
            first = first or time.perf_counter()
            generated.append(token)
            pieces.append(stopper.push(detok.push(token)))
            if not json_output:
                sys.stdout.write(pieces[-1])
                sys.stdout.flush()
            if stopper.hit:
                break
        pieces.append(stopper.push(detok.flush()) + stopper.flush())
        if not json_output:
            sys.stdout.write(pieces[-1])
        end = time.perf_counter()
    except EllmError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted", 130)
    decode_time = end - (first or end)
    timings = {
        "prefill_s": round((first or end) - start, 4),
        "decode_tok_s": round((len(generated) - 1) / decode_time, 2) if len(generated) > 1 and decode_time > 0 else None,
    }
    if json_output:
        print(json.dumps({"text": "".join(pieces), "token_ids": generated, "prompt_token_ids": list(map(int, prompt_ids)),
                          "timings": timings}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        typer.echo(f"[{len(prompt_ids)} prompt tokens, prefill {timings['prefill_s']:.2f}s; {len(generated)} tokens at "
                   f"{timings['decode_tok_s'] or 0:.1f} tok/s]", err=True)


@app.command()
def bench(
    model_path: Optional[Path] = ModelPath,
    config: Optional[Path] = typer.Option(None, help="Synthetic model: random weights at the shapes of this config.json"),
    layers: Optional[int] = typer.Option(None, help="With --config: keep only this many layers (to fit big models)"),
    prefill: str = typer.Option("512,2048", help="Prompt sizes to time, comma-separated"),
    decode: int = typer.Option(128, help="Tokens to decode (0 to skip)"),
    context: int = typer.Option(512, help="Tokens already in the slot when decoding starts"),
    repetitions: int = typer.Option(3, help="Runs of each test"),
    weight_dtype: Optional[str] = WeightDtype,
    kv_dtype: str = KvDtype,
    threads: Optional[int] = Threads,
    chunk_size: int = ChunkSize,
    json_output: bool = typer.Option(False, "--json", help="Print the rows as JSON"),
):
    """Prefill and decode throughput (tok/s) of a model path, the built-in model or a synthetic model."""
    from rich.console import Console

    from ellmd.bench import render_table, run_bench
    from ellmd.model.weights import RandomCheckpoint

    try:
        sizes = [int(s) for s in prefill.split(",") if s.strip()]
    except ValueError:
        fail(f"--prefill takes comma-separated integers, not {prefill!r}")
    if model_path and config:
        fail("give --model-path or --config, not both")
    try:
        source = RandomCheckpoint(config, layers=layers) if config else model_path
        engine = load_engine(
            source, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
            sequence_length=max(sizes + [context + decode]), batch_size=1, chunk_size=chunk_size,
            threads=threads, quiet=json_output,
        )
        rows = run_bench(engine, sizes, decode, context, repetitions)
    except EllmError as e:
        fail(str(e))
    info = {"model": engine.model_path.name, "weight_dtype": format_name(engine.fmt), "kv_dtype": kv_dtype,
            "threads": engine.threads}
    if json_output:
        print(json.dumps([{**info, **row} for row in rows]))
    else:
        title = f"{info['model']} | weights {info['weight_dtype']} | KV {kv_dtype} | {engine.threads} threads"
        Console().print(render_table(rows, title))


if __name__ == "__main__":
    app()
