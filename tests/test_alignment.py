"""Alignment with Hugging Face transformers: every alignment/ script must exit 0.

Each script prints its error figures (shown by pytest -s, or on failure). The tiny random
checkpoints come from the session fixture `alignment_dir`; the SmolLM2 checks use the built-in
model's GGUF. torch and transformers are development dependencies, which the test set-up installs.
"""

from __future__ import annotations

import importlib

import pytest

from alignment.checkpoints import VARIANTS

MODEL_CHECKS = ["one_token", "multi_token", "multi_batch", "incremental_prefill", "kv_roundtrip"]
KERNEL_CHECKS = ["rmsnorm", "rope", "silu_mul", "moe_routing"]


def run(script: str, argv: list[str]) -> int:
    return importlib.import_module(f"alignment.{script}").main(argv)


@pytest.mark.parametrize("script", KERNEL_CHECKS)
def test_kernel(script):
    assert run(script, []) == 0


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("script", MODEL_CHECKS)
def test_model(script, variant, alignment_dir):
    assert run(script, ["--dir", str(alignment_dir), "--variant", variant]) == 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_head_dim(family, alignment_dir):
    assert run("head_dim", ["--dir", str(alignment_dir), "--family", family]) == 0


def test_kv_dtype_report(alignment_dir):
    assert run("kv_dtype_report", ["--dir", str(alignment_dir)]) == 0


def test_rounded_activations(alignment_dir):
    from ellmd.kernels import cpu

    if not {"bf16", "dpbf16"} & cpu.host_paths():
        pytest.skip("this CPU has neither AMX-BF16 nor AVX512-BF16: the bf16-round path cannot run here")
    assert run("rounded_activations", ["--dir", str(alignment_dir)]) == 0
