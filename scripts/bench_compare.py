"""Compare ellm with llama.cpp and Hugging Face transformers: same weights, same threads, one run.

Usage (from the repository root; LLAMA_NATIVE names the folder of the native llama.cpp build):

    # the built-in SmolLM2-135M-Instruct: ellm and llama.cpp at F16/bf16, Q8_0 and Q4_K_M; transformers
    .venv/bin/python scripts/bench_compare.py --model builtin --threads 2

    # Qwen3-1.7B shapes with random weights, without transformers, keeping the GGUFs for the next run
    .venv/bin/python scripts/bench_compare.py --model tests/fixtures/configs/qwen3-1.7b.json \\
        --skip transformers --gguf-dir ~/.cache/ellm/bench-gguf --json bench.json

    # a GGUF written elsewhere (e.g. scripts/make_moe_gguf.py), measured as it is: no F16 version
    .venv/bin/python scripts/bench_compare.py --model-as-is model.Q4_K_M.gguf --skip transformers

    # a quick check that everything runs (tiny sizes)
    .venv/bin/python scripts/bench_compare.py --layers 2 --prefill 32 --decode 8 --context 32 --repetitions 2

What is measured, for every system alike (the method of `ellmd bench` and llama-bench):
  ppN   prefill of N tokens into an empty cache; logits of the last position only
  ppN@C prefill of N tokens on top of C tokens already in the cache (--append; an agent's next
        turn; llama-bench -d C; not measured for transformers)
  tgN   N greedy decode steps of one token each, after a context of C tokens prefilled untimed
  GB/s  effective weight bandwidth in decode: the bytes of weights one decode token reads (every
        matrix but the embedding table, which is read one row a token; of each MoE expert stack,
        its top_k / num_experts share) times tgN's tok/s, in the format each system holds in memory
Each test runs --repetitions times: the tables show the mean ± standard deviation of tok/s. The
systems run one after another (never at the same time), each warmed up once, with the same
thread count, and each in a process of its own where thread pools would fight: numba's workers
and torch's slowed transformers 15x in one process.

The systems and their weights (a weight format of the table is a GGUF type):
  ellm          in-process Engine (ellmd.bench.run_bench): F16 row: the same weights in --ellm-dtypes
                (bf16 default); Q8_0, Q4_K_M rows: the quantized GGUF as the loader holds it (its
                blocks; the "weights in memory" column says what they are)
  llama.cpp     native llama-bench (-fa on, n_ubatch 512, F16 KV cache) on the F16 GGUF and on the
                llama-quantize'd --quant GGUFs; built on demand into $LLAMA_NATIVE (scripts/llama_native.py,
                --build-llama; ~10-15 minutes once)
  transformers  a subprocess: the same weights in f32, then converted to bf16 (--transformers-dtypes),
                forward with use_cache=True under torch.inference_mode()

Models (--model, repeatable): `builtin` (the SmolLM2-135M-Instruct Q4_1 GGUF that ellm ships with;
its tensors are dequantized to an F16 GGUF, the source of every format), any .gguf file (same
treatment), or a config.json (random weights at its shapes, ellm's RandomCheckpoint; --layers N
keeps the first N layers). --model-as-is GGUF measures a file in its own format only (no F16
rewrite, no transformers). GGUFs go to a temporary directory unless --gguf-dir keeps them.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from ellmd.bench import parse_appends, summarize

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gguf_export and llama_native sit beside this script
import llama_native  # noqa: E402
from gguf_export import export_gguf_as_f16, export_random_gguf  # noqa: E402

# transformers' GGUF loader draws tqdm bars that no setting turns off; this script reports progress itself
os.environ.setdefault("TQDM_DISABLE", "1")

SYSTEMS = ("ellm", "llama.cpp", "transformers")
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K")
log = Console(stderr=True, soft_wrap=True)  # soft wrap: command lines stay copyable


# ---- command line -------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", metavar="builtin|GGUF|CONFIG_JSON",
                        help="model to benchmark, repeatable [default: builtin]")
    parser.add_argument("--model-as-is", action="append", metavar="GGUF", type=Path, default=[],
                        help="a GGUF measured in its own format only (ellm and llama.cpp), repeatable")
    parser.add_argument("--layers", type=int, help="keep only the first N layers of every model (to fit big configs)")
    parser.add_argument("--threads", type=int, default=2, help="threads for every system [default: 2]")
    parser.add_argument("--prefill", default="512,2048", help="prompt sizes to time, comma-separated [default: 512,2048]")
    parser.add_argument("--append", default="", metavar="N@C,...",
                        help="turns to time: N tokens prefilled on top of C held ones, e.g. 256@0,256@8000 [default: none]")
    parser.add_argument("--decode", type=int, default=128, help="tokens to decode, 0 to skip [default: 128]")
    parser.add_argument("--context", type=int, default=512, help="tokens in the cache when decoding starts [default: 512]")
    parser.add_argument("--repetitions", type=int, default=3, help="runs of each test [default: 3]")
    parser.add_argument("--quant", default="Q8_0,Q4_K_M",
                        help=f"quantized formats beside F16, comma-separated ('' for none): {', '.join(QUANT_TYPES)} "
                             "[default: Q8_0,Q4_K_M]")
    parser.add_argument("--ellm-dtypes", default="bf16", help="ellm weight dtypes of the F16 row: bf16, f16, f32 [default: bf16]")
    parser.add_argument("--kv-dtype", default="bf16", help="ellm KV cache dtype [default: bf16]")
    parser.add_argument("--chunk-size", type=int, default=512, help="ellm prefill chunk size [default: 512]")
    parser.add_argument("--transformers-dtypes", default="bf16,f32", help="comma-separated: bf16, f32 [default: bf16,f32]")
    parser.add_argument("--llama-flash-attn", action=argparse.BooleanOptionalAction, default=True,
                        help="llama.cpp flash attention [default: on]")
    parser.add_argument("--llama-repack", action=argparse.BooleanOptionalAction, default=True,
                        help="llama.cpp's repacked weight layouts (and AMX where built in) [default: on]")
    parser.add_argument("--llama-native", type=Path, default=llama_native.native_root(),
                        help="folder of the native llama.cpp build (bin/llama-bench, bin/llama-quantize) "
                             "[default: $LLAMA_NATIVE or ~/.cache/ellm/llama-native]")
    parser.add_argument("--build-llama", action="store_true",
                        help="build llama.cpp into --llama-native if it is missing (~10-15 minutes)")
    parser.add_argument("--skip", default="", help=f"systems to leave out, comma-separated: {', '.join(SYSTEMS)}")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights of config models [default: 0]")
    parser.add_argument("--gguf-dir", type=Path, help="keep the GGUFs here and reuse them [default: a temporary directory]")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    args = parser.parse_args(argv)
    args.model = args.model or ([] if args.model_as_is else ["builtin"])
    args.prefill = _int_list(parser, "--prefill", args.prefill)
    try:
        args.append = parse_appends(args.append)
    except ValueError as e:
        parser.error(f"--append: {e}")
    args.quant = _choices(parser, "--quant", args.quant, QUANT_TYPES)
    args.ellm_dtypes = _choices(parser, "--ellm-dtypes", args.ellm_dtypes, ("bf16", "f16", "f32"))
    args.transformers_dtypes = _choices(parser, "--transformers-dtypes", args.transformers_dtypes, ("bf16", "f32"))
    args.skip = set(_choices(parser, "--skip", args.skip, SYSTEMS))
    if args.repetitions < 1 or args.threads < 1 or args.context < 0 or args.decode < 0:
        parser.error("--repetitions and --threads must be >= 1, --context and --decode >= 0")
    if not args.prefill and not args.append and not args.decode:
        parser.error("nothing to measure: give --prefill sizes, --append turns or --decode > 0")
    for path in args.model_as_is:
        if not path.is_file():
            parser.error(f"--model-as-is: no such file {path}")
    return args


def _int_list(parser, flag, text) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        parser.error(f"{flag} takes comma-separated integers, not {text!r}")
    if any(v < 1 for v in values):
        parser.error(f"{flag}: sizes must be >= 1")
    return values


def _choices(parser, flag, text, allowed) -> list[str]:
    values = [s.strip() for s in text.split(",") if s.strip()]
    for value in values:
        if value not in allowed:
            parser.error(f"{flag}: unknown {value!r} (choose from {', '.join(allowed)})")
    return values


# ---- dependencies -------------------------------------------------------------------------


def require_llama_native(args) -> None:
    """The native llama.cpp binaries are there, or built now when asked (never fail 20 minutes in)."""
    if llama_native.is_built(args.llama_native):
        return
    if not args.build_llama:
        log.print(f"[red]no native llama.cpp in {args.llama_native}[/] (bin/llama-bench, bin/llama-quantize). "
                  "Rerun with --build-llama to build it there (10-15 minutes on 2 cores, once), point "
                  "LLAMA_NATIVE or --llama-native at an existing build, or leave llama.cpp out with "
                  "--skip llama.cpp --quant ''", highlight=False)
        sys.exit(2)
    llama_native.build(args.llama_native, log=lambda message: log.print(message, highlight=False))


def require_transformers() -> None:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        log.print("[red]torch and transformers are not installed[/] (development extras): "
                  "scripts/setup.sh --dev, or leave them out with --skip transformers")
        sys.exit(2)


# ---- models, their GGUFs, and tokens ------------------------------------------------------


@dataclass
class ModelCase:
    """One model to benchmark: where each system gets its weights from."""

    label: str
    kind: str  # "gguf" (a GGUF file, rewritten as F16), "random" (a config.json, random weights), "as-is" (a GGUF)
    source: Path  # the original GGUF or config.json
    gguf: Path  # the F16 GGUF (for "as-is": the file itself)
    vocab_size: int
    layers: int
    total_layers: int
    config: dict = field(default_factory=dict)  # "random" only: config.json with num_hidden_layers cut
    formats: dict[str, Path] = field(default_factory=dict)  # weight format (GGUF type) -> GGUF file


def prepare_model(name: str, args, gguf_dir: Path) -> ModelCase:
    """Resolve --model, and write (or reuse) its F16 GGUF and the llama-quantize'd ones."""
    from ellmd.engine import builtin_model_path
    from ellmd.model.weights import GGUFCheckpoint, RandomCheckpoint

    suffix = f"-L{args.layers}" if args.layers else ""
    if name == "builtin" or name.endswith(".gguf"):
        source = builtin_model_path() if name == "builtin" else Path(name)
        spec = GGUFCheckpoint(source).spec
        layers = min(args.layers or spec.num_hidden_layers, spec.num_hidden_layers)
        gguf = gguf_dir / f"{source.stem.split('.')[0]}{suffix}.F16.gguf"
        if not gguf.exists():
            log.print(f"writing {gguf} (F16, {layers} layers)", highlight=False)
            export_gguf_as_f16(source, gguf, layers=args.layers)
        case = ModelCase(source.stem.split(".")[0], "gguf", source, gguf, spec.vocab_size, layers, spec.num_hidden_layers)
    else:
        source = Path(name)
        config = json.loads(source.read_text())
        checkpoint = RandomCheckpoint(source, seed=args.seed, layers=args.layers)
        layers = checkpoint.spec.num_hidden_layers
        config["num_hidden_layers"] = layers
        config.pop("layer_types", None)  # per-layer list in newer configs; transformers rebuilds it
        gguf = gguf_dir / f"{source.stem}{suffix}-seed{args.seed}.F16.gguf"
        if not gguf.exists():
            log.print(f"writing {gguf} (random weights, F16, {layers} layers)", highlight=False)
            export_random_gguf(checkpoint, gguf)
        case = ModelCase(f"{source.stem} (random)", "random", source, gguf, checkpoint.spec.vocab_size,
                         layers, int(json.loads(source.read_text())["num_hidden_layers"]), config)
    case.formats["F16"] = gguf
    for qtype in args.quant:
        path = gguf.with_name(gguf.name.replace(".F16.gguf", f".{qtype}.gguf"))
        if not path.exists():
            log.print(f"writing {path} (llama-quantize {qtype})", highlight=False)
            llama_native.quantize(args.llama_native, gguf, path, qtype)
        case.formats[qtype] = path
    return case


def as_is_model(path: Path) -> ModelCase:
    """--model-as-is: a GGUF in its own format (named by general.file_type)."""
    from ellmd.model.weights import GGUFCheckpoint

    spec = GGUFCheckpoint(path).spec
    return ModelCase(path.stem, "as-is", path, path, spec.vocab_size, spec.num_hidden_layers, spec.num_hidden_layers,
                     formats={gguf_format_name(path): path})


def gguf_format_name(path: Path) -> str:
    """The llama.cpp file type of a GGUF (e.g. Q4_K_M), from general.file_type."""
    import gguf

    reader = gguf.GGUFReader(path)
    field_ = reader.fields.get("general.file_type")
    if field_ is None:
        return "GGUF"
    name = gguf.LlamaFileType(int(field_.contents())).name  # e.g. MOSTLY_Q4_K_M
    return name.removeprefix("MOSTLY_")


def decode_bytes(tensors, top_k: int, num_experts: int) -> int:
    """Bytes of weights one decode token reads, from (name, nbytes, is_expert_stack, is_embedding) tuples.

    The embedding table counts only when it is also the output projection (tied weights: pass it
    once, not as an embedding); an expert stack counts its top_k / num_experts share.
    """
    total = 0.0
    for _name, nbytes, expert, embedding in tensors:
        if embedding:
            continue
        total += nbytes * (top_k / num_experts if expert and num_experts else 1.0)
    return int(total)


def gguf_decode_bytes(path: Path) -> int:
    """decode_bytes of a GGUF as llama.cpp holds it (its tensors in their own types)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    experts = reader.fields.get(f"{arch}.expert_count")
    used = reader.fields.get(f"{arch}.expert_used_count")
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    tensors = [(t.name, int(t.n_bytes), "_exps." in t.name, t.name == "token_embd.weight" and not tied)
               for t in reader.tensors]
    return decode_bytes(tensors, int(used.contents()) if used else 0, int(experts.contents()) if experts else 0)


@dataclass
class BenchTokens:
    """The token ids ellm and transformers see, drawn in the order ellmd.bench.run_bench draws them."""

    prompts: dict[int, np.ndarray]  # prefill size -> ids
    contexts: list[np.ndarray]  # one decode context per repetition


def benchmark_tokens(vocab_size: int, args) -> BenchTokens:
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(0, vocab_size, n) for n in args.prefill}
    contexts = [rng.integers(0, vocab_size, max(args.context, 1)) for _ in range(args.repetitions)] if args.decode else []
    return BenchTokens(prompts, contexts)


def capacity(args) -> int:
    """Cache length every system gets: the longest prompt or turn, or context + decode (and the warm-up's 2 steps)."""
    return max(args.prefill + [n + held for n, held in args.append] + [max(args.context, 1) + max(args.decode, 2)])


def with_bandwidth(rows: list[dict], nbytes: int, args) -> dict:
    """A result: the rows, the decode bytes per token and the effective GB/s of the tg row."""
    result = {"rows": rows, "decode_bytes_per_token": nbytes}
    tg = next((row for row in rows if row["test"] == f"tg{args.decode}"), None)
    if tg is not None:
        result["decode_gb_s"] = round(nbytes * tg["tok_s"] / 1e9, 2)
    return result


# ---- the harness of ellm and transformers --------------------------------------------------


def warm_up(runner, tokens: BenchTokens, args) -> int | None:
    """One untimed prefill and two decode steps; returns the greedy token after the first context."""
    prompt = tokens.contexts[0] if tokens.contexts else tokens.prompts[min(tokens.prompts)]
    first = runner.prefill(prompt)
    token = first
    for _ in range(2):
        token = runner.decode_step(token)
    runner.reset()
    return first if tokens.contexts else None


def measure_prefill(runner, prompt: np.ndarray, repetitions: int) -> list[float]:
    """tok/s of one prefill of `prompt` into an empty cache, per repetition."""
    rates = []
    for _ in range(repetitions):
        runner.reset()
        start = time.perf_counter()
        runner.prefill(prompt)
        rates.append(len(prompt) / (time.perf_counter() - start))
    runner.reset()
    return rates


def measure_decode(runner, contexts: list[np.ndarray], steps: int) -> list[float]:
    """tok/s of `steps` greedy one-token steps after an untimed context, one context per repetition."""
    rates = []
    for context in contexts:
        runner.reset()
        token = runner.prefill(context)
        start = time.perf_counter()
        for _ in range(steps):
            token = runner.decode_step(token)
        rates.append(steps / (time.perf_counter() - start))
    runner.reset()
    return rates


def run_harness(runner, tokens: BenchTokens, args) -> list[dict]:
    rows = [summarize(f"pp{n}", n, 0, measure_prefill(runner, prompt, args.repetitions))
            for n, prompt in tokens.prompts.items()]
    if args.decode:
        rows.append(summarize(f"tg{args.decode}", args.decode, args.context,
                              measure_decode(runner, tokens.contexts, args.decode)))
    return rows


# ---- ellm ---------------------------------------------------------------------------------


class EllmRunner:
    """Slot 0 of an ellm Engine (used for the warm-up; the timing is ellmd.bench.run_bench)."""

    def __init__(self, engine):
        self.engine = engine

    def prefill(self, tokens) -> int:
        return int(np.argmax(self.engine.prefill(0, tokens, logits="last")))

    def decode_step(self, token: int) -> int:
        return int(np.argmax(self.engine.decode([0], [token])[0]))

    def reset(self) -> None:
        self.engine.rewind(0, 0)


def _arrays(value):
    """The arrays of a weight: itself, or the parts of a tuple of matrices."""
    return [a for a in value if isinstance(a, np.ndarray)] if isinstance(value, tuple) else [value]


def ellm_weights(model) -> tuple[str, int]:
    """What ellm holds in memory ("bf16", "Q4_K+Q6_K+f32", ...) and its decode bytes per token."""
    from ellmd.engine.engine import held_block_name
    from ellmd.kernels import formats

    def fmt(a):
        return held_block_name(a) or ("f32" if a.dtype == np.float32 else {v: k for k, v in formats.FORMAT_NAMES.items()}[model.fmt])

    spec = model.spec
    tied = model.lm_head is model.embed_tokens
    tensors = [("embed_tokens", model.embed_tokens.nbytes, False, not tied), ("norm", model.norm.nbytes, False, False)]
    if not tied:
        tensors.append(("lm_head", model.lm_head.nbytes, False, False))
    kinds: dict[str, int] = {}
    for index, layer in enumerate(model.layers):
        for name, value in layer.items():
            for array in _arrays(value):
                tensors.append((f"{index}.{name}", array.nbytes, name.startswith("experts_"), False))
                if array.ndim >= 2:
                    kinds[fmt(array)] = kinds.get(fmt(array), 0) + array.nbytes
    held = "+".join(sorted(kinds, key=kinds.get, reverse=True))
    return held, decode_bytes(tensors, spec.num_experts_per_tok, spec.num_experts)


def check_ellm_fits(path: Path, dtype: str | None) -> None:
    """Refuse a GGUF whose weights would not fit in memory as ellm's loader holds them (rather than be
    killed by the kernel half-way): blocks it keeps count their bytes, tensors it converts count 2 or 4
    bytes a weight. The loader is probed on the file's smallest quantized matrix."""
    from ellmd.engine.kvcache import available_memory
    from ellmd.kernels import quant
    from ellmd.model.weights import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(path)
    tensors = {name: checkpoint.tensor(name) for name in checkpoint.names()}
    quantized = [name for name, t in tensors.items() if t.kind not in ("F32", "F16", "BF16") and len(t.dims) >= 2]
    element = 4 if dtype == "f32" else 2
    if quantized and dtype is None:
        probe = min(quantized, key=lambda name: tensors[name].nbytes)
        if quant.is_blocks(checkpoint.get(probe, checkpoint.native_format(), keep_blocks=True)):
            return  # blocks stay blocks: the file's size, which is mapped
    need = sum(int(np.prod(t.dims)) * (4 if len(t.dims) == 1 else element) for t in tensors.values())
    free = available_memory()
    if need > 0.9 * free:
        raise MemoryError(f"ellm would hold {need / 2**30:.1f} GiB of weights (converted to "
                          f"{dtype or 'bf16'} at load), {free / 2**30:.1f} GiB is available")


def measure_ellm(case: ModelCase, source, dtype: str | None, tokens: BenchTokens, args) -> dict:
    """ellm on `source` (a GGUF path or a RandomCheckpoint) with weight dtype `dtype` (None: the file's own)."""
    import numba

    from ellmd.bench import run_bench
    from ellmd.cli import load_engine

    if isinstance(source, Path):
        check_ellm_fits(source, dtype)
    engine = load_engine(
        source, weight_dtype=dtype, kv_dtype=args.kv_dtype, sequence_length=capacity(args), batch_size=1,
        chunk_size=args.chunk_size, threads=args.threads,
    )
    try:
        if numba.get_num_threads() != args.threads:  # numba caps threads at NUMBA_NUM_THREADS (the core count)
            log.print(f"[yellow]warning: ellm runs {numba.get_num_threads()} kernel threads, not {args.threads}[/]")
        held, nbytes = ellm_weights(engine.model)
        first = warm_up(EllmRunner(engine), tokens, args)
        rows = run_bench(engine, args.prefill, args.decode, args.context, args.repetitions, args.append)
        result = with_bandwidth(rows, nbytes, args)
        result.update(first_token=first, memory=held, settings={
            "weights": dtype or "as stored", "kv": args.kv_dtype, "chunk_size": args.chunk_size, "numba": numba.__version__})
        return result
    finally:
        del engine
        gc.collect()


def ellm_sources(case: ModelCase, args) -> list[tuple[str, str, object, str | None]]:
    """(label, format, source, weight dtype) of every ellm row of a model."""
    from ellmd.model.weights import RandomCheckpoint

    rows = []
    if case.kind != "as-is":
        for dtype in args.ellm_dtypes:
            source = RandomCheckpoint(case.source, seed=args.seed, layers=args.layers) if case.kind == "random" else case.gguf
            rows.append((f"ellm {dtype}", "F16", source, dtype))
    for fmt, path in case.formats.items():
        if fmt != "F16" or case.kind == "as-is":
            rows.append((f"ellm {fmt}", fmt, path, None))
    return rows


# ---- llama.cpp ----------------------------------------------------------------------------


def measure_llama(case: ModelCase, fmt: str, args) -> dict:
    """Native llama-bench on the GGUF of one format."""
    path = case.formats[fmt]
    records = llama_native.bench(args.llama_native, path, threads=args.threads, prompts=args.prefill, decode=args.decode,
                                 depth=args.context, repetitions=args.repetitions, flash_attn=args.llama_flash_attn,
                                 repack=args.llama_repack, appends=args.append)
    rows = []
    for record in records:  # one record per (N, depth): "pp512" and "pp512@0" share it
        n, depth = record["n_prompt"], record["n_depth"]
        if record["n_gen"]:
            rows.append(summarize(f"tg{record['n_gen']}", record["n_gen"], depth, record["samples_ts"]))
        elif (n, depth) in args.append:
            rows.append(summarize(f"pp{n}@{depth}", n, depth, record["samples_ts"]))
        if not record["n_gen"] and depth == 0 and n in args.prefill:
            rows.append(summarize(f"pp{n}", n, 0, record["samples_ts"]))
    result = with_bandwidth(rows, gguf_decode_bytes(path), args)
    result.update(memory=fmt, settings={
        "weights": fmt, "kv": f"{records[0]['type_k']}", "n_batch": records[0]["n_batch"],
        "n_ubatch": records[0]["n_ubatch"], "flash_attn": records[0]["flash_attn"], "repack": records[0].get("repack"),
        "build": records[0]["build_commit"], "cpu": records[0]["cpu_info"]})
    return result


# ---- transformers -------------------------------------------------------------------------


class TransformersRunner:
    """A causal LM with its DynamicCache; logits of the last position only, like the other systems."""

    def __init__(self, model):
        import inspect

        import torch

        self.torch, self.model, self.cache = torch, model, None
        # transformers 5 renamed past_key_values to cache (the old name warns, then goes in 5.40)
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _forward(self, ids, **kwargs) -> int:
        with self.torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True, **{self.cache_arg: self.cache}, **kwargs)
        self.cache = getattr(out, self.cache_arg)
        return int(out.logits[0, -1].argmax())

    def prefill(self, tokens) -> int:
        return self._forward(self.torch.as_tensor(np.asarray(tokens, np.int64))[None], logits_to_keep=1)  # ids [1, n]

    def decode_step(self, token: int) -> int:
        return self._forward(self.torch.tensor([[token]]))  # ids [1, 1]

    def reset(self) -> None:
        self.cache = None


def _tensor(array):
    """A torch view of a numpy array, copied first when it is read-only (memory-mapped weights),
    which torch.from_numpy warns about."""
    import torch

    return torch.from_numpy(np.require(array, requirements="W"))


def load_transformers_model(case: ModelCase, args):
    """The model in f32, with the weights ellm reads: the random ones, or the F16 GGUF through ellm's reader
    (which un-permutes llama's q/k rows; transformers' own GGUF loader would need accelerate)."""
    import dataclasses

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from ellmd.kernels import formats
    from ellmd.model.weights import GGUFCheckpoint, RandomCheckpoint

    if case.kind == "random":
        checkpoint, config = RandomCheckpoint(case.source, seed=args.seed, layers=args.layers), case.config
    else:
        checkpoint = GGUFCheckpoint(case.gguf)
        config = {k: v for k, v in dataclasses.asdict(checkpoint.spec).items() if v is not None and k != "torch_dtype"}
    with no_init_weights():  # every weight is overwritten below: skip the random init
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    state = model.state_dict()
    names = set(checkpoint.names())
    for name in names:
        if ".mlp.experts." not in name:
            state[name].copy_(_tensor(checkpoint.get(name, formats.F32)))
    for i in range(case.layers):  # transformers fuses each MoE layer's experts into 3-D tensors
        prefix = f"model.layers.{i}.mlp.experts"
        if f"{prefix}.gate_up_proj" not in state:
            continue
        if f"{prefix}.gate_proj.weight" in names:  # a GGUF: one stack per projection
            stacks = [checkpoint.get(f"{prefix}.{p}.weight", formats.F32) for p in ("gate_proj", "up_proj", "down_proj")]
            state[f"{prefix}.gate_up_proj"].copy_(torch.from_numpy(np.concatenate(stacks[:2], axis=1)))
            state[f"{prefix}.down_proj"].copy_(_tensor(stacks[2]))
            continue
        for e in range(checkpoint.spec.num_experts):
            gate, up, down = (checkpoint.get(f"{prefix}.{e}.{p}.weight", formats.F32) for p in ("gate_proj", "up_proj", "down_proj"))
            state[f"{prefix}.gate_up_proj"][e].copy_(torch.from_numpy(np.concatenate([gate, up])))
            state[f"{prefix}.down_proj"][e].copy_(_tensor(down))
    model.tie_weights()
    return model.eval()


def transformers_decode_bytes(model) -> int:
    """decode_bytes of a transformers model at its current dtype."""
    config = model.config
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    tensors = [(name, p.numel() * p.element_size(), ".mlp.experts." in name, name.endswith("embed_tokens.weight") and not tied)
               for name, p in model.named_parameters()]
    experts = getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0
    return decode_bytes(tensors, getattr(config, "num_experts_per_tok", 0) or 0, experts)


def measure_transformers(case: ModelCase, tokens: BenchTokens, args) -> dict[str, dict]:
    """Every requested dtype on one load: f32 first, then the same weights converted to bf16."""
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    results = {}
    model = load_transformers_model(case, args)
    try:
        for dtype in sorted(args.transformers_dtypes, key=lambda d: d != "f32"):  # f32 before the lossy bf16
            label = f"transformers {dtype}"
            log.print(f"[bold]{case.label}[/] · {label}: warming up and timing", highlight=False)
            if dtype == "bf16":
                model = model.to(torch.bfloat16)
            try:
                runner = TransformersRunner(model)
                first = warm_up(runner, tokens, args)
                result = with_bandwidth(run_harness(runner, tokens, args), transformers_decode_bytes(model), args)
                result.update(first_token=first, memory=dtype, settings={
                    "weights": dtype, "kv": dtype, "attention": model.config._attn_implementation,
                    "torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads()})
                results[label] = result
            except Exception as e:  # one dtype failing leaves the other's figures
                results[label] = failure(e)
            finally:
                runner = None
                gc.collect()
    finally:
        del model
        gc.collect()
    return results


WORKER_FLAG = "--transformers-worker"


def run_transformers(case: ModelCase, args) -> dict[str, dict]:
    """measure_transformers in a process of its own (torch's and numba's thread pools fight in one)."""
    job = {"case": {k: str(v) if isinstance(v, Path) else v for k, v in vars(case).items() if k != "formats"},
           "args": {k: getattr(args, k) for k in ("threads", "prefill", "decode", "context", "repetitions", "seed",
                                                  "layers", "transformers_dtypes")}}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), WORKER_FLAG], input=json.dumps(job),
                          stdout=subprocess.PIPE, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the transformers process exited with status {done.returncode}")
    return json.loads(lines[-1])


def transformers_worker() -> int:
    """The transformers process: a job (JSON) on stdin, its results (JSON) as the last line of stdout."""
    job = json.load(sys.stdin)
    case = ModelCase(**{k: Path(v) if k in ("source", "gguf") else v for k, v in job["case"].items()})
    args = argparse.Namespace(**job["args"])
    print(json.dumps(measure_transformers(case, benchmark_tokens(case.vocab_size, args), args)))
    return 0


# ---- the run ------------------------------------------------------------------------------


def failure(error: Exception) -> dict:
    log.print(f"[red]failed:[/] {type(error).__name__}: {error}", highlight=False)
    log.print(traceback.format_exc(), highlight=False)
    return {"error": f"{type(error).__name__}: {error}"}


def attempt(results: dict, label: str, fmt: str, measure) -> None:
    """results[label] = measure(), or the failure; tagged with the weight format it stands for."""
    try:
        results[label] = measure()
    except Exception as e:
        results[label] = failure(e)
    results[label]["format"] = fmt


def benchmark_model(case: ModelCase, args) -> dict[str, dict]:
    """Every system on one model, one after another; returns system label -> result."""
    tokens = benchmark_tokens(case.vocab_size, args)
    results: dict[str, dict] = {}
    if "ellm" not in args.skip:
        for label, fmt, source, dtype in ellm_sources(case, args):
            log.print(f"[bold]{case.label}[/] · {label}: loading, warming up and timing", highlight=False)
            attempt(results, label, fmt, lambda: measure_ellm(case, source, dtype, tokens, args))
    if "llama.cpp" not in args.skip:
        for fmt in case.formats:
            log.print(f"[bold]{case.label}[/] · llama.cpp {fmt}: llama-bench", highlight=False)
            attempt(results, f"llama.cpp {fmt}", fmt, lambda: measure_llama(case, fmt, args))
    if "transformers" not in args.skip and args.transformers_dtypes and case.kind != "as-is":
        log.print(f"[bold]{case.label}[/] · transformers (own process): loading", highlight=False)
        try:
            for label, result in run_transformers(case, args).items():
                results[label] = dict(result, format="F16")
        except Exception as e:  # the load failed: no dtype has figures
            error = failure(e)
            results.update({f"transformers {dtype}": dict(error, format="F16") for dtype in args.transformers_dtypes})
    return results


def ratios(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """ellm tok/s over llama.cpp tok/s at the same weight format (ellm bf16 against llama.cpp F16), per test."""
    out = {}
    for label, result in results.items():
        base = results.get(f"llama.cpp {result.get('format')}", {})
        if not label.startswith("ellm") or "rows" not in result or "rows" not in base:
            continue
        rates = {row["test"]: row["tok_s"] for row in base["rows"]}
        out[f"{label} / llama.cpp {result['format']}"] = {
            row["test"]: round(row["tok_s"] / rates[row["test"]], 3) for row in result["rows"] if rates.get(row["test"])}
    return out


def system_order(label: str) -> tuple:
    """Table order: by system, then F16/bf16 first."""
    system, fmt = label.split(maxsplit=1)
    return (SYSTEMS.index(system), fmt not in ("bf16", "F16"), label)


def render_tables(case: ModelCase, results: dict, tests: list[str], args) -> list[Table]:
    layers = f"{case.layers} of {case.total_layers} layers" if case.layers != case.total_layers else f"{case.layers} layers"
    table = Table(title=f"{case.label} | {layers} | threads {args.threads}",
                  caption=f"tok/s, mean ± std of {args.repetitions} runs; tg after a {args.context}-token context; "
                          "GB/s: weight bytes read per decode token x tg tok/s")
    for column in ("system", "weights in memory", *tests, "decode GB/s"):
        table.add_column(column, justify="left" if column in ("system", "weights in memory") else "right")
    for label in sorted(results, key=system_order):
        result = results[label]
        if "error" in result:
            table.add_row(label, "", *["failed"] * len(tests), "")
            continue
        cells = {row["test"]: f"{row['tok_s']:,.2f} ± {row['std']:,.2f}" for row in result["rows"]}
        gb_s = f"{result['decode_gb_s']:.1f}" if "decode_gb_s" in result else ""
        table.add_row(label, result.get("memory", ""), *[cells.get(test, "") for test in tests], gb_s)
    failures = [f"{label}: {results[label]['error']}" for label in sorted(results, key=system_order) if "error" in results[label]]
    if failures:
        table.caption += "\nfailed: " + "; ".join(failures)
    tables = [table]
    ratio = ratios(results)
    if ratio:
        small = Table(title=f"{case.label}: ellm / llama.cpp at the same format (higher is better for ellm)")
        small.add_column("systems")
        for test in tests:
            small.add_column(test, justify="right")
        for label, values in sorted(ratio.items(), key=lambda item: system_order(item[0].split(" / ")[0])):
            small.add_row(label, *[f"{values[t]:.2f}x" if t in values else "" for t in tests])
        tables.append(small)
    return tables


def machine_info(args) -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": args.threads, "python": platform.python_version(),
            "numpy": np.__version__, "platform": platform.platform()}


def command_line() -> str:
    python = os.path.relpath(sys.executable) if not os.path.relpath(sys.executable).startswith("..") else sys.executable
    return shlex.join([python, *sys.argv])


def print_report(measured, args, header, load_before, load_after, report) -> None:
    tests = ([f"pp{n}" for n in args.prefill] + [f"pp{n}@{held}" for n, held in args.append]
             + ([f"tg{args.decode}"] if args.decode else []))
    # piped to a file or a log, rich would assume 80 columns and break table cells: give it room
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
    console.print()
    for case, results in measured:
        for table in render_tables(case, results, tests, args):
            console.print(table)
        firsts = {label: r["first_token"] for label, r in results.items() if r.get("first_token") is not None}
        if len(firsts) > 1:  # a cheap check that ellm and transformers got the same weights (llama-bench has no logits)
            agree = "all agree" if len(set(firsts.values())) == 1 else "they differ: near-ties can flip in low precision"
            console.print(f"greedy token after the first {max(args.context, 1)}-token context: "
                          + ", ".join(f"{k} {v}" for k, v in firsts.items()) + f" ({agree})", highlight=False)
        console.print()
    console.print(header, highlight=False)
    console.print(f"machine  {report['machine']['cpu']}, {report['machine']['cores']} cores; "
                  f"load average {load_before:.2f} before, {load_after:.2f} after (a busy machine skews figures)",
                  highlight=False)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"figures written to {args.json}", highlight=False)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "llama.cpp" not in args.skip or args.quant:  # llama-quantize writes the quantized formats
        require_llama_native(args)
    if "transformers" not in args.skip:
        require_transformers()
    if args.threads > (os.cpu_count() or args.threads):
        log.print(f"[yellow]warning: --threads {args.threads} exceeds the {os.cpu_count()} cores of this machine[/]")

    header = (f"command  {command_line()}\n"
              f"threads  {args.threads} for every system (numba + BLAS, llama-bench -t, torch)")
    log.print(header, highlight=False)
    load_before = os.getloadavg()[0]
    if load_before > 0.5:  # llama.cpp's spinning thread barriers suffer most from a shared core
        log.print(f"[yellow]warning: load average {load_before:.2f} before start: other work is running, "
                  f"figures will be noisy[/]")
    gguf_dir = args.gguf_dir or Path(tempfile.mkdtemp(prefix="ellm-bench-"))
    gguf_dir.mkdir(parents=True, exist_ok=True)
    report = {"command": command_line(), "machine": machine_info(args),
              "settings": {k: (sorted(v) if isinstance(v, set) else str(v) if isinstance(v, Path)
                               else [str(p) for p in v] if k == "model_as_is" else v)
                           for k, v in vars(args).items()},
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "models": []}
    measured: list[tuple[ModelCase, dict]] = []
    try:
        cases = [lambda name=name: prepare_model(name, args, gguf_dir) for name in args.model]
        cases += [lambda path=path: as_is_model(path) for path in args.model_as_is]
        for make_case in cases:
            case = make_case()
            results = benchmark_model(case, args)
            measured.append((case, results))
            report["models"].append({
                "model": case.label, "source": str(case.source), "layers": case.layers, "total_layers": case.total_layers,
                "ggufs": {fmt: str(path) for fmt, path in case.formats.items()} if args.gguf_dir or case.kind == "as-is" else None,
                "systems": {label: results[label] for label in sorted(results, key=system_order)},
                "ellm_over_llama_cpp": ratios(results),
            })
    finally:
        if not args.gguf_dir:
            shutil.rmtree(gguf_dir, ignore_errors=True)
    load_after = os.getloadavg()[0]
    report["load_average"] = {"before": load_before, "after": load_after}
    print_report(measured, args, header, load_before, load_after, report)
    return 1 if any("error" in r for _, results in measured for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(transformers_worker() if sys.argv[1:] == [WORKER_FLAG] else main())
