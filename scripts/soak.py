"""Soak test: many clients on one daemon for minutes, mixed ops, then every acknowledged turn checked.

N clients (threads, one connection each) run for T minutes over a set of stored sessions (more
sessions than slots, so sessions keep leaving and re-entering slots): chat, generate with a
cancellation, fork (the fork chats once and is deleted), rewind, snapshot, list, show, and
disconnects mid-stream. A client holds a session while it works on it (a session generates for one
request at a time), and records the session's turn log after each acknowledged op; the log must
still begin with those turns at the end, after a restart of the daemon too. A session near its
sequence length is rewound to its first turn.

    .venv/bin/python scripts/soak.py                        # 16 clients, 10 minutes, 4 slots, 12 sessions
    .venv/bin/python scripts/soak.py --minutes 2 --json
    .venv/bin/python scripts/soak.py --socket /run/user/1000/ellm/ellmd.sock --pid 1234

Prints requests, errors by code, lost turns, latency percentiles per op and the daemon's RSS over
time; exits non-zero on any error or lost turn.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from ellm import Client, EllmError  # noqa: E402

OPS = {"chat": 35, "generate_cancel": 10, "fork": 7, "rewind": 10, "snapshot": 10, "list": 10, "show": 10,
       "disconnect": 8}
PROMPTS = ["Name a fruit.", "Tell me a fact about the sea.", "Count to three.", "What is 2 + 2?",
           "Say something kind.", "Describe a cloud in five words."]
SEQUENCE_LENGTH = 2048
SAMPLE_S = 10.0  # RSS sampling period


def turns_of(info: dict) -> list[tuple]:
    return [(t["kind"], t["start"], t["end"]) for t in info["turns"]]


class Soak:
    """The shared state of one soak run: sessions, their acknowledged turns, figures."""

    def __init__(self, socket_path: Path, sessions: int, seed: int):
        self.socket_path = socket_path
        self.rng = random.Random(seed)
        self.locks: dict[str, threading.Lock] = {}
        self.acknowledged: dict[str, list[tuple]] = {}  # session -> turns it had after its last acknowledged op
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: Counter = Counter()
        self.error_samples: list[str] = []
        self.requests = 0
        self.lock = threading.Lock()
        with Client(socket_path, timeout=300) as client:
            for i in range(sessions):
                session = client.open_session(title=f"soak {i}", system="You are brief.")
                session.chat(PROMPTS[i % len(PROMPTS)], max_tokens=8)
                self.locks[session.id] = threading.Lock()
                self.acknowledged[session.id] = turns_of(session.info())

    def timed(self, op: str, function):
        started = time.perf_counter()
        try:
            return function()
        except EllmError as e:
            with self.lock:
                self.errors[e.code or type(e).__name__] += 1
                if len(self.error_samples) < 10:
                    self.error_samples.append(f"{op}: {e.code}: {e}")
            return None
        finally:
            with self.lock:
                self.requests += 1
                self.latency[op].append(time.perf_counter() - started)

    def pick_session(self, rng: random.Random) -> str | None:
        ids = list(self.locks)
        rng.shuffle(ids)
        for session_id in ids:
            if self.locks[session_id].acquire(blocking=False):
                return session_id
        return None

    def client_loop(self, index: int, deadline: float) -> None:
        rng = random.Random(index)
        names, weights = list(OPS), list(OPS.values())
        client = Client(self.socket_path, timeout=300)
        try:
            while time.monotonic() < deadline:
                op = rng.choices(names, weights)[0]
                if op == "list":
                    self.timed(op, client.list_sessions)
                    continue
                session_id = self.pick_session(rng)
                if session_id is None:
                    time.sleep(0.01)
                    continue
                try:
                    self.run_op(client, op, client.session(session_id), rng)
                finally:
                    self.locks[session_id].release()
        finally:
            client.close()

    def run_op(self, client: Client, op: str, session, rng: random.Random) -> None:
        info = self.timed("show", session.info)
        if info is None:
            return
        if info["tokens"] > SEQUENCE_LENGTH * 0.6:  # keep clear of the sequence length
            op = "rewind"
        elif op == "rewind" and len(info["turns"]) <= 2:
            op = "chat"  # nothing to rewind past the system message
        if op == "chat":
            self.timed(op, lambda: session.chat(rng.choice(PROMPTS), max_tokens=rng.randint(4, 24)))
        elif op == "generate_cancel":
            def cancelled():
                stream = session.chat(rng.choice(PROMPTS), stream=True, max_tokens=200, ignore_eos=True)
                for n, _ in enumerate(stream):
                    if n == 2:
                        break
                stream.close()
            self.timed(op, cancelled)
        elif op == "fork":
            def fork_chat_delete():
                fork = session.fork(title="soak fork")
                fork.chat("And then?", max_tokens=4)
                fork.delete()
            self.timed(op, fork_chat_delete)
        elif op == "rewind":
            turn = 1 if info["tokens"] > SEQUENCE_LENGTH * 0.6 else len(info["turns"]) - 2
            self.timed(op, lambda: session.rewind(turn=turn))
        elif op == "snapshot":
            self.timed(op, session.snapshot)
        elif op == "disconnect":
            self.timed(op, lambda: self.disconnect_mid_stream(session.id))
        self.record(session)

    def disconnect_mid_stream(self, session_id: str) -> None:
        """A second connection starts a generation and hangs up after two tokens."""
        other = Client(self.socket_path, timeout=300)
        stream = other.session(session_id).chat("Tell me a long story.", stream=True, max_tokens=300, ignore_eos=True)
        for n, _ in enumerate(stream):
            if n == 1:
                break
        other.close()  # the connection goes with its stream unfinished: the daemon cancels it

    def record(self, session) -> None:
        """The session's turns once it is idle again: what later checks hold it to."""
        deadline = time.monotonic() + 60
        while True:
            info = self.timed("show", session.info)
            if info is None:
                return
            if not info["busy"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.acknowledged[session.id] = turns_of(info)

    def lost_turns(self) -> tuple[int, int]:
        """(turns acknowledged, of them missing now)."""
        total = lost = 0
        with Client(self.socket_path, timeout=300) as client:
            for session_id, expected in self.acknowledged.items():
                now = turns_of(client.session(session_id).info())
                total += len(expected)
                lost += sum(1 for a, b in zip(expected, now + [None] * len(expected)) if a != b)
        return total, lost


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run(soak: Soak, clients: int, minutes: float, pid: int | None) -> list[dict]:
    """Run the clients; returns the RSS samples [{t, rss_mib, requests, errors}]."""
    deadline = time.monotonic() + minutes * 60
    threads = [threading.Thread(target=soak.client_loop, args=(i, deadline), daemon=True) for i in range(clients)]
    started = time.monotonic()
    for t in threads:
        t.start()
    samples = []
    while any(t.is_alive() for t in threads):
        samples.append({"t": round(time.monotonic() - started), "rss_mib": round(rss_mib(pid), 1) if pid else None,
                        "requests": soak.requests, "errors": sum(soak.errors.values())})
        next_sample = time.monotonic() + SAMPLE_S
        while time.monotonic() < next_sample and any(t.is_alive() for t in threads):
            time.sleep(0.2)
    for t in threads:
        t.join(timeout=600)
    samples.append({"t": round(time.monotonic() - started), "rss_mib": round(rss_mib(pid), 1) if pid else None,
                    "requests": soak.requests, "errors": sum(soak.errors.values())})
    return samples


def report(soak: Soak, samples: list[dict], lost: dict, seconds: float) -> dict:
    every = [v for values in soak.latency.values() for v in values]
    return {
        "requests": soak.requests, "seconds": round(seconds, 1), "errors": dict(soak.errors),
        "error_samples": soak.error_samples, **lost,
        "latency_ms": {op: {"n": len(v), "p50": round(percentile(v, 0.5) * 1e3, 1), "p99": round(percentile(v, 0.99) * 1e3, 1)}
                       for op, v in sorted(soak.latency.items())},
        "p50_ms": round(percentile(every, 0.5) * 1e3, 1), "p99_ms": round(percentile(every, 0.99) * 1e3, 1),
        "rss": samples,
    }


def print_report(figures: dict) -> None:
    print(f"requests {figures['requests']} in {figures['seconds']} s, errors {sum(figures['errors'].values())} "
          f"{figures['errors'] or ''}")
    print(f"turns acknowledged {figures['turns']}, lost {figures['lost_turns']}, lost after restart "
          f"{figures.get('lost_after_restart', '-')}")
    print(f"latency all ops: p50 {figures['p50_ms']} ms, p99 {figures['p99_ms']} ms")
    print(f"{'op':<16}{'n':>8}{'p50 ms':>10}{'p99 ms':>10}")
    for op, row in figures["latency_ms"].items():
        print(f"{op:<16}{row['n']:>8}{row['p50']:>10}{row['p99']:>10}")
    print(f"{'t (s)':>6}{'RSS MiB':>10}{'requests':>10}{'errors':>8}")
    for sample in figures["rss"]:
        print(f"{sample['t']:>6}{sample['rss_mib'] if sample['rss_mib'] is not None else '-':>10}"
              f"{sample['requests']:>10}{sample['errors']:>8}")
    for sample in figures["error_samples"]:
        print("  error:", sample)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--slots", type=int, default=4, help="KV slots of the daemon started here")
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--socket", type=Path, help="a running daemon's socket [default: start one]")
    parser.add_argument("--pid", type=int, help="with --socket: the daemon's pid, for its RSS")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    from daemon import Daemon

    with tempfile.TemporaryDirectory() as tmp:
        daemon = None
        if args.socket is None:
            daemon = Daemon(Path(tmp), slots=args.slots).start()
        socket_path = args.socket or daemon.socket
        pid = daemon.process.pid if daemon else args.pid
        soak = Soak(socket_path, args.sessions, args.seed)
        started = time.monotonic()
        samples = run(soak, args.clients, args.minutes, pid)
        seconds = time.monotonic() - started
        turns, lost = soak.lost_turns()
        figures = {"turns": turns, "lost_turns": lost}
        if daemon is not None:  # and every acknowledged turn survives a restart
            assert daemon.stop() == 0
            daemon = Daemon(Path(tmp), slots=args.slots).start()
            figures["lost_after_restart"] = soak.lost_turns()[1]
            daemon.stop()
        figures = report(soak, samples, figures, seconds)
        print(json.dumps(figures) if args.json else "", end="\n" if args.json else "")
        if not args.json:
            print_report(figures)
        bad = sum(figures["errors"].values()) or figures["lost_turns"] or figures.get("lost_after_restart")
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
