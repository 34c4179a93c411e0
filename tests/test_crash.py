"""SIGKILL inside open, append, snapshot, fork, rewind and import transactions (scripts/crash_loop.py).

20 iterations here (`python scripts/crash_loop.py --iterations 200` for more): after every kill
each acknowledged turn is there and the resumed KV gives bit-identical logits to a recompute.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from daemon import ROOT

spec = importlib.util.spec_from_file_location("crash_loop", ROOT / "scripts" / "crash_loop.py")
crash_loop = sys.modules["crash_loop"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(crash_loop)


@pytest.mark.timeout(1800)  # 20 daemon starts: ~7 min on a quiet machine, twice that on a busy one
def test_sigkill_loses_no_acknowledged_turn(tmp_path):
    figures = crash_loop.crash_loop(tmp_path, iterations=20, seed=3)
    assert figures["lost"] == []
    assert figures["sigkills"] == 20 and figures["exit_code"] == 0
    assert figures["sessions_checked"] >= 20 and figures["logits_compared"] >= 10
    assert sum(figures["ops"].get(k, 0) for k in ("fork", "rewind", "import")) >= 5
    assert sum(n for k, n in figures["in_flight"].items() if k != "none") >= 10  # kills landed inside ops
    # every other kill aimed, in turn, at the first write transaction of one kind of op
    assert figures["aimed"] == {"snapshot": 2, "fork": 2, "rewind": 2, "import": 2, "append": 1, "open": 1}
    inside = figures["killed_inside"]  # "op:transaction", from the daemon's log
    assert inside.get("snapshot:snapshot", 0) >= 1  # an explicit session.snapshot, killed before its commit
    assert {key.split(":")[0] for key in inside} >= set(crash_loop.TARGETS) and sum(inside.values()) >= 9


def test_the_model_of_acknowledged_state():
    model = crash_loop.Model().then("append", [1, 2, 3]).then("append", [4, 5]).then("rewind", 4).then("append", [9])
    assert model.tokens() == [1, 2, 3, 4, 9]
    assert model.turns() == [(0, 3), (4, 5)]
