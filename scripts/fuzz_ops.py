"""Seeded fuzzer of protocol frames and op arguments, against a running daemon.

    python scripts/fuzz_ops.py --socket /path/ellmd.sock --requests 100000 --seed 1

Sends random ops with random, mostly wrong, argument values and types (wrong types, NaN and
infinities, huge and negative numbers, maps with integer or nested keys, unknown keys such as
`self`, real and made-up session ids; constraints: JSON Schemas, regexes and grammars, valid, broken,
and deep: `$ref` and rule chains within and beyond the compile limits) as raw msgpack frames, pipelined on a few connections, plus
broken frames (not msgpack, not a map, truncated, ids that are not integers) on connections of
their own. Every request must get exactly one reply within --reply-timeout seconds, with an error
code of PROTOCOL.md; at the end a fresh client must still open a session and generate. Prints one
JSON line of figures; exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import socket
import sys
import time
from pathlib import Path

import msgpack

CODES = {"bad_frame", "bad_request", "unknown_op", "protocol_version", "not_found", "capacity", "busy",
         "fingerprint", "store", "cancelled", "internal"}
OPS = {  # op -> the argument names it knows (the fuzzer also sends others)
    "session.open": ["title", "tags", "system", "tools"],
    "session.append": ["session_id", "message", "text", "tokens"],
    "session.generate": ["session_id", "max_tokens", "temperature", "top_k", "top_p", "min_p", "logit_bias",
                         "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
                         "stop_token_ids", "stream", "logprobs", "ignore_eos"],
    "session.chat": ["session_id", "content", "message", "max_tokens", "temperature", "top_k", "logit_bias",
                     "stop", "stop_token_ids", "presence_penalty", "stream", "logprobs", "seed"],
    "session.fork": ["session_id", "title"], "session.rewind": ["session_id", "turn", "tokens"],
    "session.snapshot": ["session_id"], "session.resume": ["session_id"], "session.close": ["session_id"],
    "session.delete": ["session_id"], "session.info": ["session_id"], "session.export": ["session_id"],
    "session.import": ["data", "more", "upload"], "session.list": [],
    "completion": ["tokens", "session_id", "messages", "tools", "max_tokens", "temperature", "stream", "logprobs"],
    "skill.list": [], "skill.load": ["session_id", "name", "file", "role", "force"],
    "rag.list": [], "rag.remove": ["name"], "rag.index": ["path", "name", "retriever"],
    "rag.inject": ["session_id", "documents", "query", "k", "index", "role"],
    "stats": [], "cancel": ["request_id"], "hello": ["protocol", "client"], "no.such.op": ["x"],
}
WEIRD_NUMBERS = [0, 1, -1, 2.5, -0.0, 1e-40, -1e308, 1e308, math.nan, math.inf, -math.inf, 2**31, 2**63 - 1,
                 -(2**63), 2**64 - 1, 99999999, 49151, 49152]
GENERATING = ("session.generate", "session.chat", "completion")


def ref_chain(links: int) -> dict:
    """A JSON Schema of `links` chained `$ref`s (shallow as JSON: the compiler's recursion is deep)."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(links)}
    return {"$defs": {**defs, f"d{links}": {"type": "string"}}, "$ref": "#/$defs/d0"}


def rule_chain(rules: int) -> str:
    """A Lark grammar of `rules` chained rules."""
    return "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(rules - 1)) + f'r{rules - 1}: "b"\n'


CONSTRAINTS = {  # kind -> sources: valid, broken, and deep (within the limits, then beyond them)
    "json_schema": [{"type": "object"}, {"type": "strin"}, {"enum": ["a", "b"]}, {"$ref": "#/nowhere"},
                    {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, {"$ref": "#"}, ref_chain(1_200),
                    ref_chain(2_001), {"enum": list(range(10_001))}],
    "regex": ["[0-9]{2}", "a(b", "(a|b)*", "", "x{99999}"],
    "grammar": ['start: "a"', "start: x", 'root ::= "y" | "z"', "start: start", rule_chain(3_000), rule_chain(10_001)],
}
WEIRD_STRINGS = ["", "x", "../x", "..", "a/b", "/etc/passwd", "default", "é" * 20, "\x00", "self", "y" * 300,
                 "<|im_end|>", "{{ 7*7 }}"]


class Fuzzer:
    """Random requests; `sessions` collects real session ids so that many requests reach deep."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.sessions: list[str] = []

    def value(self, depth: int = 0):
        r = self.rng
        kind = r.randrange(10 if depth < 3 else 6)
        if kind == 0:
            return None
        if kind == 1:
            return r.choice([True, False])
        if kind in (2, 3):
            return r.choice(WEIRD_NUMBERS)
        if kind == 4:
            return r.choice(WEIRD_STRINGS + self.sessions[-5:])
        if kind == 5:
            return r.choice([b"", b"\x00\xff", bytes(r.randrange(256) for _ in range(r.randrange(40)))])
        if kind in (6, 7):
            return [self.value(depth + 1) for _ in range(r.randrange(5))]
        keys = [r.choice(["role", "content", "text", "name", "type", "x"]) if r.random() < 0.7 else self.value(depth + 2)
                for _ in range(r.randrange(4))]
        return {k if isinstance(k, (str, int, bytes, bool, type(None), float)) else str(k): self.value(depth + 1)
                for k in keys}

    def good(self, name: str):
        """A value that is valid for the argument `name` (so that some requests get past validation)."""
        r = self.rng
        table = {
            "session_id": lambda: r.choice(self.sessions) if self.sessions else "nosuch",
            "max_tokens": lambda: r.randrange(1, 4), "temperature": lambda: r.choice([0, 0.7, 1.0]),
            "top_k": lambda: r.randrange(0, 50), "top_p": lambda: r.choice([0.5, 1.0]), "seed": lambda: r.randrange(100),
            "text": lambda: r.choice(["Hello.", "Some words", ""]), "content": lambda: "Say hi.",
            "tokens": lambda: [r.randrange(49152) for _ in range(r.randrange(1, 20))],
            "message": lambda: {"role": r.choice(["user", "tool", "system"]), "content": "ok"},
            "logit_bias": lambda: {str(r.randrange(49152)): r.uniform(-5, 5)}, "stop": lambda: ["."],
            "stop_token_ids": lambda: [r.randrange(49152)], "stream": lambda: r.choice([True, False]),
            "logprobs": lambda: r.randrange(0, 3), "turn": lambda: r.randrange(3), "title": lambda: "fuzz",
            "path": lambda: "/nonexistent/fuzz", "query": lambda: "words", "name": lambda: "default",
            "request_id": lambda: r.randrange(50), "protocol": lambda: 1, "data": lambda: b"\x80",
        }
        return table.get(name, lambda: self.value())()

    def request(self, request_id: int) -> dict:
        r = self.rng
        op = r.choice(list(OPS))
        args = {}
        for name in OPS[op]:
            if r.random() < 0.5:
                args[name] = self.good(name) if r.random() < 0.6 else self.value()
        if op in ("session.generate", "session.chat", "completion") and not isinstance(args.get("max_tokens"), int):
            args["max_tokens"] = r.randrange(1, 4)  # keep generations short (wrong types stay wrong)
        if isinstance(args.get("max_tokens"), int) and not isinstance(args["max_tokens"], bool):
            args["max_tokens"] = max(-1, min(args["max_tokens"], 4))
        if op == "rag.index" and isinstance(args.get("path"), str):
            args["path"] = "/nonexistent/" + args["path"].replace("/", "_").replace(".", "_")  # never a real folder ("/..")
        if op in GENERATING and r.random() < 0.2:
            kind = r.choice(list(CONSTRAINTS))
            args[kind] = r.choice(CONSTRAINTS[kind]) if r.random() < 0.7 else self.value()
        if r.random() < 0.15:
            args[r.choice(["self", "colour", "owner", "__class__", "request"])] = self.value()
        message = {"id": request_id, "op": op, "args": args}
        if r.random() < 0.05:
            message["args"] = self.value()  # args that may not be a map
        return message

    def broken_frame(self) -> bytes:
        r = self.rng
        choices = [
            lambda: msgpack.packb([1, 2, 3]),
            lambda: msgpack.packb("hello"),
            lambda: msgpack.packb({"id": "x", "op": "stats"}),
            lambda: msgpack.packb({"id": 1, "op": 5, "args": {}}),
            lambda: msgpack.packb({"id": 1, "op": "stats", "args": {1: 2}}, strict_types=False),
            lambda: msgpack.packb({"id": 1, "op": "session.open", "args": {"tools": [{(1, 2): 3}]}}),
            lambda: b"\xc1" + bytes(r.randrange(256) for _ in range(20)),
            lambda: msgpack.packb({"id": 1, "op": "stats", "args": {}})[:-3],
        ]
        return r.choice(choices)()


class Connection:
    def __init__(self, path: str, hello: bool = True, timeout: float = 60.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        if hello:
            self.send({"id": -1, "op": "hello", "args": {"protocol": 1, "client": "fuzz"}})
            assert self.replies({-1})[-1]["ok"]

    def send(self, message) -> None:
        self.sock.sendall(msgpack.packb(message, use_bin_type=True))

    def replies(self, ids: set) -> dict:
        """Read until every id in ids has its reply (events are skipped); returns id -> reply."""
        got = {}
        while not set(ids) <= set(got):
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError(f"closed with {len(set(ids) - set(got))} replies missing")
            self.unpacker.feed(data)
            for message in self.unpacker:
                if "event" not in message:
                    got[message.get("id")] = message
        return got

    def close(self) -> None:
        self.sock.close()


def check_reply(reply: dict, stats: dict, fuzzer: Fuzzer, request: dict) -> None:
    if reply.get("ok"):
        stats["ok"] += 1
        result = reply.get("result") or {}
        if request["op"] == "session.open" and isinstance(result.get("session_id"), str):
            fuzzer.sessions.append(result["session_id"])
        return
    code = (reply.get("error") or {}).get("code")
    stats["errors"][code] = stats["errors"].get(code, 0) + 1
    if code not in CODES:
        raise AssertionError(f"reply with an unknown error code: {reply}")
    if code == "internal":
        stats["internal"].append({"op": request["op"], "message": reply["error"]["message"][:200]})


def fuzz(path: str, requests: int, seed: int, batch: int = 40, reply_timeout: float = 60.0) -> dict:
    """Send `requests` random requests (and a broken frame for every ~50); returns the figures."""
    fuzzer = Fuzzer(seed)
    stats = {"requests": 0, "ok": 0, "errors": {}, "internal": [], "broken_frames": 0, "seconds": 0.0}
    began = time.monotonic()
    conn = Connection(path, timeout=reply_timeout)
    for _ in range(3):  # a few real sessions for the fuzzed requests to name
        conn.send({"id": 0, "op": "session.open", "args": {"title": "fuzz"}})
        fuzzer.sessions.append(conn.replies({0})[0]["result"]["session_id"])
    next_id = 1
    while stats["requests"] < requests:
        sent = {}
        for _ in range(min(batch, requests - stats["requests"])):
            message = fuzzer.request(next_id)
            sent[next_id] = message
            next_id += 1
            conn.send(message)
        stats["requests"] += len(sent)
        got = conn.replies(set(sent))
        for request_id, message in sent.items():
            check_reply(got[request_id], stats, fuzzer, message)
        if fuzzer.rng.random() < 0.8:
            broken_frame(path, fuzzer, stats, reply_timeout)
        if fuzzer.rng.random() < 0.02:  # a client that goes away mid-flight
            conn.send(fuzzer.request(next_id))
            conn.close()
            conn = Connection(path, timeout=reply_timeout)
            next_id += 1
        del fuzzer.sessions[:-20]
    conn.close()
    stats["seconds"] = round(time.monotonic() - began, 1)
    return stats


def broken_frame(path: str, fuzzer: Fuzzer, stats: dict, timeout: float) -> None:
    """One broken frame on a connection of its own: an error reply, then (for bad_frame) the close."""
    conn = Connection(path, hello=fuzzer.rng.random() < 0.7, timeout=timeout)
    conn.sock.sendall(fuzzer.broken_frame())
    conn.sock.shutdown(socket.SHUT_WR)
    while conn.sock.recv(1 << 16):  # read to the end: the daemon answers and closes, or waits for more
        pass
    conn.close()
    stats["broken_frames"] += 1


def still_serves(path: str) -> str:
    """A fresh client opens a session and generates; returns the generated text."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "client"))
    from ellm import Client

    with Client(path, timeout=120) as client:
        session = client.open_session(system="Be brief.")
        reply = session.chat("Say hello.", max_tokens=5)
        assert reply.token_ids, "no tokens generated"
        return reply.text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--reply-timeout", type=float, default=60.0)
    options = parser.parse_args()
    try:
        stats = fuzz(options.socket, options.requests, options.seed, reply_timeout=options.reply_timeout)
        stats["after"] = still_serves(options.socket)
    except (AssertionError, OSError, ConnectionError) as e:
        print(json.dumps({"failed": str(e)}))
        return 1
    print(json.dumps(stats))
    return 1 if stats["internal"] else 0


if __name__ == "__main__":
    sys.exit(main())
