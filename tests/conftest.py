"""Shared pytest fixtures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the alignment/ scripts are imported as a package from the repository root
    sys.path.insert(0, str(ROOT))


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
