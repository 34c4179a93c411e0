"""A seeded fuzzer of frames and op arguments against the real daemon (scripts/fuzz_ops.py).

10,000 requests here (the script runs any number: `python scripts/fuzz_ops.py --socket ...
--requests 100000`). Every request gets one reply with a PROTOCOL.md code, none `internal`, and
afterwards a fresh client still opens a session and generates.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from daemon import ROOT, Daemon

spec = importlib.util.spec_from_file_location("fuzz_ops", ROOT / "scripts" / "fuzz_ops.py")
fuzz_ops = sys.modules["fuzz_ops"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(fuzz_ops)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("fuzz"), slots=2).start()
    yield d
    assert d.stop() == 0  # and it stops cleanly after all that


def test_ten_thousand_fuzzed_requests_leave_the_daemon_serving(daemon):
    stats = fuzz_ops.fuzz(str(daemon.socket), requests=10_000, seed=8)
    assert stats["requests"] == 10_000 and stats["broken_frames"] > 100
    assert stats["internal"] == []
    assert stats["ok"] > 200 and stats["errors"]["bad_request"] > 5000  # mostly wrong, some deep
    assert daemon.process.poll() is None
    assert fuzz_ops.still_serves(str(daemon.socket))
    assert "Traceback" not in daemon.log.read_text()
