"""Shared pieces of the alignment checks: error figures, the reference model, argument parsing.

Every check prints one line per comparison:

    name                                 max abs 1.2e-06  max rel 3.4e-07  (max|ref| 3.5)  tol 1e-03  PASS

where max rel is max abs divided by max |reference| (an error relative to the scale of the
quantity, not element by element, so near-zero reference values do not blow it up), and exits
non-zero when any comparison is past its tolerance.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python alignment/x.py` from anywhere
    sys.path.insert(0, str(ROOT))

# Default tolerance with f32 weights and f32 KV: max abs logit error <= TOL x max |logit|. bf16
# weights meet it with activations in two bf16 halves (kernel_paths("two-halves"), the model checks'
# arithmetic); the default rounds them once, held to transformers' own bf16 error by rounded_activations.
TOL = 1e-3
DEFAULT_DIR_ENV = "ELLM_ALIGNMENT_DIR"


class Report:
    """Collects comparisons; `exit_code()` is 0 when every one passed."""

    def __init__(self, title: str | None):
        self.title = title
        self.failures: list[str] = []
        self.count = 0
        if title:
            print(f"== {title}", flush=True)

    def compare(self, name: str, ours, reference, tol: float = TOL) -> bool:
        """Print max abs and max relative error of ours vs reference; tol bounds the relative one."""
        ours = np.asarray(ours, np.float64)
        reference = np.asarray(reference, np.float64)
        self.count += 1
        if ours.shape != reference.shape:
            print(f"  {name:44s} shape {ours.shape} != reference {reference.shape}  FAIL", flush=True)
            self.failures.append(name)
            return False
        if not np.all(np.isfinite(ours)):
            print(f"  {name:44s} non-finite values in ours  FAIL", flush=True)
            self.failures.append(name)
            return False
        scale = float(np.max(np.abs(reference))) if reference.size else 0.0
        abs_err = float(np.max(np.abs(ours - reference))) if reference.size else 0.0
        rel_err = abs_err / scale if scale > 0 else abs_err
        ok = rel_err <= tol
        print(
            f"  {name:44s} max abs {abs_err:.2e}  max rel {rel_err:.2e}  (max|ref| {scale:.3g})  "
            f"tol {tol:.0e}  {'PASS' if ok else 'FAIL'}",
            flush=True,
        )
        if not ok:
            self.failures.append(name)
        return ok

    def info(self, name: str, ours, reference, why: str = "not checked") -> None:
        """The figures of a comparison that is reported but not checked."""
        ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
        scale = float(np.max(np.abs(reference)))
        abs_err = float(np.max(np.abs(ours - reference)))
        print(f"  {name:44s} max abs {abs_err:.2e}  max rel {abs_err / scale:.2e}  (max|ref| {scale:.3g})  ({why})", flush=True)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """A yes/no check (identical token ids, same experts chosen, ...)."""
        self.count += 1
        print(f"  {name:44s} {detail}  {'PASS' if ok else 'FAIL'}", flush=True)
        if not ok:
            self.failures.append(name)
        return ok

    def note(self, text: str) -> None:
        print(f"  {text}", flush=True)

    def exit_code(self) -> int:
        if self.failures:
            print(f"== {self.title}: {len(self.failures)} of {self.count} FAILED: {', '.join(self.failures)}", flush=True)
            return 1
        print(f"== {self.title}: all {self.count} passed", flush=True)
        return 0


def compare(name: str, ours, reference, tol: float = TOL) -> bool:
    """One-off comparison outside a Report (prints the same line)."""
    return Report(None).compare(name, ours, reference, tol)


def run(main) -> None:
    """`if __name__ == "__main__": run(main)`: exit with main's code."""
    sys.exit(main())


# ---- arguments ------------------------------------------------------------------------------


def parser(description: str, variants: bool = True, default_variants=None) -> argparse.ArgumentParser:
    """The common options: --dir (checkpoint cache) and --variant (repeatable)."""
    p = argparse.ArgumentParser(description=description)
    if variants:
        from alignment.checkpoints import FAMILY_VARIANTS, VARIANTS

        p.add_argument(
            "--dir",
            default=os.environ.get(DEFAULT_DIR_ENV),
            help=f"checkpoint cache directory (default: ${DEFAULT_DIR_ENV} or a temporary directory)",
        )
        p.add_argument(
            "--variant",
            action="append",
            choices=list(dict.fromkeys([*VARIANTS, *FAMILY_VARIANTS])),
            help="checkpoint variant or family (repeatable; default: %s)" % ("all" if default_variants is None else ", ".join(default_variants)),
        )
        p.set_defaults(default_variants=default_variants)
    return p


def selected_variants(args) -> list[str]:
    from alignment.checkpoints import FAMILY_VARIANTS, VARIANTS

    names = args.variant or args.default_variants or list(VARIANTS)
    return [FAMILY_VARIANTS.get(n, n) for n in names]


@functools.lru_cache(maxsize=None)
def _temporary_root() -> Path:
    root = tempfile.mkdtemp(prefix="ellm-alignment-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return Path(root)


def checkpoint(args, name: str) -> Path:
    """The directory of a tiny checkpoint variant, written on first use."""
    from alignment.checkpoints import ensure

    root = Path(args.dir) if args.dir else _temporary_root()
    return ensure(root, name)


def engine_dtype(name: str) -> str | None:
    """bf16 checkpoints run with their native bf16 weights (the engine's default); f32 ones in f32."""
    from alignment.checkpoints import VARIANTS

    return None if VARIANTS[name]["dtype"] == "bfloat16" else "f32"


def random_tokens(count: int, seed: int, vocab: int | None = None) -> list[int]:
    from alignment.checkpoints import VOCAB

    return np.random.default_rng(seed).integers(0, vocab or VOCAB, count).tolist()


# ---- the reference (transformers, torch fp32) -------------------------------------------------


KERNEL_CHOICES = ["default", "portable", "int16", "vnni", "int16,int8"]
KERNEL_HELP = "kernel paths (cpu.py): default is what the daemon runs unless ELLM_KERNELS says otherwise"


def int8_activations() -> bool:
    """True when block weights meet int8-quantized activations (the approximate "vnni" path, or on
    AVX2 "int8" for the tiles of 4- to 6-bit codes)."""
    from ellmd.kernels import cpu

    return bool({"vnni", "int8"} & cpu.ENABLED)


@contextlib.contextmanager
def kernel_paths(request: str):
    """Run the block (or a decorated function) with the kernel paths of an ELLM_KERNELS value
    (cpu.py), of cpu.DEFAULT for "default", or of cpu.DEFAULT with bf16 products on two halves of
    each activation for "two-halves"; SystemExit naming a path this CPU lacks."""
    from ellmd.kernels import cpu

    if request in ("default", "two-halves"):  # the default paths this CPU has
        rounding = {"bf16-round"} if request == "two-halves" else set()
        request = ",".join(sorted(cpu.choose(cpu.DEFAULT) - rounding)) or "portable"
    paths = cpu.choose(request)
    missing = sorted({p.strip() for p in request.split(",")} & set(cpu.PATHS) - paths)
    if missing:
        raise SystemExit(f"this CPU lacks the {', '.join(missing)} kernel path: it cannot run here")
    saved, cpu.ENABLED = cpu.ENABLED, paths
    try:
        yield
    finally:
        cpu.ENABLED = saved


def torch_setup() -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


@functools.lru_cache(maxsize=None)
def reference_model(path: str | Path):
    """transformers fp32 model from a checkpoint directory or a .gguf file (dequantized to fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_setup()
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        with contextlib.redirect_stderr(io.StringIO()):  # its de-quantizing progress bar
            model = _gguf_reference_model(path)
    else:
        kwargs = {}
        if json.loads((path / "config.json").read_text()).get("model_type") == "qwen3_moe":
            kwargs["experts_implementation"] = "eager"  # the plain loop over experts, not grouped_mm
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **kwargs)
    model.eval()
    return model


def _gguf_reference_model(path: Path):
    """A plain fp32 transformers model with every GGUF tensor dequantized at load.

    transformers 5 would keep quantized blocks packed when the `kernels` package offers a GGUF
    matmul; GgufConfig(dequantize=True) asks for the plain dense model. Its GGUF loading needs
    accelerate: without it, the same dequantized tensors are read with transformers' own
    load_gguf_checkpoint into a model built from the GGUF's config (identical logits).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import is_accelerate_available

    try:
        from transformers.utils.quantization_config import GgufConfig

        options = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:  # transformers 4: GGUF files are always dequantized
        options = {}
    if is_accelerate_available():
        return AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager", **options
        )
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"{path}: GGUF tensors do not fit the model (missing {missing}, unexpected {result.unexpected_keys})")
    return model


@functools.lru_cache(maxsize=2)
def reference_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(path)


def chat_ids(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    """transformers' rendering + tokenization of a conversation, as a list of ids."""
    encoding = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(encoding["input_ids"] if hasattr(encoding, "keys") else encoding)  # BatchEncoding in transformers 5


def reference_logits(model, tokens) -> np.ndarray:
    """Logits [n, V] of one sequence, all positions, in fp32."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        return model(input_ids=ids).logits[0].float().numpy()


def reference_greedy(model, tokens, max_new_tokens: int, eos_token_id=None) -> list[int]:
    """transformers' own greedy generation (do_sample=False), new tokens only."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id[0] if isinstance(eos_token_id, list) else eos_token_id,
        )
    return out[0, len(tokens) :].tolist()


# ---- the engine ------------------------------------------------------------------------------


_ENGINES: dict[tuple, object] = {}


def make_engine(path, *, weight_dtype="f32", kv_dtype="f32", sequence_length=64, batch_size=3, chunk_size=64, reuse=None):
    """An Engine with every slot empty.

    Engines of tiny checkpoint directories are kept and handed out again (slots rewound to 0) to
    the next check asking for the same settings: building one costs about a second, mostly the
    tokenizer. `reuse=False` always builds a new one; GGUF engines are never kept (they are big).
    """
    from ellmd.engine import Engine

    path = Path(path)
    reuse = path.is_dir() if reuse is None else reuse
    key = (str(path), weight_dtype, kv_dtype, sequence_length, batch_size, chunk_size)
    if reuse and key in _ENGINES:
        engine = _ENGINES[key]
        for slot in range(batch_size):
            engine.rewind(slot, 0)
        return engine
    engine = Engine(
        path,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        sequence_length=sequence_length,
        batch_size=batch_size,
        chunk_size=chunk_size,
    )
    if reuse:
        _ENGINES[key] = engine
    return engine


def kernel(name: str):
    """A kernel (or its numpy reference, `<name>_ref`) from ellmd.kernels, wherever it lives."""
    import importlib
    import pkgutil

    import ellmd.kernels as package

    found = getattr(package, name, None)
    if callable(found):  # not the submodule of the same name
        return found
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"ellmd.kernels.{info.name}")
        if callable(getattr(module, name, None)):
            return getattr(module, name)
    raise ImportError(f"ellmd.kernels has no {name}")
