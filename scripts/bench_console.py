"""What the web console costs: its session list's latency with many stored sessions while two
sessions generate, and the generating sessions' tok/s with and without a console open.

Starts the real daemon (`ellmd start --http`, built-in model unless --model-path), makes
--sessions stored sessions over the socket, then runs two streamed generations of --tokens tokens
each (greedy, ignore_eos) twice: alone, and with a console open, which polls `/api/live` every
second (the live page) and `/api/sessions` every --list-every seconds (a sessions page refreshed).
Printed: the list's and the live view's latency (p50, max), and each run's decode tok/s (the mean
of the two generations' `decode_tok_s`).

    .venv/bin/python scripts/bench_console.py
    .venv/bin/python scripts/bench_console.py --sessions 200 --tokens 512 --json
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from daemon import Daemon  # noqa: E402  (the tests' daemon subprocess)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_get(port: int, path: str) -> float:
    """Milliseconds to GET `path` and read its whole body."""
    began = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as reply:
        reply.read()
    return (time.perf_counter() - began) * 1000


def generate_two(daemon: Daemon, tokens: int) -> float:
    """Mean decode tok/s of two sessions generating at once."""
    rates = []

    def one(index: int) -> None:
        with daemon.client() as client:
            session = client.open_session(title=f"generating {index}")
            result = session.chat("Count slowly.", max_tokens=tokens, ignore_eos=True, temperature=0)
            rates.append(result.usage["decode_tok_s"])
            session.delete()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statistics.mean(rates)


def console(port: int, stop: threading.Event, list_every: float, latencies: dict) -> None:
    """Poll as an open console does, recording each request's latency."""
    last_list = 0.0
    while not stop.is_set():
        latencies["live"].append(timed_get(port, "/api/live"))
        if time.monotonic() - last_list >= list_every:
            latencies["sessions"].append(timed_get(port, "/api/sessions"))
            last_list = time.monotonic()
        stop.wait(1.0)


def summary(values: list[float]) -> dict:
    return {"n": len(values), "p50_ms": round(statistics.median(values), 1), "max_ms": round(max(values), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--sessions", type=int, default=200, help="stored sessions")
    parser.add_argument("--tokens", type=int, default=512, help="tokens each generating session makes")
    parser.add_argument("--list-every", type=float, default=2.0, help="seconds between session list refreshes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp).chmod(0o700)
        extra = ["--http", f"127.0.0.1:{port}"] + (["--model-path", args.model_path] if args.model_path else [])
        daemon = Daemon(Path(tmp), slots=4, extra=extra).start()
        try:
            with daemon.client() as client:
                for i in range(args.sessions):
                    client.open_session(title=f"stored {i}", tags=["bench"], system=f"You are agent number {i}.")
            alone = generate_two(daemon, args.tokens)
            latencies = {"live": [], "sessions": []}
            stop = threading.Event()
            poller = threading.Thread(target=console, args=(port, stop, args.list_every, latencies))
            poller.start()
            watched = generate_two(daemon, args.tokens)
            stop.set()
            poller.join()
        finally:
            daemon.stop()
    report = {"sessions": args.sessions, "tokens": args.tokens, "decode_tok_s_alone": round(alone, 2),
              "decode_tok_s_with_console": round(watched, 2), "api_sessions": summary(latencies["sessions"]),
              "api_live": summary(latencies["live"])}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{args.sessions} stored sessions, two sessions generating {args.tokens} tokens each")
    print(f"decode tok/s (mean of the two): alone {alone:.2f}, with a console open {watched:.2f}")
    for name in ("api_sessions", "api_live"):
        figures = report[name]
        print(f"GET /{name.replace('_', '/')}: p50 {figures['p50_ms']} ms, max {figures['max_ms']} ms ({figures['n']} requests)")


if __name__ == "__main__":
    main()
