"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the alignment/ scripts are imported as a package from the repository root
    sys.path.insert(0, str(ROOT))

# CI's two workers share two cores, each running 2-thread kernels (numba's OpenMP pool, torch's in
# the alignment checks, the daemons the tests start): OpenMP threads that spin while waiting for
# work take the core another process needs (decode measured 1.3-1.5x slower beside one busy
# process). Read when OpenMP loads, so before any kernel runs; the daemons inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The files that take longest (20 daemon starts; transformers on SmolLM2; the MoE GGUF), run
# first: with a file per worker (CI's -n 2 --dist loadfile), one that starts last ends the run alone.
LONGEST_FIRST = ("test_alignment_smollm2.py", "test_alignment.py", "test_crash.py", "test_moe_gguf.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def alignment_dir(tmp_path_factory):
    """A directory holding every tiny random checkpoint variant of alignment/checkpoints.py.

    Written once per test session (a few seconds with transformers); tests pass it to the
    alignment scripts as --dir.
    """
    from alignment.checkpoints import ensure_all

    root = tmp_path_factory.mktemp("alignment-checkpoints")
    ensure_all(root)
    return root


@pytest.fixture
def use_kernels(monkeypatch):
    """use_kernels("int16"): the kernels take the paths of that ELLM_KERNELS value ("default":
    cpu.DEFAULT) for this test; skipped when the CPU lacks the instructions of a path it names,
    which cannot run here."""
    from ellmd.kernels import cpu

    def use(kernels: str) -> None:
        missing = sorted({p.strip() for p in kernels.split(",")} & set(cpu.PATHS) - cpu.host_paths())
        if missing:
            pytest.skip(f"this CPU lacks the instructions of the {', '.join(missing)} kernel path")
        monkeypatch.setattr(cpu, "ENABLED", cpu.choose(None if kernels == "default" else kernels))

    return use

