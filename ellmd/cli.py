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
    rich_markup_mode=None,  # help strings are plain text: "[default: ...]" and "ellm[ray]" must not be read as markup
)

ModelPath = typer.Option(None, "--model-path", "-m", help="HF checkpoint directory or .gguf file [default: built-in SmolLM2-135M-Instruct]")
WeightDtype = typer.Option(
    None,
    help="Weights in memory: bf16, f16 or f32 (quantized GGUF tensors dequantized to it), or q8_0, q4_0, q4_k "
    "(float weights quantized at load; q4_k falls back to q5_0 for widths 256 does not divide) "
    "[default: the checkpoint's own; a GGUF keeps its blocks]",
)
KvDtype = typer.Option("bf16", help="KV cache format: bf16, f16, f32, q8_0 or q4_0 (Hadamard-rotated), "
                        "q8_0-plain or q4_0-plain (not rotated), or keys/values in two block formats "
                        "(q8_0/q4_0: q8_0 keys, q4_0 values)")
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
    from ellmd.kernels.kv_blocks import format_name

    return format_name(fmt)


def describe_engine(engine) -> str:
    budget, spec, kv = engine.memory_budget(), engine.spec, engine.kv
    mib = 2**20
    by_format = ", ".join(f"{k.split(':')[1]} {v / mib:.1f}" for k, v in budget.items() if k.startswith("weights:"))
    calibrated = ""
    if "calibrate" in engine.timings:  # q4_0 keys: their mean key, a prefill of a fixed text (calibration.py)
        from ellmd.engine.calibration import TOKENS

        how = "read from the cache" if engine.key_mean_cached else f"calibrated ({TOKENS} tokens, cached for later starts)"
        calibrated = f", q4_0 keys' mean {how} in {engine.timings['calibrate']:.1f}s"
    return (
        f"model     {engine.model_path.name}: {spec.model_type}, {spec.num_hidden_layers} layers, "
        f"hidden {spec.hidden_size}, vocab {spec.vocab_size}\n"
        f"memory    weights {budget['weights'] / mib:.1f} MiB ({by_format}) + "
        f"KV {budget['kv'] / mib:.1f} MiB ({budget['kv_bytes_per_token']} B/token x {kv.sequence_length} tokens "
        f"x {kv.slots} slots, {format_name(kv.fmt)}) + workspace {budget['workspace'] / mib:.1f} MiB\n"
        f"{describe_capacity(engine)}\n"
        f"start-up  load {engine.timings['load']:.1f}s, KV commit {engine.timings['kv_commit']:.1f}s, "
        f"kernel compile {engine.timings['compile']:.1f}s, {engine.threads} threads{calibrated}\n"
        f"kernels   {engine.describe_kernels()}"
    )


def describe_capacity(engine) -> str:
    """Tokens per GiB and sessions of the configured length that this KV memory would hold, per KV format."""
    from ellmd.engine.kvcache import capacity

    spec, kv = engine.spec, engine.kv
    formats = capacity(spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim, kv.sequence_length, kv.nbytes)
    return "capacity  " + "; ".join(
        f"{name} {c['tokens_per_gib']:,} tokens/GiB, {c['sessions_in_memory']} x {kv.sequence_length}"
        for name, c in formats.items()) + " (sessions in this KV memory)"


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
    append: str = typer.Option("", help="Turns to time, N@C comma-separated: N tokens prefilled on top of a slot "
                               "holding C (e.g. 256@0,256@8000: a turn's cost as the session grows)"),
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

    from ellmd.bench import parse_appends, render_table, run_bench
    from ellmd.model.weights import RandomCheckpoint

    try:
        sizes = [int(s) for s in prefill.split(",") if s.strip()]
    except ValueError:
        fail(f"--prefill takes comma-separated integers, not {prefill!r}")
    try:
        appends = parse_appends(append)
    except ValueError as e:
        fail(f"--append: {e}")
    if model_path and config:
        fail("give --model-path or --config, not both")
    try:
        source = RandomCheckpoint(config, layers=layers) if config else model_path
        engine = load_engine(
            source, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
            sequence_length=max(sizes + [n + held for n, held in appends] + [context + decode]), batch_size=1,
            chunk_size=chunk_size,
            threads=threads, quiet=json_output,
        )
        rows = run_bench(engine, sizes, decode, context, repetitions, appends)
    except EllmError as e:
        fail(str(e))
    info = {"model": engine.model_path.name, "weight_dtype": engine.weight_formats, "kv_dtype": kv_dtype,
            "threads": engine.threads}
    if json_output:
        print(json.dumps([{**info, **row} for row in rows]))
    else:
        title = f"{info['model']} | weights {info['weight_dtype']} | KV {kv_dtype} | {engine.threads} threads"
        Console().print(render_table(rows, title))


def daemon_settings(config, flags):
    from ellmd.server.config import load_settings

    try:
        return load_settings(config, flags)
    except EllmError as e:
        fail(str(e))


ConfigFile = typer.Option(None, "--config", help="TOML settings file (see config/ellmd.toml) [default: $XDG_CONFIG_HOME/ellm/ellmd.toml if present]")
SocketPath = typer.Option(None, "--socket", help="Unix socket [default: $XDG_RUNTIME_DIR/ellm/ellmd.sock]")


@app.command()
def perplexity(
    text_file: Optional[Path] = typer.Option(
        None, "--file", "-f", help="The text to score [default: the Python docs' topics (pydoc_data), on every machine]"),
    model_path: Optional[Path] = ModelPath,
    context: int = typer.Option(2048, "--context", "-c", help="Tokens per window (the model sees at most this many)"),
    stride: Optional[int] = typer.Option(None, help="Tokens between window starts [default: context / 2]"),
    max_tokens: Optional[int] = typer.Option(None, help="Score only the text's first N tokens"),
    weight_dtype: Optional[str] = WeightDtype,
    kv_dtype: str = KvDtype,
    threads: Optional[int] = Threads,
    chunk_size: int = ChunkSize,
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object: perplexity, stderr, tokens, windows"),
):
    """Perplexity of the model on a text, over sliding windows (as llama-perplexity): exp(mean NLL) +- its standard error."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from ellmd import perplexity as ppl

    stride = stride or max(context // 2, 1)
    try:
        ppl.windows(2, context, stride)
        text = ppl.read_text(text_file)
    except (ValueError, OSError) as e:
        fail(str(e))
    try:
        engine = load_engine(model_path, weight_dtype=weight_dtype, kv_dtype=kv_dtype, sequence_length=context,
                             batch_size=1, chunk_size=chunk_size, threads=threads, quiet=json_output)
        tokens = engine.tokenizer.encode(text, add_special_tokens=True)[:max_tokens]
        with Progress(TextColumn("scoring"), BarColumn(), TextColumn("{task.completed}/{task.total} tokens"),
                      TimeRemainingColumn(), console=Console(stderr=True), disable=json_output) as bars:
            task = bars.add_task("scoring", total=max(len(tokens) - 1, 1))
            result = ppl.perplexity(engine, tokens, context, stride, lambda done, total: bars.update(task, completed=done))
    except (EllmError, ValueError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted", 130)
    if json_output:
        print(json.dumps({**result.__dict__, "context": context, "stride": stride}))
    else:
        typer.echo(f"perplexity {result.perplexity:.4f} +- {result.stderr:.4f} ({result.tokens_scored} tokens scored, "
                   f"{result.windows} windows of {context} every {stride}, KV {kv_dtype})")


@app.command()
def start(
    model_path: Optional[str] = ModelPath,
    chunk_size: Optional[int] = typer.Option(None, help="Tokens per prefill forward pass [default: 512]"),
    gap_ratio: Optional[float] = typer.Option(
        None, help="While sessions generate, a prefill's tokens ride their decode steps, as many as add about this "
                   "many times a step's own time: lower keeps their tokens flowing, higher ends the prefill sooner "
                   "[default: 1.0]"),
    sequence_length: Optional[int] = typer.Option(None, help="KV capacity of each slot, in tokens [default: 8192]"),
    batch_size: Optional[int] = typer.Option(None, help="KV slots: sessions resident at once [default: 4]"),
    kv_dtype: Optional[str] = typer.Option(None, help="KV cache format: bf16, f16, f32, q8_0, q4_0 (rotated), q8_0-plain, "
                                                      "q4_0-plain, or keys/values in two block formats, e.g. q8_0/q4_0 "
                                                      "[default: bf16]"),
    weight_dtype: Optional[str] = WeightDtype,
    threads: Optional[int] = Threads,
    socket: Optional[str] = SocketPath,
    store: Optional[str] = typer.Option(None, help="Session store directory [default: $XDG_DATA_HOME/ellm/store]"),
    store_backend: Optional[str] = typer.Option(
        None, help="How the store keeps sessions: 'lmdb' (one LMDB environment, local disk) or 'directory' (a "
                   "directory per session, for a filesystem several nodes mount) [default: lmdb]"),
    replica: Optional[str] = typer.Option(
        None, help="Run as this replica of a fleet: the store is shared with the other replicas, each session "
                   "leased to one of them at a time (without it, one daemon holds the whole store)"),
    lease_ttl_s: Optional[float] = typer.Option(
        None, help="Seconds a replica's session lease lasts unless renewed (renewed every third of it) [default: 10]"),
    snapshot_ack: Optional[str] = typer.Option(
        None, help="When a turn is acknowledged: 'written' (its snapshot is on disk) or 'queued' "
                   "(handed to the store's writer; a crash may lose the last turns) [default: written]"),
    http: Optional[str] = typer.Option(
        None, help="Also serve the OpenAI-compatible HTTP API on HOST:PORT (or :PORT, PORT: host 127.0.0.1)"),
    skills_dir: Optional[list[str]] = typer.Option(
        None, help="A skill root: a directory whose sub-directories hold a SKILL.md (repeatable)"),
    rag_dir: Optional[str] = typer.Option(
        None, help="Where retrieval indexes are kept [default: $XDG_DATA_HOME/ellm/rag]"),
    api_key: Optional[str] = typer.Option(
        None, help="HTTP API key clients send as Authorization: Bearer (needed to listen beyond loopback; "
                   "ELLMD_API_KEY or --api-key-file keep it out of the process list)"),
    api_key_file: Optional[str] = typer.Option(None, help="A file of HTTP API keys, one per line"),
    max_connections: Optional[int] = typer.Option(None, help="Unix-socket connections at once [default: 64]"),
    max_in_flight: Optional[int] = typer.Option(None, help="Requests in flight on one connection [default: 64]"),
    max_queue: Optional[int] = typer.Option(
        None, help="Engine requests waiting or running, both transports; beyond: busy / HTTP 429 [default: 256]"),
    max_upload_mb: Optional[int] = typer.Option(
        None, help="Largest chunked session.import, MiB [default: 0, the blob of a full slot]"),
    hello_timeout_s: Optional[float] = typer.Option(None, help="Seconds a connection may take to send hello [default: 10]"),
    frame_timeout_s: Optional[float] = typer.Option(None, help="Seconds a frame may stay half-sent [default: 30]"),
    max_write_buffer_mb: Optional[int] = typer.Option(
        None, help="Output waiting for a client that does not read, MiB, before it is dropped [default: 32]"),
    write_timeout_s: Optional[float] = typer.Option(
        None, help="Seconds an export waits for its client to read each piece [default: 60]"),
    http_max_connections: Optional[int] = typer.Option(
        None, help="HTTP connections at once, idle keep-alive ones too (with API keys: per key); beyond: 503 "
                   "[default: 64]"),
    http_max_body_mb: Optional[int] = typer.Option(None, help="Largest HTTP request body, MiB [default: 16]"),
    http_read_timeout_s: Optional[float] = typer.Option(
        None, help="Seconds to receive an HTTP request's headers and body; idle keep-alive [default: 60]"),
    max_render_kb: Optional[int] = typer.Option(None, help="Longest chat-template rendering, KiB [default: 4096]"),
    config: Optional[Path] = ConfigFile,
    detach: bool = typer.Option(False, help="Run in the background (pid and log files beside the socket)"),
):
    """Start the daemon: load the model, commit the KV cache, serve sessions on the Unix socket.

    Settings come from the defaults, then the config file, then these flags, then ELLMD_* variables.
    """
    import logging

    from ellmd.server import daemon

    flags = dict(model_path=model_path, chunk_size=chunk_size, gap_ratio=gap_ratio, sequence_length=sequence_length,
                 batch_size=batch_size, kv_dtype=kv_dtype, weight_dtype=weight_dtype, threads=threads,
                 socket=socket, store=store, store_backend=store_backend, replica=replica, lease_ttl_s=lease_ttl_s,
                 snapshot_ack=snapshot_ack, http=http, skills_dir=skills_dir or None, rag_dir=rag_dir,
                 api_key=api_key, api_key_file=api_key_file, max_connections=max_connections,
                 max_in_flight=max_in_flight, max_queue=max_queue, max_upload_mb=max_upload_mb,
                 hello_timeout_s=hello_timeout_s, frame_timeout_s=frame_timeout_s,
                 max_write_buffer_mb=max_write_buffer_mb, write_timeout_s=write_timeout_s,
                 http_max_connections=http_max_connections, http_max_body_mb=http_max_body_mb, http_read_timeout_s=http_read_timeout_s,
                 max_render_kb=max_render_kb)
    settings = daemon_settings(config, flags)
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if detach:
            argv = [a for a in sys.argv[2:] if a != "--detach"]
            raise typer.Exit(daemon.detach(argv, settings))
        progress = progress_logger()
        raise typer.Exit(daemon.run(settings, progress))
    except EllmError as e:
        fail(str(e))


def progress_logger():
    """Start-up progress as log lines (the daemon logs to stderr or its log file)."""
    import logging

    log, shown = logging.getLogger("ellmd"), {}

    def progress(phase, done, total):
        step = max(1, total // 4)
        if done == total or done % step == 0 and shown.get(phase) != done:
            shown[phase] = done
            log.info("%s %d/%d", phase, done, total)

    return progress


def connect(socket, config):
    from ellm import Client
    from ellm.errors import DaemonNotRunning

    settings = daemon_settings(config, {"socket": socket})
    try:
        return Client(settings.socket_path)
    except DaemonNotRunning as e:
        fail(str(e), 2)


@app.command()
def stop(socket: Optional[str] = SocketPath, config: Optional[Path] = ConfigFile,
         timeout: float = typer.Option(60.0, help="Seconds to wait for the daemon to exit")):
    """Stop the daemon gracefully: generations end, every resident session is snapshotted."""
    from ellmd.server.daemon import cleanup_pid, wait_gone

    settings = daemon_settings(config, {"socket": socket})
    client = connect(socket, config)
    client.shutdown()
    if not wait_gone(settings.socket_path, timeout):
        fail(f"the daemon did not exit within {timeout:.0f}s")
    cleanup_pid(settings)
    typer.echo("ellmd stopped")


@app.command()
def status(socket: Optional[str] = SocketPath, config: Optional[Path] = ConfigFile,
           json_output: bool = typer.Option(False, "--json", help="Print the raw stats as JSON")):
    """Model, capacity, sessions resident and stored, uptime."""
    from rich.console import Console
    from rich.table import Table

    stats = connect(socket, config).stats()
    if json_output:
        print(json.dumps(stats))
        return
    mib = 2**20
    table = Table(show_header=False, title="ellmd")
    rows = [
        ("model", f"{stats['model']} ({stats['model_type']})"),
        ("capacity", f"{stats['slots']} slots x {stats['sequence_length']} tokens"),
        ("KV", f"{stats['kv_bytes_used'] / mib:.1f} MiB used, {stats['kv_bytes_free'] / mib:.1f} MiB free "
               f"({stats['kv_bytes_per_token']} B/token, {stats.get('kv_dtype', 'bf16')})"),
        *[(f"KV {name}", f"{c['tokens_per_gib']:,} tokens/GiB; sessions of {stats['sequence_length']} tokens: "
                         f"{c['sessions_in_memory']} in this memory, {c['sessions_on_disk']} on the store's disk")
          for name, c in stats.get("kv_capacity", {}).items()],
        ("sessions", f"{stats['sessions_resident']} resident, {stats['sessions_stored']} stored, "
                     f"{stats['generating']} generating"),
        ("uptime", f"{stats['uptime_s']:.0f}s"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)


fleet_app = typer.Typer(help="A fleet of daemon replicas on Ray Serve (install the extra: pip install 'ellm[ray]').",
                        no_args_is_help=True, rich_markup_mode=None)
app.add_typer(fleet_app, name="fleet")


@fleet_app.command("start")
def fleet_start(
    replicas: int = typer.Option(2, min=1, help="Daemon replicas, each its own process with its own engine"),
    threads: int = typer.Option(1, min=1, help="Kernel threads per replica (Ray reserves as many CPUs for it)"),
    batch_size: int = typer.Option(4, min=1, help="KV slots per replica: sessions resident at once in each"),
    sequence_length: int = typer.Option(8192, min=1, help="KV capacity of each slot, in tokens"),
    model_path: Optional[str] = ModelPath,
    store: Optional[str] = typer.Option(
        None, help="The session store every replica reads: on one node any directory, across nodes shared "
                   "storage (with --store-backend directory) [default: $XDG_DATA_HOME/ellm/store]"),
    store_backend: str = typer.Option("lmdb", help="lmdb (one node) or directory (a shared filesystem, many nodes)"),
    http: str = typer.Option("127.0.0.1:8000", help="Where the fleet's HTTP API listens: HOST:PORT"),
    address: Optional[str] = typer.Option(
        None, help="Join this Ray cluster (e.g. auto, or HEAD:6379 after `ray start --head`) [default: a local Ray]"),
    sessions_per_replica: int = typer.Option(
        32, min=1, help="Session ids a replica keeps leased (Serve's LRU); beyond, the oldest goes to the store"),
    config: Optional[Path] = typer.Option(None, "--config", help="An ellmd.toml every replica's daemon reads"),
):
    """Run a fleet in the foreground: a Ray Serve ingress routing each session to the replica that
    holds it, N daemon replicas sharing one store. SIGTERM or Ctrl-C stops it, every session snapshotted."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        fail("the fleet needs Ray Serve: pip install 'ellm[ray]'")
    from ellmd.fleet.app import FleetSettings, run
    from ellmd.server.http.guard import listen_address

    settings = FleetSettings(replicas=replicas, threads=threads, batch_size=batch_size, sequence_length=sequence_length,
                             model_path=model_path, store=store, store_backend=store_backend,
                             sessions_per_replica=sessions_per_replica, config=str(config) if config else None)
    try:
        run(settings, listen_address(http), address, on_ready=lambda line: typer.echo(line, err=True))
    except EllmError as e:
        fail(str(e))


if __name__ == "__main__":
    app()
