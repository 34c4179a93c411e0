"""Compare ellm with llama.cpp and Hugging Face transformers: same weights, same threads, one run.

Usage (from the repository root):

    # the built-in SmolLM2-135M-Instruct: ellm bf16, llama.cpp F16, transformers bf16 and f32
    .venv/bin/python scripts/bench_compare.py --model builtin --threads 2

    # Qwen3-0.6B shapes with random weights, plus the built-in model, ellm in bf16 and f32
    .venv/bin/python scripts/bench_compare.py --model builtin \\
        --model ../shared/fixtures/configs/qwen3-0.6b.json --ellm-dtypes bf16,f32 --json bench.json

    # a big config truncated to 4 layers, without transformers
    .venv/bin/python scripts/bench_compare.py --model ../shared/fixtures/configs/qwen3-8b.json \\
        --layers 4 --skip transformers

    # a quick check that everything runs (tiny sizes)
    .venv/bin/python scripts/bench_compare.py --layers 2 --prefill 32 --decode 8 --context 32 --repetitions 2

What is measured, for every system alike (the method of `ellmd bench`):
  ppN   prefill of N tokens into an empty cache in one call; logits of the last position only
  tgN   N greedy decode steps of one token each, after a context of C tokens prefilled untimed
Each test runs --repetitions times: the tables show the mean ± standard deviation of tok/s.
All systems see the same token ids. They run one after another in this process (never at the same
time), with the same thread count, each warmed up once untimed, and each model is freed before
the next one is loaded.

The systems and their weights:
  ellm          in-process Engine (ellmd.bench.run_bench), weights --ellm-dtypes (bf16 default)
  llama.cpp     llama-cpp-python on an F16 GGUF of the same weights (n_batch = n_ubatch = 512,
                F16 KV cache: llama.cpp's defaults), timing Llama.eval()
  transformers  the same weights in f32, then converted to bf16 (--transformers-dtypes), forward
                with use_cache=True under torch.inference_mode()

Models (--model, repeatable): `builtin` (the SmolLM2-135M-Instruct Q4_1 GGUF that ellm ships with;
its tensors are dequantized to an F16 GGUF that all three systems read), any .gguf file (same
treatment), or a config.json (random weights at its shapes, ellm's RandomCheckpoint; --layers N
keeps the first N layers). The F16 GGUFs go to a temporary directory unless --gguf-dir keeps them.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console

from ellmd.bench import summarize
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gguf_export sits beside this script
from gguf_export import export_gguf_as_f16, export_random_gguf  # noqa: E402

# transformers' GGUF loader draws tqdm bars that no setting turns off; this script reports progress itself
os.environ.setdefault("TQDM_DISABLE", "1")

SYSTEMS = ("ellm", "llama.cpp", "transformers")
LLAMA_BATCH = 512  # n_batch = n_ubatch = 512, llama-bench's ubatch (its n_batch 2048 splits into the same ubatches)
log = Console(stderr=True, soft_wrap=True)  # soft wrap: command lines stay copyable


# ---- command line -------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", metavar="builtin|GGUF|CONFIG_JSON",
                        help="model to benchmark, repeatable [default: builtin]")
    parser.add_argument("--layers", type=int, help="keep only the first N layers of every model (to fit big configs)")
    parser.add_argument("--threads", type=int, default=2, help="threads for every system [default: 2]")
    parser.add_argument("--prefill", default="512,2048", help="prompt sizes to time, comma-separated [default: 512,2048]")
    parser.add_argument("--decode", type=int, default=128, help="tokens to decode, 0 to skip [default: 128]")
    parser.add_argument("--context", type=int, default=512, help="tokens in the cache when decoding starts [default: 512]")
    parser.add_argument("--repetitions", type=int, default=3, help="runs of each test [default: 3]")
    parser.add_argument("--ellm-dtypes", default="bf16", help="ellm weight dtypes, comma-separated: bf16, f16, f32 [default: bf16]")
    parser.add_argument("--kv-dtype", default="bf16", help="ellm KV cache dtype [default: bf16]")
    parser.add_argument("--chunk-size", type=int, default=512, help="ellm prefill chunk size [default: 512]")
    parser.add_argument("--transformers-dtypes", default="bf16,f32", help="comma-separated: bf16, f32 [default: bf16,f32]")
    parser.add_argument("--llama-flash-attn", action=argparse.BooleanOptionalAction, default=True,
                        help="llama.cpp flash attention (its library default 'auto' enables it on CPU) [default: on]")
    parser.add_argument("--skip", default="", help=f"systems to leave out, comma-separated: {', '.join(SYSTEMS)}")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights of config models [default: 0]")
    parser.add_argument("--gguf-dir", type=Path, help="keep the F16 GGUFs here and reuse them [default: a temporary directory]")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    parser.add_argument("--install-llama-cpp", action="store_true",
                        help="pip install llama-cpp-python into this Python if it is missing (compiles llama.cpp, ~10 min)")
    args = parser.parse_args(argv)
    args.model = args.model or ["builtin"]
    args.prefill = _int_list(parser, "--prefill", args.prefill)
    args.ellm_dtypes = _choices(parser, "--ellm-dtypes", args.ellm_dtypes, ("bf16", "f16", "f32"))
    args.transformers_dtypes = _choices(parser, "--transformers-dtypes", args.transformers_dtypes, ("bf16", "f32"))
    args.skip = set(_choices(parser, "--skip", args.skip, SYSTEMS))
    if args.repetitions < 1 or args.threads < 1 or args.context < 0 or args.decode < 0:
        parser.error("--repetitions and --threads must be >= 1, --context and --decode >= 0")
    if not args.prefill and not args.decode:
        parser.error("nothing to measure: give --prefill sizes or --decode > 0")
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


def require_llama_cpp(install: bool) -> None:
    """Check that llama_cpp is there, or say how to get it (installed only when asked: it compiles ~10 minutes).

    find_spec, not import: no system's libraries load before its turn, so ellm runs in a clean process.
    """
    if importlib.util.find_spec("llama_cpp") is not None:
        return
    pip = f"{shlex.quote(sys.executable)} -m pip install llama-cpp-python"
    if not install:
        log.print(
            "[red]llama-cpp-python is not installed.[/] Install it with\n"
            f"  {pip}\n"
            "(it compiles llama.cpp: about 10 minutes), rerun with --install-llama-cpp to do that now, "
            "or leave llama.cpp out with --skip llama.cpp", highlight=False,
        )
        sys.exit(2)
    log.print(f"installing llama-cpp-python (compiles llama.cpp, about 10 minutes): {pip}", highlight=False)
    subprocess.run([sys.executable, "-m", "pip", "install", "llama-cpp-python"], check=True)
    importlib.invalidate_caches()
    if importlib.util.find_spec("llama_cpp") is None:
        log.print("[red]llama-cpp-python is still not importable after pip install[/]")
        sys.exit(2)


def require_transformers() -> None:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        log.print("[red]torch and transformers are not installed[/] (development extras): "
                  "scripts/setup.sh --dev, or leave them out with --skip transformers")
        sys.exit(2)


# ---- models and tokens --------------------------------------------------------------------


@dataclass
class ModelCase:
    """One model to benchmark: where each system gets its weights from."""

    label: str
    kind: str  # "gguf" (a GGUF file, rewritten as F16) or "random" (a config.json with random weights)
    source: Path  # the original GGUF or config.json
    gguf: Path  # the F16 GGUF (read by llama.cpp; for "gguf" models by all three systems)
    vocab_size: int
    layers: int
    total_layers: int
    config: dict = field(default_factory=dict)  # "random" only: config.json with num_hidden_layers cut


def prepare_model(name: str, args, gguf_dir: Path) -> ModelCase:
    """Resolve --model, and write (or reuse) its F16 GGUF."""
    from ellmd.engine import builtin_model_path
    from ellmd.model.weights import GGUFCheckpoint, RandomCheckpoint

    suffix = f"-L{args.layers}" if args.layers else ""
    if name == "builtin" or name.endswith(".gguf"):
        source = builtin_model_path() if name == "builtin" else Path(name)
        spec = GGUFCheckpoint(source).spec
        layers = min(args.layers or spec.num_hidden_layers, spec.num_hidden_layers)
        gguf = gguf_dir / f"{source.stem}.F16{suffix}.gguf"
        if not gguf.exists():
            log.print(f"writing {gguf} (F16, {layers} layers)", highlight=False)
            export_gguf_as_f16(source, gguf, layers=args.layers)
        label = source.stem.split(".")[0]
        return ModelCase(label, "gguf", source, gguf, spec.vocab_size, layers, spec.num_hidden_layers)

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
    return ModelCase(f"{source.stem} (random)", "random", source, gguf, checkpoint.spec.vocab_size,
                     layers, int(json.loads(source.read_text())["num_hidden_layers"]), config)


@dataclass
class BenchTokens:
    """The token ids every system sees, drawn in the order ellmd.bench.run_bench draws them."""

    prompts: dict[int, np.ndarray]  # prefill size -> ids
    contexts: list[np.ndarray]  # one decode context per repetition


def benchmark_tokens(vocab_size: int, args) -> BenchTokens:
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(0, vocab_size, n) for n in args.prefill}
    contexts = [rng.integers(0, vocab_size, max(args.context, 1)) for _ in range(args.repetitions)] if args.decode else []
    return BenchTokens(prompts, contexts)


def capacity(args) -> int:
    """Cache length every system gets: the longest prompt, or context + decode (and the warm-up's 2 steps)."""
    return max(args.prefill + [max(args.context, 1) + max(args.decode, 2)])


# ---- one harness for llama.cpp and transformers (ellm has ellmd.bench.run_bench) -----------


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


def measure_ellm(case: ModelCase, dtype: str, tokens: BenchTokens, args) -> dict:
    import numba

    from ellmd.bench import run_bench
    from ellmd.cli import load_engine
    from ellmd.model.weights import RandomCheckpoint

    source = RandomCheckpoint(case.source, seed=args.seed, layers=args.layers) if case.kind == "random" else case.gguf
    engine = load_engine(
        source, weight_dtype=dtype, kv_dtype=args.kv_dtype, sequence_length=capacity(args), batch_size=1,
        chunk_size=args.chunk_size, threads=args.threads,
    )
    try:
        if numba.get_num_threads() != args.threads:  # numba caps threads at NUMBA_NUM_THREADS (the core count)
            log.print(f"[yellow]warning: ellm runs {numba.get_num_threads()} kernel threads, not {args.threads}[/]")
        first = warm_up(EllmRunner(engine), tokens, args)
        rows = run_bench(engine, args.prefill, args.decode, args.context, args.repetitions)
        return {"rows": rows, "first_token": first, "settings": {
            "weights": dtype, "kv": args.kv_dtype, "chunk_size": args.chunk_size, "numba": numba.__version__}}
    finally:
        del engine
        gc.collect()


# ---- llama.cpp ----------------------------------------------------------------------------


class LlamaCppRunner:
    """llama-cpp-python on one sequence; ids are fed directly (the synthetic GGUFs have no tokenizer)."""

    def __init__(self, gguf: Path, n_ctx: int, threads: int, flash_attn: bool):
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(
            str(gguf), n_ctx=n_ctx, n_batch=LLAMA_BATCH, n_ubatch=LLAMA_BATCH, n_threads=threads,
            n_threads_batch=threads, logits_all=False, flash_attn=flash_attn, verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()

    def prefill(self, tokens) -> int:
        self.llm.eval([int(t) for t in tokens])
        return self._greedy()

    def decode_step(self, token: int) -> int:
        self.llm.eval([token])
        return self._greedy()

    def reset(self) -> None:
        self.llm.reset()  # the next eval() drops the KV cells past n_tokens = 0

    def _greedy(self) -> int:
        # llama_get_logits_ith waits for the computation, so the timing covers all of it
        logits = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def close(self) -> None:
        self.llm.close()


def measure_llama_cpp(case: ModelCase, tokens: BenchTokens, args) -> dict:
    import llama_cpp

    runner = LlamaCppRunner(case.gguf, capacity(args), args.threads, args.llama_flash_attn)
    try:
        first = warm_up(runner, tokens, args)
        rows = run_harness(runner, tokens, args)
        return {"rows": rows, "first_token": first, "settings": {
            "weights": "f16", "kv": "f16", "n_batch": LLAMA_BATCH, "n_ubatch": LLAMA_BATCH,
            "flash_attn": args.llama_flash_attn, "version": llama_cpp.__version__}}
    finally:
        runner.close()
        del runner
        gc.collect()


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


def load_transformers_model(case: ModelCase, args):
    """The model in f32: from the F16 GGUF (transformers un-permutes q/k itself) or from the random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if case.kind == "gguf":
        return AutoModelForCausalLM.from_pretrained(case.gguf.parent, gguf_file=case.gguf.name, dtype=torch.float32).eval()

    from transformers.initialization import no_init_weights

    from ellmd.kernels import formats
    from ellmd.model.weights import RandomCheckpoint

    checkpoint = RandomCheckpoint(case.source, seed=args.seed, layers=args.layers)
    with no_init_weights():  # every weight is overwritten below: skip the random init
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**case.config), dtype=torch.float32)
    state = model.state_dict()
    for name in checkpoint.names():
        if ".mlp.experts." in name:
            continue
        state[name].copy_(torch.from_numpy(checkpoint.get(name, formats.F32)))
    for i in range(case.layers):  # transformers fuses each MoE layer's experts into 3-D tensors
        prefix = f"model.layers.{i}.mlp.experts"
        if f"{prefix}.gate_up_proj" not in state:
            continue
        for e in range(checkpoint.spec.num_experts):
            gate, up, down = (checkpoint.get(f"{prefix}.{e}.{p}.weight", formats.F32) for p in ("gate_proj", "up_proj", "down_proj"))
            state[f"{prefix}.gate_up_proj"][e].copy_(torch.from_numpy(np.concatenate([gate, up])))
            state[f"{prefix}.down_proj"][e].copy_(torch.from_numpy(down))
    model.tie_weights()
    return model.eval()


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
                results[label] = {"rows": run_harness(runner, tokens, args), "first_token": first, "settings": {
                    "weights": dtype, "kv": dtype, "attention": model.config._attn_implementation,
                    "torch": torch.__version__, "transformers": transformers.__version__}}
            except Exception as e:  # one dtype failing leaves the other's figures
                results[label] = failure(e)
            finally:
                runner = None
                gc.collect()
    finally:
        del model
        gc.collect()
    return results


# ---- the run ------------------------------------------------------------------------------


def failure(error: Exception) -> dict:
    log.print(f"[red]failed:[/] {type(error).__name__}: {error}", highlight=False)
    log.print(traceback.format_exc(), highlight=False)
    return {"error": f"{type(error).__name__}: {error}"}


def benchmark_model(case: ModelCase, args) -> dict[str, dict]:
    """Every system on one model, one after another; returns system label -> result."""
    tokens = benchmark_tokens(case.vocab_size, args)
    results: dict[str, dict] = {}
    if "ellm" not in args.skip:
        for dtype in args.ellm_dtypes:
            label = f"ellm {dtype}"
            log.print(f"[bold]{case.label}[/] · {label}: loading, warming up and timing", highlight=False)
            try:
                results[label] = measure_ellm(case, dtype, tokens, args)
            except Exception as e:
                results[label] = failure(e)
    if "llama.cpp" not in args.skip:
        log.print(f"[bold]{case.label}[/] · llama.cpp F16: loading, warming up and timing", highlight=False)
        try:
            results["llama.cpp F16"] = measure_llama_cpp(case, tokens, args)
        except Exception as e:
            results["llama.cpp F16"] = failure(e)
    if "transformers" not in args.skip and args.transformers_dtypes:
        log.print(f"[bold]{case.label}[/] · transformers: loading", highlight=False)
        try:
            results.update(measure_transformers(case, tokens, args))
        except Exception as e:  # the load failed: no dtype has figures
            error = failure(e)
            results.update({f"transformers {dtype}": error for dtype in args.transformers_dtypes})
    return results


def ratios(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """ellm tok/s over llama.cpp tok/s, per ellm dtype and test."""
    base = {row["test"]: row["tok_s"] for row in results.get("llama.cpp F16", {}).get("rows", [])}
    out = {}
    for label, result in results.items():
        if label.startswith("ellm") and "rows" in result:
            out[label] = {row["test"]: round(row["tok_s"] / base[row["test"]], 3)
                          for row in result["rows"] if base.get(row["test"])}
    return out


def system_order(label: str) -> tuple:
    """Table order: ellm rows, llama.cpp, transformers bf16, transformers f32."""
    system = label.split()[0]
    return (SYSTEMS.index(system), label.split()[-1] != "bf16", label)


def render_tables(case: ModelCase, results: dict, tests: list[str], args) -> list[Table]:
    layers = f"{case.layers} of {case.total_layers} layers" if case.layers != case.total_layers else f"{case.layers} layers"
    table = Table(title=f"{case.label} | {layers} | threads {args.threads}",
                  caption=f"tok/s, mean ± std of {args.repetitions} runs; tg after a {args.context}-token context")
    table.add_column("system")
    for test in tests:
        table.add_column(test, justify="right")
    for label in sorted(results, key=system_order):
        result = results[label]
        if "error" in result:
            table.add_row(label, *["failed"] * len(tests))
            continue
        cells = {row["test"]: f"{row['tok_s']:,.2f} ± {row['std']:,.2f}" for row in result["rows"]}
        table.add_row(label, *[cells.get(test, "") for test in tests])
    tables = [table]
    ratio = ratios(results)
    if ratio:
        small = Table(title=f"{case.label}: ellm / llama.cpp (higher is better for ellm)")
        small.add_column("system")
        for test in tests:
            small.add_column(test, justify="right")
        for label, values in sorted(ratio.items()):
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


def main(argv=None) -> int:
    args = parse_args(argv)
    if "llama.cpp" not in args.skip:
        require_llama_cpp(args.install_llama_cpp)  # before any work: never fail 20 minutes in
    if "transformers" not in args.skip:
        require_transformers()
    if args.threads > (os.cpu_count() or args.threads):
        log.print(f"[yellow]warning: --threads {args.threads} exceeds the {os.cpu_count()} cores of this machine[/]")

    header = (f"command  {command_line()}\n"
              f"threads  {args.threads} for every system (numba + BLAS, llama.cpp n_threads and n_threads_batch, torch)")
    log.print(header, highlight=False)
    load_before = os.getloadavg()[0]
    if load_before > 0.5:  # llama.cpp's spinning thread barriers suffer most from a shared core
        log.print(f"[yellow]warning: load average {load_before:.2f} before start: other work is running, "
                  f"figures will be noisy[/]")
    gguf_dir = args.gguf_dir or Path(tempfile.mkdtemp(prefix="ellm-bench-"))
    gguf_dir.mkdir(parents=True, exist_ok=True)
    report = {"command": command_line(), "machine": machine_info(args),
              "settings": {k: (sorted(v) if isinstance(v, set) else str(v) if isinstance(v, Path) else v)
                           for k, v in vars(args).items()},
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "models": []}
    measured: list[tuple[ModelCase, dict]] = []
    try:
        for name in args.model:
            case = prepare_model(name, args, gguf_dir)
            results = benchmark_model(case, args)
            measured.append((case, results))
            report["models"].append({
                "model": case.label, "source": str(case.source), "gguf_f16": str(case.gguf) if args.gguf_dir else None,
                "layers": case.layers, "total_layers": case.total_layers,
                "systems": {label: results[label] for label in sorted(results, key=system_order)},
                "ellm_over_llama_cpp": ratios(results),
            })
    finally:
        if not args.gguf_dir:
            shutil.rmtree(gguf_dir, ignore_errors=True)

    load_after = os.getloadavg()[0]
    report["load_average"] = {"before": load_before, "after": load_after}
    tests = [f"pp{n}" for n in args.prefill] + ([f"tg{args.decode}"] if args.decode else [])
    # piped to a file or a log, rich would assume 80 columns and break table cells: give it room
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
    console.print()
    for case, results in measured:
        for table in render_tables(case, results, tests, args):
            console.print(table)
        firsts = {label: r["first_token"] for label, r in results.items() if r.get("first_token") is not None}
        if len(firsts) > 1:  # a cheap check that every system got the same weights
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
    return 1 if any("error" in r for _, results in measured for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
