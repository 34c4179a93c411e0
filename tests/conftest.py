"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the alignment/ scripts are imported as a package from the repository root
    sys.path.insert(0, str(ROOT))

# CI's two test processes share two cores, each running 2-thread kernels (numba's OpenMP pool,
# torch's in the alignment checks, the daemons the tests start): OpenMP threads that spin while
# waiting for work take the core another process needs (decode measured 1.3-1.5x slower beside
# one busy process). Read when OpenMP loads, so before any kernel runs; the daemons inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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
            why = "vnni takes int8's place on AVX512-VNNI" if missing == ["int8"] else "the CPU lacks the instructions"
            pytest.skip(f"no {', '.join(missing)} kernel path here: {why}")
        monkeypatch.setattr(cpu, "ENABLED", cpu.choose(None if kernels == "default" else kernels))

    return use



# ---- the Runtime in process ------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    """The built-in SmolLM2 engine (2 slots of 512 tokens), shared by a module's Runtimes."""
    from ellmd.engine import Engine
    from ellmd.engine.engine import builtin_model_path

    return Engine(builtin_model_path(), sequence_length=512, batch_size=2, chunk_size=64, threads=2)


class Runtimes:
    """start(**options) -> a Runtime over `engine` (its slots emptied) and the store in `path`, its
    engine loop running on a thread of its own; `stop(rt)` ends it (as shutdown does) and closes its
    store, and every one still running is stopped after the test."""

    def __init__(self, engine, path: Path):
        self.engine, self.path, self.running = engine, path, []

    def __call__(self, **options):
        from ellmd.runtime.runtime import Runtime
        from ellmd.runtime.store.lmdb import Store

        for slot in range(self.engine.kv.slots):
            self.engine.rewind(slot, 0)
        rt = Runtime(self.engine, Store(self.path), **options)
        thread = threading.Thread(target=rt.run, name="engine-test", daemon=True)
        thread.start()
        self.running.append((rt, thread))
        return rt

    def stop(self, rt) -> None:
        if not rt._stopped.is_set():
            rt.stop(timeout=60)
            rt.store.close()

    def stop_all(self) -> None:
        for rt, thread in self.running:
            self.stop(rt)
            thread.join(60)


@pytest.fixture
def start(engine, tmp_path):
    """Runtimes on tmp_path/store (see Runtimes)."""
    runtimes = Runtimes(engine, tmp_path / "store")
    yield runtimes
    runtimes.stop_all()


@pytest.fixture
def runtime(start, tmp_path):
    """A running Runtime, its skill library holding one skill (git)."""
    from ellmd.runtime.context.skills import SkillLibrary

    (tmp_path / "skills" / "git").mkdir(parents=True)
    (tmp_path / "skills" / "git" / "SKILL.md").write_text("---\nname: git\ndescription: Use git.\n---\nCommit.\n")
    return start(skills=SkillLibrary([tmp_path / "skills"], plugins=False))
