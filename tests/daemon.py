"""The real daemon as a subprocess, on a temporary socket and store, for the tests that need it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ellm import Client

ROOT = Path(__file__).resolve().parent.parent


class Daemon:
    """`ellmd start` in the foreground, as a subprocess."""

    def __init__(self, tmp: Path, slots: int = 2, extra=()):
        self.socket = tmp / "ellmd.sock"
        self.store = tmp / "store"
        self.log = tmp / "ellmd.log"
        self.args = [sys.executable, "-m", "ellmd.cli", "start", "--socket", str(self.socket), "--store",
                     str(self.store), "--batch-size", str(slots), "--sequence-length", "2048",
                     "--chunk-size", "256", "--threads", "2", *extra]
        self.process = None

    def start(self) -> "Daemon":
        env = {**os.environ, "XDG_CONFIG_HOME": str(self.store.parent / "config")}
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=log, env=env, cwd=ROOT)
        deadline = time.monotonic() + 600  # a cold start compiles the kernels: minutes beside another test worker
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.log.read_text()[-2000:]}")
            if self.socket.exists():
                try:
                    Client(self.socket).close()
                    return self
                except Exception:
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"daemon did not start in 600 s: {self.log.read_text()[-2000:]}")

    def client(self) -> Client:
        return Client(self.socket)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            stacks = self.stacks()
            self.kill()
            raise AssertionError(f"the daemon did not stop in 120 s after SIGTERM; its threads:\n{stacks}") from None

    def stacks(self, timeout: float = 60) -> str:
        """Every thread's stack, as the daemon writes them to its log on SIGUSR1."""
        before = self.log.stat().st_size
        self.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        # the main thread is the oldest, written last: its stack ends in runpy
        while "_run_module_as_main" not in (dump := self.log.read_bytes()[before:].decode(errors="replace")):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        return dump

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)
