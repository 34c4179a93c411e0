"""The fleet's bars, measured: session affinity on a multi-session trace, aggregate decode throughput
of 2 replicas x 1 thread against 1 replica x 1 thread, and acknowledged turns lost when a replica
is SIGKILLed mid-run.

    .venv/bin/python scripts/bench_fleet.py --sessions 8 --turns 4 --max-tokens 64

Each configuration is a real `ellmd fleet start` (the built-in model unless --model-path), driven
over HTTP by one client thread per session. A turn counts as kept on its replica when the
`X-Ellm-Replica` header names the replica of the session's previous turn; it is lost when its
reply's cached tokens do not cover the previous turn's prompt (the session came back without it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ellmd.fleet.app import READY_LINE
from ellmd.fleet.replica import replica_processes

ROOT = Path(__file__).resolve().parent.parent


def post(url: str, body: dict, session_id: str):
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "X-Session-Id": session_id})
    with urllib.request.urlopen(request, timeout=600) as response:
        return response.headers, json.loads(response.read())  # headers: case-insensitive


class Fleet:
    def __init__(self, args, replicas: int, workdir: Path):
        self.port = 18000 + replicas
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "ellmd.cli", "fleet", "start", "--replicas", str(replicas),
                   "--threads", str(args.threads), "--batch-size", str(args.sessions), "--sequence-length", "4096",
                   "--store", str(workdir / f"store-{replicas}"), "--http", f"127.0.0.1:{self.port}"]
        if args.model_path:
            command += ["--model-path", args.model_path]
        self.log = workdir / f"fleet-{replicas}.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                            env={**os.environ, "RAY_TMPDIR": str(workdir / "ray")})
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:  # until every replica is up
            if self.process.poll() is not None:
                raise SystemExit(f"the fleet exited: {self.log.read_text()[-2000:]}")
            if READY_LINE in self.log.read_text(errors="replace"):
                return
            time.sleep(1)
        raise SystemExit("the fleet did not start")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=300)


def trace(fleet: Fleet, args, tag: str, kill_after: int | None = None) -> dict:
    """Every session runs its turns in its own thread; returns the counts and the decode rate."""
    lock = threading.Lock()
    counts = {"turns": 0, "kept": 0, "moved_after_failure": 0, "lost": 0, "tokens": 0, "decode_s": 0.0}
    killed: list[str] = []

    def agent(s: int) -> None:
        history, replica, prompt = [], None, 0
        for t in range(args.turns):
            if kill_after is not None and t == kill_after and s == 0:
                victim = replica
                for pid in replica_processes(victim):
                    os.kill(pid, signal.SIGKILL)
                killed.append(victim)
            history.append({"role": "user", "content": f"Agent {s} asks, step {t}: write a short poem about {t + s}."})
            head, body = post(fleet.url, {"messages": history, "max_tokens": args.max_tokens, "temperature": 0,
                                          "ignore_eos": True}, f"{tag}-{s}")
            history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            usage = body["usage"]
            with lock:
                counts["turns"] += 1
                served = head["X-Ellm-Replica"]
                if replica is None or served == replica:
                    counts["kept"] += 1
                elif replica in killed:
                    counts["moved_after_failure"] += 1
                if t and usage["prompt_tokens_details"]["cached_tokens"] < prompt:
                    counts["lost"] += 1
                counts["tokens"] += usage["completion_tokens"]
            replica, prompt = served, usage["prompt_tokens"]

    began = time.perf_counter()
    threads = [threading.Thread(target=agent, args=(s,)) for s in range(args.sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    counts["seconds"] = time.perf_counter() - began
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=8, help="concurrent sessions (one client thread each)")
    parser.add_argument("--turns", type=int, default=4, help="turns per session")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per turn (ignore_eos)")
    parser.add_argument("--threads", type=int, default=1, help="kernel threads per replica")
    parser.add_argument("--model-path", help="default: the built-in model")
    args = parser.parse_args()
    console = Console()
    table = Table(title=f"fleet: {args.sessions} sessions x {args.turns} turns x {args.max_tokens} tokens")
    for column in ("replicas", "run", "turns", "affinity", "moved after failure", "lost", "tokens/s"):
        table.add_column(column, justify="right")
    rates = {}
    with tempfile.TemporaryDirectory(prefix="ellm-fleet-", dir="/tmp") as tmp:  # Ray's socket paths stay short
        for replicas in (1, 2):
            fleet = Fleet(args, replicas, Path(tmp))
            try:
                trace(fleet, args, "warm", None)  # first turns compile nothing, but fill caches
                runs = [("steady", trace(fleet, args, "steady"))]
                if replicas == 2:
                    runs.append(("SIGKILL a replica", trace(fleet, args, "kill", kill_after=args.turns // 2)))
            finally:
                fleet.stop()
            for name, c in runs:
                rate = c["tokens"] / c["seconds"]
                rates.setdefault(replicas, rate)
                affinity = c["kept"] / max(1, c["turns"] - c["moved_after_failure"])
                table.add_row(str(replicas), name, str(c["turns"]), f"{100 * affinity:.1f}%",
                              str(c["moved_after_failure"]), str(c["lost"]), f"{rate:.1f}")
    console.print(table)
    console.print(f"throughput 2 replicas / 1 replica: {rates[2] / rates[1]:.2f}x")


if __name__ == "__main__":
    main()
