"""Frame-level fuzzing of the daemon's Unix socket: random bytes, mutated and truncated valid
frames, random msgpack values (maps with integer, binary or unhashable keys, deep nesting).

Each connection says hello, sends a handful of fuzzed frames, closes its sending side and reads
whatever comes back until the daemon hangs up; every reply must be a well-formed error or result.
The ops fuzzed read state or fail (no generation, no session made): what a generation does with
odd arguments is the op-argument fuzzer's concern.

    .venv/bin/python scripts/fuzz_frames.py --frames 100000 --seed 1          # starts its own daemon
    .venv/bin/python scripts/fuzz_frames.py --socket /run/user/1000/ellm/ellmd.sock --frames 100000

It exits non-zero if the daemon died, replied with something that is not a protocol message,
logged a traceback, or cannot open a session and generate afterwards.
"""

from __future__ import annotations

import argparse
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

import msgpack

HELLO = msgpack.packb({"id": 0, "op": "hello", "args": {"protocol": 1, "client": "fuzz"}})
FRAMES_PER_CONNECTION = 16
# Valid requests of ops that change nothing (or fail cleanly): the seeds of the mutations.
SEEDS = [
    {"id": 1, "op": "stats", "args": {}},
    {"id": 2, "op": "session.list", "args": {}},
    {"id": 3, "op": "session.info", "args": {"session_id": "no-such-session"}},
    {"id": 4, "op": "cancel", "args": {"request_id": 1}},
    {"id": 5, "op": "skill.list", "args": {}},
    {"id": 6, "op": "rag.list", "args": {}},
    {"id": 7, "op": "session.import", "args": {"data": b"\x81\xa6format\xa3bad"}},
    {"id": 8, "op": "session.import", "args": {"data": b"piece", "more": True}},
    {"id": 9, "op": "session.import", "args": {"upload": "u8", "data": b"rest"}},
    {"id": 10, "op": "hello", "args": {"protocol": 2}},
    {"id": 11, "op": "no.such.op", "args": {"x": 1}},
]


def random_value(rng: random.Random, depth: int = 0):
    """A random msgpack-able value; maps may have keys of any type, which Python cannot always hash
    once unpacked (a map or an array as a key): those arrive as raw bytes, see random_frame."""
    kinds = ["int", "big", "float", "str", "bin", "bool", "nil"]
    if depth < 4:
        kinds += ["list", "map"]
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(-2**31, 2**31)
    if kind == "big":
        return rng.choice([2**63 - 1, -2**63, 2**64 - 1])
    if kind == "float":
        return rng.choice([0.0, -1.5, 1e308, float("inf"), float("nan"), rng.random()])
    if kind == "str":
        return "".join(rng.choice("ab.-_/\\\0é\u2028") for _ in range(rng.randint(0, 12)))
    if kind == "bin":
        return rng.randbytes(rng.randint(0, 16))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "nil":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = [rng.choice(["id", "op", "args", "session_id", "self", "request", "data", "more", "upload"]),
            random_value(rng, 3)]
    return {k: random_value(rng, depth + 1) for k in keys if not isinstance(k, (list, dict))}


def mutate(rng: random.Random, frame: bytes) -> bytes:
    data = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(data)) if data else 0
        action = rng.choice(["flip", "insert", "delete", "byte"])
        if action == "flip" and data:
            data[at] ^= 1 << rng.randrange(8)
        elif action == "insert":
            data[at:at] = rng.randbytes(rng.randint(1, 4))
        elif action == "delete" and data:
            del data[at:at + rng.randint(1, 3)]
        elif data:
            data[at] = rng.choice([0xc1, 0xdd, 0xdf, 0xc6, 0xdb, 0x80, 0x90, 0xff])
    return bytes(data)


def random_frame(rng: random.Random) -> bytes:
    """One fuzzed frame (or garbage that is not a frame)."""
    kind = rng.random()
    seed = msgpack.packb(rng.choice(SEEDS), use_bin_type=True)
    if kind < 0.25:
        return rng.randbytes(rng.randint(1, 64))
    if kind < 0.55:
        return mutate(rng, seed)
    if kind < 0.65:
        return seed[:rng.randrange(1, len(seed))]  # truncated: the connection ends mid-frame
    if kind < 0.75:  # a map whose key is a map or an array: unhashable once unpacked
        key = msgpack.packb(rng.choice([{"a": 1}, [1, 2]]))
        return b"\x82" + key + b"\x01" + msgpack.packb("id") + b"\x01"
    if kind < 0.80:  # nesting deeper than msgpack's stack
        return b"\x91" * rng.randint(500, 3000) + b"\x01"
    if kind < 0.90:
        return msgpack.packb(random_value(rng), use_bin_type=True)
    message = {"id": rng.randint(0, 50), "op": rng.choice([s["op"] for s in SEEDS]), "args": random_value(rng)}
    return msgpack.packb(message, use_bin_type=True)


def check_reply(message) -> None:
    if not isinstance(message, dict) or ("ok" not in message and "event" not in message):
        raise AssertionError(f"not a protocol message: {message!r}")
    if message.get("ok") is False:
        error = message["error"]
        assert isinstance(error["code"], str) and isinstance(error["message"], str), message


def one_connection(path: Path, frames: list[bytes], timeout: float = 30.0) -> int:
    """Send hello and the frames, then read replies until the daemon closes; returns the replies read."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(str(path))
    replies = 0
    try:
        try:
            sock.sendall(HELLO + b"".join(frames))
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it hung up on garbage before reading it all
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        while True:
            try:
                data = sock.recv(1 << 16)
            except ConnectionResetError:
                break
            if not data:
                break
            unpacker.feed(data)
            for message in unpacker:
                check_reply(message)
                replies += 1
    finally:
        sock.close()
    return replies


def fuzz(path: Path, frames: int, seed: int, progress=None) -> dict:
    """Send `frames` fuzzed frames over fresh connections; returns {"frames", "connections", "replies"}."""
    rng = random.Random(seed)
    sent = connections = replies = 0
    while sent < frames:
        batch = [random_frame(rng) for _ in range(min(FRAMES_PER_CONNECTION, frames - sent))]
        replies += one_connection(path, batch)
        sent += len(batch)
        connections += 1
        if progress and connections % 500 == 0:
            progress(sent)
    return {"frames": sent, "connections": connections, "replies": replies}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", type=Path, help="a running daemon's socket [default: start one]")
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from daemon import Daemon

    from ellm import Client

    with tempfile.TemporaryDirectory() as tmp:
        daemon = None if args.socket else Daemon(Path(tmp)).start()
        path = args.socket or daemon.socket
        started = time.monotonic()
        stats = fuzz(path, args.frames, args.seed, lambda n: print(f"{n} frames", file=sys.stderr))
        seconds = time.monotonic() - started
        with Client(path) as client:
            reply = client.open_session(title="after the fuzz").chat("Say hi.", max_tokens=4)
        crashed = daemon is not None and daemon.process.poll() is not None
        tracebacks = daemon.log.read_text().count("Traceback") if daemon else 0
        print(f"{stats['frames']} frames over {stats['connections']} connections in {seconds:.1f}s, "
              f"{stats['replies']} replies, daemon alive: {not crashed}, tracebacks logged: {tracebacks}, "
              f"generated after: {reply.text!r}")
        if daemon is not None:
            daemon.stop()
        return 1 if crashed or tracebacks or not reply.token_ids else 0


if __name__ == "__main__":
    sys.exit(main())
