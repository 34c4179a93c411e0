"""Alignment of the real SmolLM2 with Hugging Face transformers: every alignment/ script must exit 0.

Apart from test_alignment.py (the tiny random checkpoints) so that the two files, the longest of
the suite, run on both of CI's workers at once.
"""

from __future__ import annotations

import pytest

from test_alignment import run


def test_smollm2_greedy():
    assert run("smollm2_greedy", ["--prompts", "5"]) == 0


@pytest.mark.parametrize("kernels", ["default", "portable", "vnni"])
def test_quantized_at_load(alignment_dir, kernels, use_kernels):
    use_kernels(kernels)
    assert run("quantized_at_load", ["--dir", str(alignment_dir), "--kernels", kernels]) == 0


@pytest.mark.parametrize("kernels", ["default", "portable"])  # default: int16 activations where the CPU has AVX2 or VNNI
def test_smollm2_gguf_blocks(kernels):
    assert run("quantized", ["--prompts", "2", "--kernels", kernels]) == 0


@pytest.mark.parametrize("kernels", ["vnni", "int16,int8"])  # AVX512-VNNI's int8 path, AVX2's
def test_smollm2_gguf_blocks_int8_activations(use_kernels, kernels):
    use_kernels(kernels)
    assert run("quantized", ["--prompts", "2", "--kernels", kernels, "--builtin-only"]) == 0


def test_perplexity_with_bf16_kv_equals_transformers():
    assert run("perplexity", []) == 0
