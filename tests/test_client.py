"""The `ellm` client and CLI against a fake daemon, held to the real daemon's replies.

`FakeDaemon` is an asyncio Unix-socket server written here: it speaks PROTOCOL.md's framing (a
stream of msgpack maps, hello first, ids echoed, events before replies) with canned replies, runs
every request as its own task (so replies may come out of order) and has a few `test.*` ops that
misbehave on purpose. The tests cover the client's framing, id dispatch, streaming, cancel, error
mapping, reconnection, export/import and the CLI. A contract test (at the end) runs the same calls
against the fake and the real daemon and compares every reply's shape, so the fake cannot drift.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import msgpack
import pytest
from typer.testing import CliRunner

import ellm
import ellm.cli
from ellm import (
    AsyncClient,
    BadFrame,
    BadRequest,
    Busy,
    CapacityError,
    Cancelled,
    Client,
    ConnectionLost,
    DaemonNotRunning,
    EllmError,
    FingerprintError,
    Generation,
    InternalError,
    NotFound,
    ProtocolVersionError,
    RequestTimeout,
    StoreError,
    UnknownOp,
)
from ellm.cli import app
from ellm.framing import FrameDecoder, pack
from ellm.paths import default_socket_path
from ellmd.errors import BadRequest as DaemonBadRequest
from ellmd.runtime.ops import OPS
from ellmd.runtime.ops.base import UPLOAD_FIELDS

CHUNK = 2**16  # export chunk size of the fake daemon


class FakeError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class HungUp(Exception):
    """Raised by a handler that closed the connection instead of replying."""


class NoReply(Exception):
    """Raised by a handler that wrote its reply itself."""


class FakeConnection:
    def __init__(self, writer):
        self.writer = writer
        self.hello = False
        self.cancels: dict[int, asyncio.Event] = {}  # request id -> set by `cancel`
        self.uploads: dict[str, bytearray] = {}

    def send(self, message: dict) -> None:
        if not self.writer.is_closing():
            self.writer.write(msgpack.packb(message, use_bin_type=True))

    def event(self, rid: int, name: str, data: dict) -> None:
        self.send({"id": rid, "event": name, "data": data})


class FakeDaemon:
    """Canned replies for every op of PROTOCOL.md, served from a thread with its own event loop."""

    def __init__(self, path: str):
        self.path = path
        self.protocol = 1
        self.max_frame = 16 * 2**20
        self.sessions: dict[str, dict] = {}
        self.released: set[str] = set()  # sessions handed back by session.release
        self.requests: list[tuple[str, dict]] = []  # every request, in arrival order
        self.imported: list[bytes] = []
        self.blob = bytes(range(256)) * 1000  # what session.export sends: several chunks
        self._count = 0
        self._tasks: set[asyncio.Task] = set()

    # lifecycle

    def start(self) -> None:
        ready = threading.Event()

        async def main():
            self._stop = asyncio.Event()
            server = await asyncio.start_unix_server(self._serve, self.path)
            ready.set()
            await self._stop.wait()
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        def run():
            self.loop = asyncio.new_event_loop()
            self.loop.run_until_complete(main())
            self.loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(5)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)

    def ops(self) -> list[str]:
        return [op for op, _ in self.requests]

    # connection and dispatch

    async def _serve(self, reader, writer) -> None:
        self._tasks.add(asyncio.current_task())
        conn = FakeConnection(writer)
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=self.max_frame)
        handlers: set[asyncio.Task] = set()
        try:
            while data := await reader.read(65536):
                try:
                    unpacker.feed(data)
                    messages = list(unpacker)
                    assert all(isinstance(m, dict) for m in messages)
                except Exception as exc:
                    conn.send({"id": None, "ok": False, "error": {"code": "bad_frame", "message": str(exc)}})
                    return
                for message in messages:
                    if message.get("op") == "hello":  # inline: later requests must see it done
                        await self._handle(conn, message)
                    else:
                        task = asyncio.get_running_loop().create_task(self._handle(conn, message))
                        handlers.add(task)
                        task.add_done_callback(handlers.discard)
        finally:
            for task in handlers:
                task.cancel()
            writer.close()
            self._tasks.discard(asyncio.current_task())

    async def _handle(self, conn: FakeConnection, message: dict) -> None:
        rid, op, args = message["id"], message["op"], message.get("args") or {}
        self.requests.append((op, args))
        try:
            self.check(op, args)
            if op == "hello":
                result = self.hello(conn, args)
            elif not conn.hello:
                raise FakeError("bad_request", "hello first")
            elif (handler := getattr(self, "op_" + op.replace(".", "_"), None)) is None:
                raise FakeError("unknown_op", f"no op {op!r}")
            else:
                result = await handler(conn, rid, args)
            conn.send({"id": rid, "ok": True, "result": result})
        except FakeError as exc:
            conn.send({"id": rid, "ok": False, "error": {"code": exc.code, "message": exc.message}})
        except (HungUp, NoReply):
            pass

    @staticmethod
    def check(op: str, args: dict) -> None:
        """The daemon's ops take the arguments their declaration (ellmd.runtime.ops) says, and so
        does the fake: the client sends nothing else (the test.* ops are the fake's own)."""
        declared = OPS.get(op)
        if declared is None:
            return
        if declared.upload:  # a piece of an upload: the server takes these before the op sees the whole
            args = {k: v for k, v in args.items() if k not in UPLOAD_FIELDS}
        try:
            declared.arguments(args, vocab_size=1 << 20)
        except DaemonBadRequest as e:
            raise FakeError("bad_request", str(e)) from None

    def hello(self, conn, args) -> dict:
        if args.get("protocol") != 1:
            raise FakeError("protocol_version", "protocol 1 only")
        conn.hello = True
        return {"protocol": self.protocol, "server": "fake/0", "model": "fake-model", "max_frame": self.max_frame}

    def session(self, args) -> dict:
        try:
            return self.sessions[args["session_id"]]
        except KeyError:
            raise FakeError("not_found", f"no session {args.get('session_id')!r}") from None

    def new_session(self, title=None, tags=None, tokens=0, session_id=None) -> dict:
        self._count += 1
        now = time.time()
        info = {
            "session_id": session_id or f"s{self._count}", "title": title, "tags": tags or [], "created": now,
            "updated": now, "tokens": tokens, "resident": True, "busy": False, "owner": None, "turn_count": 0, "usage": {},
            "turns": [], "skills": [],
            "fingerprint": {"model": "m1", "tokenizer": "t1", "template": "c1", "kv": "bf16"},
        }
        self.sessions[info["session_id"]] = info
        return info

    def add_turn(self, info: dict, kind: str, count: int, role: str | None = None, name: str | None = None) -> None:
        start = info["tokens"]
        info["turns"].append({"index": len(info["turns"]), "kind": kind, "role": role, "name": name, "start": start,
                              "end": start + count, "time": time.time()})
        info["tokens"] += count
        info["turn_count"] = len(info["turns"])
        # the session's usage has the counters the real one would have counted: those that counted
        # (a generation's prompt reuses the session's tokens before it)
        counts = {"prefilled": count, "reused": info["tokens"] - count, "generated": count} \
            if kind == "generation" else {"prefilled": count}
        for counter, amount in counts.items():
            if amount:
                info["usage"][counter] = info["usage"].get(counter, 0) + amount

    @staticmethod
    def usage(info: dict, prefilled: int, generated: int | None = None) -> dict:
        """The usage of an append (generated None) or of a generation."""
        usage = {"prompt_tokens": info["tokens"], "prefilled_tokens": prefilled,
                 "reused_tokens": info["tokens"] - prefilled, "shared_tokens": 0, "prefill_ms": 1.0}
        if generated is not None:
            usage.update(generated_tokens=generated, ttft_ms=2.0, decode_tok_s=50.0, decode_steps=max(generated - 1, 0),
                         draft_tokens=0, accepted_tokens=0)
        return usage

    # ops of PROTOCOL.md

    async def op_session_open(self, conn, rid, args):
        info = self.new_session(args.get("title"), args.get("tags"))
        if args.get("system"):
            self.add_turn(info, "message", 5, "system")
        return info

    async def op_session_info(self, conn, rid, args):
        return self.session(args)

    async def op_session_turns(self, conn, rid, args):
        info = self.session(args)
        turns = [{**turn, "tokens": turn["end"] - turn["start"], "token_ids": list(range(turn["start"], turn["end"])),
                  "text": f"the {turn['kind']} turn"} for turn in info["turns"]]
        return {"session_id": info["session_id"], "turns": turns, "messages": []}

    async def op_session_list(self, conn, rid, args):
        return {"sessions": [{k: v for k, v in s.items() if k != "turns"} for s in self.sessions.values()]}

    async def op_session_chat(self, conn, rid, args):
        info = self.session(args)
        content = args["content"] if "content" in args else args["message"]["content"]
        return await self.generation(conn, rid, args, info, content)

    async def op_session_generate(self, conn, rid, args):
        return await self.generation(conn, rid, args, self.session(args), "generated")

    async def generation(self, conn, rid, args, info, content):
        """Replies `echo: <content>`; content "slow" streams slowly, "disconnect" hangs up mid-stream."""
        if info["busy"]:
            raise FakeError("busy", "the session is generating")
        pieces = ["echo:"] + [" " + word for word in content.split()]
        if content == "slow":
            pieces = [" tick"] * 200
        info["busy"] = True
        conn.cancels[rid] = cancelled = asyncio.Event()
        sent, finish = [], "stop"
        try:
            for i, piece in enumerate(pieces):
                if cancelled.is_set():
                    finish = "cancelled"
                    break
                if args.get("stream", True):
                    conn.event(rid, "token", {"text": piece, "token_ids": [i]})
                sent.append(piece)
                if content == "disconnect":
                    await conn.writer.drain()
                    conn.writer.close()
                    raise HungUp
                await asyncio.sleep(0.01 if content == "slow" else 0)
            if len(sent) >= args.get("max_tokens", 256):
                finish = "length"
        finally:
            info["busy"] = False
        self.add_turn(info, "generation", len(sent), "assistant")
        return {"text": "".join(sent), "token_ids": list(range(len(sent))), "finish_reason": finish,
                "tool_calls": [], "usage": self.usage(info, 3, len(sent)), "session_id": info["session_id"]}

    async def op_session_append(self, conn, rid, args):
        info = self.session(args)
        given = [k for k in ("message", "text", "tokens") if k in args]
        if len(given) != 1:
            raise FakeError("bad_request", "exactly one of message, text, tokens")
        count = len(args["tokens"]) if "tokens" in args else 4
        self.add_turn(info, given[0] if given[0] != "message" else "message", count)
        return {"tokens_appended": count, "tokens": info["tokens"], "usage": self.usage(info, count)}

    async def op_skill_load(self, conn, rid, args):
        info = self.session(args)
        if args["name"] != "git":
            raise FakeError("not_found", f"no skill {args['name']!r}")
        self.add_turn(info, "skill", 30, "user", "git")
        info["skills"].append("git")
        return {"skill": "git", "file": None, "loaded": True, "tokens_appended": 30, "tokens": info["tokens"],
                "usage": self.usage(info, 30)}

    async def op_rag_inject(self, conn, rid, args):
        info = self.session(args)
        if "documents" in args:
            passages = [{"text": d["text"], "source": d.get("source")} for d in args["documents"]]
        else:
            passages = [{"text": f"passage {i} about {args['query']}", "source": f"doc{i}", "score": 1.0 - i / 10}
                        for i in range(args.get("k", 2))]
        self.add_turn(info, "rag", 10 * len(passages))
        return {"passages": passages, "tokens_appended": 10 * len(passages), "tokens": info["tokens"],
                "usage": self.usage(info, 10)}

    async def op_session_fork(self, conn, rid, args):
        parent = self.session(args)
        child = self.new_session(args.get("title"), parent["tags"], parent["tokens"])
        child["turns"] = [dict(t) for t in parent["turns"]]
        child["skills"] = list(parent["skills"])
        return child

    async def op_session_rewind(self, conn, rid, args):
        info = self.session(args)
        if "turn" in args:
            if args["turn"] > len(info["turns"]):
                raise FakeError("not_found", f"no turn {args['turn']}")
            if args["turn"] < len(info["turns"]):
                info["tokens"] = info["turns"][args["turn"]]["start"]
            info["turns"] = info["turns"][: args["turn"]]
        else:
            if not 0 <= args["tokens"] <= info["tokens"]:
                raise FakeError("bad_request", f"tokens must be from 0 to {info['tokens']}")
            info["tokens"] = args["tokens"]
            info["turns"] = [t for t in info["turns"] if t["end"] <= info["tokens"]]
        info["skills"] = [t["name"] for t in info["turns"] if t["kind"] == "skill"]
        return info

    async def op_session_snapshot(self, conn, rid, args):
        info = self.session(args)
        return {"chunks_written": 1, "bytes_written": 4096, "ms": 1.5, "stored_tokens": info["tokens"]}

    async def op_session_resume(self, conn, rid, args):
        info = self.session(args)
        info["resident"] = True
        return {"session_id": info["session_id"], "tokens": info["tokens"], "ms": 3.0}

    async def op_session_close(self, conn, rid, args):
        info = self.session(args)
        info["resident"] = False
        return {"session_id": info["session_id"], "snapshotted": True}

    async def op_session_release(self, conn, rid, args):
        info = self.sessions.get(args["session_id"])
        if info is None or info["session_id"] in self.released:
            return {"session_id": args["session_id"], "tokens": None, "released": False}
        self.released.add(info["session_id"])
        info["resident"] = False
        return {"session_id": info["session_id"], "tokens": info["tokens"], "released": True}

    async def op_session_delete(self, conn, rid, args):
        self.session(args)
        del self.sessions[args["session_id"]]
        return {"session_id": args["session_id"]}

    async def op_stats(self, conn, rid, args):
        resident = sum(s["resident"] for s in self.sessions.values())
        return {"model": "fake-model", "model_type": "llama", "slots": 4, "sequence_length": 8192,
                "sessions_resident": resident, "sessions_stored": len(self.sessions), "generating": 0,
                "kv_bytes": 1234, "kv_bytes_used": 234, "kv_bytes_free": 1000, "kv_bytes_per_token": 2,
                "kv_dtype": "bf16", "kv_capacity": {name: {"bytes_per_token": 2, "tokens_per_gib": 1 << 29,
                                                           "sessions_in_memory": 1, "sessions_on_disk": 9}
                                                    for name in ("bf16", "q8_0", "q8_0/q4_0", "q4_0")},
                "counters": {"prefilled": 10, "reused": 5, "shared": 0, "generated": 3, "drafted": 0, "accepted": 0},
                "scheduler": {"gap_ratio": 1.0, "decode_step_ms": 12.5, "prefill_token_ms": 3.1,
                              "riding_token_ms": None},
                "store": {"path": "/fake/store", "backend": "lmdb", "bytes_used": 4096, "map_size": 1 << 30},
                "replica": None, "uptime_s": 12.5}

    async def op_shutdown(self, conn, rid, args):
        return {}

    async def op_cancel(self, conn, rid, args):
        event = conn.cancels.get(args["request_id"])
        if event is None or event.is_set():
            return {"cancelled": False}
        event.set()
        return {"cancelled": True}

    async def op_session_export(self, conn, rid, args):
        info = self.session(args)
        size = min(CHUNK, self.max_frame // 2)  # events stay under max_frame too
        for start in range(0, len(self.blob), size):
            conn.event(rid, "chunk", {"data": self.blob[start:start + size]})
            await asyncio.sleep(0)
        return {"session_id": info["session_id"], "tokens": info["tokens"], "bytes": len(self.blob)}

    async def op_session_import(self, conn, rid, args):
        if "upload" in args:
            if args["upload"] not in conn.uploads:
                raise FakeError("not_found", "no such upload")
            received = conn.uploads[args["upload"]]
        else:
            received = conn.uploads.setdefault(f"u{rid}", bytearray())
            args = {**args, "upload": f"u{rid}"}
        received += args["data"]
        if args.get("more"):
            return {"upload": args["upload"], "received": len(received)}
        del conn.uploads[args["upload"]]
        self.imported.append(bytes(received))
        return self.new_session("imported", tokens=42)

    # ops that misbehave on purpose

    async def op_test_error(self, conn, rid, args):
        raise FakeError(args["code"], "canned failure")

    async def op_test_sleep(self, conn, rid, args):
        await asyncio.sleep(args["seconds"])
        return {"slept": args["seconds"]}

    async def op_test_trickle(self, conn, rid, args):
        """The reply one byte per write, after an event split the same way."""
        data = (msgpack.packb({"id": rid, "event": "note", "data": {"n": 1}})
                + msgpack.packb({"id": rid, "ok": True, "result": {"text": "é" * 100, "blob": b"\x00\xff" * 50}}))
        for i in range(len(data)):
            conn.writer.write(data[i:i + 1])
            await conn.writer.drain()
        raise NoReply

    async def op_test_bad_frame(self, conn, rid, args):
        conn.send({"id": None, "ok": False, "error": {"code": "bad_frame", "message": "canned bad frame"}})
        conn.writer.close()
        raise HungUp


@pytest.fixture
def daemon():
    directory = tempfile.mkdtemp(prefix="ellm-test-")  # short: Unix socket paths are limited to ~100 bytes
    fake = FakeDaemon(os.path.join(directory, "ellmd.sock"))
    fake.start()
    yield fake
    fake.stop()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def client(daemon):
    with Client(daemon.path, timeout=10) as c:
        yield c


# paths and framing


def test_default_socket_path(monkeypatch):
    monkeypatch.setenv("ELLM_SOCKET", "/x/y.sock")
    assert str(default_socket_path()) == "/x/y.sock"
    monkeypatch.delenv("ELLM_SOCKET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    assert str(default_socket_path()) == "/run/user/7/ellm/ellmd.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "")
    assert str(default_socket_path()) == f"/tmp/ellm-{os.getuid()}/ellmd.sock"


def test_frame_decoder_splits_and_joins_messages():
    data = pack({"id": 1, "event": "token", "data": {"text": "é"}}) + pack({"id": 1, "ok": True, "result": {"b": b"\x00"}})
    decoder = FrameDecoder()
    messages = []
    for i in range(len(data)):  # one byte at a time
        messages += decoder.feed(data[i:i + 1])
    assert messages == [{"id": 1, "event": "token", "data": {"text": "é"}}, {"id": 1, "ok": True, "result": {"b": b"\x00"}}]
    assert FrameDecoder().feed(data + data) == messages * 2


@pytest.mark.parametrize("data", [pack([1, 2]), b"\xc1", pack({"x": b"a" * 200_000})], ids=["not-a-map", "not-msgpack", "oversized"])
def test_frame_decoder_rejects(data):
    with pytest.raises(BadFrame):
        FrameDecoder(max_frame=1024).feed(data)


# the blocking client


def test_hello_and_session_ops(daemon, client):
    assert client.server["model"] == "fake-model"
    assert daemon.requests[0] == ("hello", {"protocol": 1, "client": f"ellm-py/{ellm.__version__}"})
    session = client.open_session(title="t", tags=["a"], system="be brief")
    assert session.info()["tokens"] == 5

    generation = session.chat("hello world", max_tokens=8, temperature=0.0)
    assert generation == Generation(text="echo: hello world", token_ids=[0, 1, 2], finish_reason="stop", tool_calls=[],
                                    usage=generation.usage)
    assert generation.usage["generated_tokens"] == 3
    op, args = daemon.requests[-1]
    assert op == "session.chat" and args == {"session_id": session.id, "content": "hello world", "max_tokens": 8,
                                             "temperature": 0.0, "stream": False}

    session.chat({"role": "tool", "content": "42"})
    assert daemon.requests[-1][1]["message"] == {"role": "tool", "content": "42"}
    assert session.append(text="raw")["tokens_appended"] == 4
    assert daemon.requests[-1][1] == {"session_id": session.id, "text": "raw"}
    assert session.generate().text == "echo: generated"
    assert session.load_skill("git")["skill"] == "git"
    assert len(session.inject(query="rust", k=3)["passages"]) == 3
    assert session.inject(documents=["plain", {"text": "t", "source": "s"}])["passages"][0] == {"text": "plain", "source": None}

    child = session.fork(title="child")
    assert child.id != session.id and child.info()["tokens"] == session.info()["tokens"]
    assert session.rewind(turn=1)["tokens"] == 5
    assert session.rewind(tokens=2)["tokens"] == 2
    assert session.snapshot()["chunks_written"] == 1
    assert session.close() == {"session_id": session.id, "snapshotted": True}
    assert session.resume()["tokens"] == 2
    assert {s["session_id"] for s in client.list_sessions()} == {session.id, child.id}
    assert client.stats()["sessions_stored"] == 2
    assert child.delete() == {"session_id": child.id}
    with pytest.raises(NotFound):
        child.info()
    assert client.shutdown() == {}


def test_streaming_chat(daemon, client):
    session = client.open_session()
    stream = session.chat("one two three", stream=True)
    deltas = list(stream)
    assert deltas == ["echo:", " one", " two", " three"]
    assert stream.result.text == "".join(deltas) and stream.result.finish_reason == "stop"
    assert daemon.requests[-1][1]["stream"] is True

    raw = client.stream("session.chat", session_id=session.id, content="hi")
    assert list(raw) == [{"text": "echo:", "token_ids": [0]}, {"text": " hi", "token_ids": [1]}]
    assert raw.result["text"] == "echo: hi"


def test_calls_while_a_stream_is_open(client):
    """Messages of the stream that arrive while another request waits are kept for the stream."""
    session = client.open_session()
    stream = session.chat("a b c d e f", stream=True)
    first = next(stream)
    assert session.info()["session_id"] == session.id
    assert client.call("test.sleep", seconds=0.05) == {"slept": 0.05}
    assert first + "".join(stream) == "echo: a b c d e f"


def test_threads_share_a_client(client):
    results = {}

    def work(n):
        results[n] = client.call("test.sleep", seconds=0.05 * (n % 3))["slept"]

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {n: 0.05 * (n % 3) for n in range(6)}


def test_busy_session(client):
    session = client.open_session()
    stream = session.chat("slow", stream=True)
    next(stream)
    with pytest.raises(Busy):
        session.chat("again")
    stream.close()


def test_cancel_keeps_the_connection(daemon, client):
    session = client.open_session()
    with session.chat("slow", stream=True) as stream:
        next(stream)
    assert stream.done and stream.result.finish_reason == "cancelled"
    assert ("cancel", {"request_id": stream.request_id}) in daemon.requests
    assert len(stream.result.text) < 200 * len(" tick")
    assert session.chat("after").text == "echo: after"  # same connection, still usable
    assert daemon.ops().count("hello") == 1


@pytest.mark.parametrize("cls", [BadRequest, UnknownOp, ProtocolVersionError, NotFound, CapacityError, Busy,
                                 FingerprintError, StoreError, Cancelled, InternalError])
def test_error_replies_raise_their_class(client, cls):
    with pytest.raises(cls) as caught:
        client.call("test.error", code=cls.code)
    assert isinstance(caught.value, EllmError) and caught.value.code == cls.code
    assert caught.value.message == "canned failure"


def test_unknown_codes_and_ops(client):
    with pytest.raises(EllmError) as caught:
        client.call("test.error", code="brand_new")
    assert type(caught.value) is EllmError and caught.value.code == "brand_new"
    with pytest.raises(UnknownOp):
        client.call("no.such.op")
    with pytest.raises(NotFound):
        client.session("nope").chat("hi")


def test_reply_split_into_single_bytes(client):
    stream = client.stream("test.trickle")
    assert list(stream) == [{"n": 1}]
    assert stream.result == {"text": "é" * 100, "blob": b"\x00\xff" * 50}


def test_bad_frame_reply_then_reconnect(daemon, client):
    with pytest.raises(BadFrame, match="canned bad frame"):
        client.call("test.bad_frame")
    assert client.stats()["model"] == "fake-model"  # a new connection
    assert daemon.ops().count("hello") == 2


def test_disconnect_mid_stream(daemon, client):
    session = client.open_session()
    stream = session.chat("disconnect", stream=True)
    assert next(stream) == "echo:"
    with pytest.raises(ConnectionLost):
        next(stream)
    assert stream.done
    assert session.info()["session_id"] == session.id  # reconnected


def test_request_over_max_frame_is_refused_locally(daemon):
    daemon.max_frame = 4096
    with Client(daemon.path) as client:
        with pytest.raises(BadRequest, match="max_frame"):
            client.session("s").append(text="x" * 5000)
        assert client.stats()["model"] == "fake-model"


def test_timeout_abandons_the_request(daemon):
    with Client(daemon.path, timeout=0.2) as client:
        with pytest.raises(RequestTimeout):
            client.call("test.sleep", seconds=0.5)
        time.sleep(0.4)  # the late reply arrives and is dropped
        assert client.call("test.sleep", seconds=0) == {"slept": 0}
        assert daemon.ops().count("hello") == 1


def test_daemon_not_running(tmp_path):
    path = tmp_path / "none.sock"
    with pytest.raises(DaemonNotRunning) as caught:
        Client(path)
    assert str(path) in caught.value.message and "ellmd start" in caught.value.message


def test_protocol_version_mismatch(daemon):
    daemon.protocol = 2
    with pytest.raises(ProtocolVersionError):
        Client(daemon.path)


def test_export_and_import_in_pieces(daemon):
    daemon.max_frame = 8192  # import pieces of 4096 bytes
    with Client(daemon.path) as client:
        session = client.open_session()
        out = io.BytesIO()
        assert session.export(out) == {"session_id": session.id, "tokens": 0, "bytes": len(daemon.blob)}
        assert out.getvalue() == daemon.blob
        imported = client.import_session(io.BytesIO(out.getvalue()))
        assert daemon.imported == [daemon.blob]
        assert imported.info()["tokens"] == 42
        pieces = [args for op, args in daemon.requests if op == "session.import"]
        assert len(pieces) == -(-len(daemon.blob) // 4096) and not pieces[-1]["more"]
        assert client.import_session(b"small").id != imported.id
        assert daemon.imported[-1] == b"small"


# the asyncio client


def test_async_requests_in_flight_at_once(daemon):
    async def main():
        async with AsyncClient(daemon.path, timeout=10) as client:
            done = []

            async def sleep(seconds):
                result = await client.call("test.sleep", seconds=seconds)
                done.append(seconds)
                return result

            results = await asyncio.gather(sleep(0.2), sleep(0.1), sleep(0))
            assert [r["slept"] for r in results] == [0.2, 0.1, 0]
            assert done == [0, 0.1, 0.2]  # replies came out of order, each to its request

            session = await client.open_session(system="s")
            stream = await session.chat("x y", stream=True)
            assert [d async for d in stream] == ["echo:", " x", " y"]
            assert stream.result.text == "echo: x y"
            two = await asyncio.gather(session.info(), session.generate(), client.stats())
            assert two[1].text == "echo: generated"
            with pytest.raises(NotFound):
                await client.session("nope").info()
            with pytest.raises(Busy):
                slow = await session.chat("slow", stream=True)
                await slow.__anext__()
                await session.chat("again")
            async with slow:
                pass
            assert slow.result.finish_reason == "cancelled"
            out = io.BytesIO()
            await session.export(out)
            assert out.getvalue() == daemon.blob
            assert (await (await client.import_session(out.getvalue())).info())["title"] == "imported"

    asyncio.run(main())


def test_async_disconnect_fails_every_request_in_flight(daemon):
    async def main():
        client = await AsyncClient(daemon.path).connect()
        session = await client.open_session()
        waiting = asyncio.ensure_future(client.call("test.sleep", seconds=5))
        await asyncio.sleep(0.05)  # sent before the daemon hangs up
        stream = await session.chat("disconnect", stream=True)
        assert await stream.__anext__() == "echo:"
        with pytest.raises(ConnectionLost):
            await stream.__anext__()
        with pytest.raises(ConnectionLost):
            await waiting
        assert (await session.info())["session_id"] == session.id  # reconnected
        await client.close()

    asyncio.run(main())


def test_async_daemon_not_running(tmp_path):
    with pytest.raises(DaemonNotRunning):
        asyncio.run(AsyncClient(tmp_path / "none.sock").connect())


# the CLI


def ellm_cli(daemon, *args, input=None):
    return CliRunner().invoke(app, ["--socket", daemon.path, *args], input=input)


def test_cli_daemon_not_running(tmp_path):
    path = str(tmp_path / "none.sock")
    for args in (["status"], ["session", "list", "--json"], ["chat", "-m", "hi"]):
        result = CliRunner().invoke(app, ["--socket", path, *args])
        assert result.exit_code == 2
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and "ellmd start" in lines[0] and path in lines[0]
        assert "Traceback" not in result.output


def test_cli_socket_from_environment(daemon):
    result = CliRunner().invoke(app, ["status", "--json"], env={"ELLM_SOCKET": daemon.path})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["socket"] == daemon.path


def test_cli_status(daemon):
    result = ellm_cli(daemon, "status")
    assert result.exit_code == 0, result.output
    assert "fake-model" in result.stdout and "sequence_length" in result.stdout
    report = json.loads(ellm_cli(daemon, "status", "--json").stdout)
    assert report["server"]["protocol"] == 1 and report["stats"]["kv_bytes"] == 1234


def test_cli_session_commands(daemon, tmp_path):
    daemon.new_session("[first] session", ["x"], 5)
    daemon.add_turn(daemon.sessions["s1"], "message", 7, "user")
    result = ellm_cli(daemon, "session", "list")
    assert result.exit_code == 0, result.output
    assert "[first] session" in result.stdout and "s1" in result.stdout
    assert json.loads(ellm_cli(daemon, "session", "list", "--json").stdout)["sessions"][0]["tokens"] == 12

    result = ellm_cli(daemon, "session", "show", "s1")
    assert result.exit_code == 0 and "fingerprint.model" in result.stdout and "message/user" in result.stdout
    assert "the message turn" in result.stdout  # the start of its text
    assert json.loads(ellm_cli(daemon, "session", "show", "s1", "--json").stdout)["turns"][0]["end"] == 12

    assert "resumed s1: 12 tokens" in ellm_cli(daemon, "session", "resume", "s1").stdout
    forked = json.loads(ellm_cli(daemon, "session", "fork", "s1", "--title", "f", "--json").stdout)
    assert forked["title"] == "f" and forked["tokens"] == 12
    assert "rewound s1 to 5 tokens" in ellm_cli(daemon, "session", "rewind", "s1", "--turn", "0").stdout
    assert json.loads(ellm_cli(daemon, "session", "rewind", "s1", "--tokens", "3", "--json").stdout)["tokens"] == 3
    assert ellm_cli(daemon, "session", "rewind", "s1").exit_code == 2  # neither --turn nor --tokens

    path = tmp_path / "s1.ellm"
    result = ellm_cli(daemon, "session", "export", "s1", str(path))
    assert result.exit_code == 0, result.output
    assert path.read_bytes() == daemon.blob and [p.name for p in tmp_path.iterdir()] == ["s1.ellm"]
    imported = json.loads(ellm_cli(daemon, "session", "import", str(path), "--json").stdout)
    assert imported["tokens"] == 42 and daemon.imported == [daemon.blob]

    assert "deleted s1" in ellm_cli(daemon, "session", "delete", "s1").stdout
    result = ellm_cli(daemon, "session", "show", "s1")
    assert result.exit_code == 1 and result.stderr == "ellm: error: not_found: no session 's1'\n"
    result = ellm_cli(daemon, "session", "export", "s1", str(tmp_path / "gone.ellm"))
    assert result.exit_code == 1 and not (tmp_path / "gone.ellm").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["s1.ellm"]  # no temporary file left behind


def test_cli_chat_one_message(daemon):
    result = ellm_cli(daemon, "chat", "-m", "hello there", "--max-tokens", "9", "--temperature", "0.5",
                      "--top-p", "0.9", "--top-k", "5", "--seed", "1", "--system", "sys", "--title", "T")
    assert result.exit_code == 0, result.output
    assert result.stdout == "echo: hello there\n"
    assert "3 tokens" in result.stderr
    op, args = daemon.requests[-1]
    assert op == "session.chat" and args["max_tokens"] == 9 and args["top_k"] == 5 and args["seed"] == 1
    assert daemon.sessions["s1"]["title"] == "T"

    result = ellm_cli(daemon, "chat", "--session", "s1", "-m", "again", "--json")
    assert result.exit_code == 0, result.output
    reply = json.loads(result.stdout)
    assert reply["session_id"] == "s1" and reply["text"] == "echo: again" and reply["usage"]["generated_tokens"] == 2
    assert ellm_cli(daemon, "chat", "--session", "s1", "--system", "x", "-m", "m").exit_code == 2
    assert ellm_cli(daemon, "chat", "--json").exit_code == 2


def test_cli_chat_interactive(daemon):
    result = ellm_cli(daemon, "chat", input="first\n\nsecond words\n/exit\nnot sent\n")
    assert result.exit_code == 0, result.output
    assert "echo: first\n" in result.stdout and "echo: second words\n" in result.stdout
    assert "not sent" not in result.stdout
    assert [args["content"] for op, args in daemon.requests if op == "session.chat"] == ["first", "second words"]

    result = ellm_cli(daemon, "chat", "--session", "s1", input="more\n")  # ends at end of input
    assert result.exit_code == 0 and "echo: more" in result.stdout
    assert daemon.sessions["s1"]["turns"][-1]["kind"] == "generation"
    result = ellm_cli(daemon, "chat", "--session", "nope")
    assert result.exit_code == 1 and "not_found" in result.stderr


def test_cli_chat_interactive_survives_errors(daemon):
    result = ellm_cli(daemon, "chat", input="disconnect\nafter\n")
    assert result.exit_code == 0, result.output
    assert "ellm: error: the daemon closed the connection" in result.stderr
    assert "echo: after" in result.stdout  # the next turn reconnected
    assert daemon.ops().count("hello") == 2


def test_cli_chat_interrupt_cancels_the_reply(daemon, monkeypatch):
    echo = ellm.cli.typer.echo

    def interrupted(message=None, nl=True, **kwargs):  # Ctrl-C while the first delta prints
        if not nl:
            raise KeyboardInterrupt
        echo(message, nl=nl, **kwargs)

    monkeypatch.setattr(ellm.cli.typer, "echo", interrupted)
    result = ellm_cli(daemon, "chat", "-m", "slow")
    assert result.exit_code == 130
    assert "cancelled" in result.stderr and "cancel" in daemon.ops()
    assert daemon.sessions["s1"]["turns"][-1]["kind"] == "generation"


def test_cli_chat_disconnect(daemon):
    result = ellm_cli(daemon, "chat", "-m", "disconnect")
    assert result.exit_code == 1
    assert result.stderr.startswith("ellm: error: ") and "closed the connection" in result.stderr
    assert "Traceback" not in result.output


def test_cli_skill_and_rag(daemon, tmp_path):
    daemon.new_session()
    result = ellm_cli(daemon, "skill", "inject", "s1", "git")
    assert result.exit_code == 0 and "+30 tokens" in result.stdout
    assert json.loads(ellm_cli(daemon, "skill", "inject", "s1", "git", "--json").stdout)["skill"] == "git"
    result = ellm_cli(daemon, "skill", "inject", "s1", "nope")
    assert result.exit_code == 1 and result.stderr == "ellm: error: not_found: no skill 'nope'\n"

    doc = tmp_path / "notes.txt"
    doc.write_text("the [bold] notes", encoding="utf-8")
    result = ellm_cli(daemon, "rag", "inject", "s1", "--file", str(doc))
    assert result.exit_code == 0, result.output
    assert "injected 1 passages" in result.stdout and "the [bold] notes" in result.stdout
    assert daemon.requests[-1][1]["documents"] == [{"text": "the [bold] notes", "source": str(doc)}]
    result = json.loads(ellm_cli(daemon, "rag", "inject", "s1", "query words", "-k", "3", "--json").stdout)
    assert len(result["passages"]) == 3 and daemon.requests[-1][1]["query"] == "query words"
    assert ellm_cli(daemon, "rag", "inject", "s1").exit_code == 2
    assert ellm_cli(daemon, "rag", "inject", "s1", "q", "--file", str(doc)).exit_code == 2


def test_import_needs_no_numpy():
    code = "import ellm, ellm.cli, sys; assert 'numpy' not in sys.modules and 'ellmd' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# the fake daemon's replies against the real daemon's


def shape(value):
    """A reply's shape: map keys and value kinds, recursively (lists by their first item)."""
    if isinstance(value, dict):
        return {key: shape(v) for key, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    return "number" if isinstance(value, (int, float)) else type(value).__name__


def contract_script(client: Client) -> dict:
    """The same calls against either daemon: each call's reply shape, or its error code."""
    out = {}

    def record(label, op, **args):
        try:
            out[label] = shape(client.call(op, **args))
        except EllmError as e:
            out[label] = e.code
        return out[label]

    opened = client.call("session.open", title="contract", tags=["a"], system="Be brief.")
    sid = opened["session_id"]
    out["open"] = shape(opened)
    record("append", "session.append", session_id=sid, text="Hello there.")
    record("skill.load", "skill.load", session_id=sid, name="git")
    record("skill.load missing", "skill.load", session_id=sid, name="nope")
    record("rag.inject", "rag.inject", session_id=sid, documents=[{"text": "A fact.", "source": "a.md"}])
    record("chat", "session.chat", session_id=sid, content="Hi", max_tokens=2, stream=False)
    record("info", "session.info", session_id=sid)
    record("list", "session.list")
    record("stats", "stats")
    record("snapshot", "session.snapshot", session_id=sid)
    forked = client.call("session.fork", session_id=sid, title="fork")
    out["fork"] = shape(forked)
    turns = len(client.call("session.info", session_id=sid)["turns"])
    record("rewind turn", "session.rewind", session_id=sid, turn=1)
    record("rewind past the last turn", "session.rewind", session_id=sid, turn=turns + 5)
    record("rewind past the end", "session.rewind", session_id=sid, tokens=10**6)
    record("resume", "session.resume", session_id=sid)
    record("release", "session.release", session_id=sid)
    record("release again", "session.release", session_id=sid)
    record("close", "session.close", session_id=sid)
    record("delete", "session.delete", session_id=forked["session_id"])
    record("info missing", "session.info", session_id="no-such-session")
    return out


def test_fake_daemon_replies_like_the_real_one(daemon, tmp_path):
    """The fake daemon's replies have the real daemon's shapes, so the tests above test the client
    against what it will meet (stats, rewind bounds, skill.load, every reply's fields)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from daemon import Daemon as RealDaemon

    skills = tmp_path / "skills"
    (skills / "git").mkdir(parents=True)
    (skills / "git" / "SKILL.md").write_text("---\nname: git\ndescription: Use git.\n---\nCommit often.\n")
    real = RealDaemon(tmp_path, slots=2, extra=["--skills-dir", str(skills)]).start()
    try:
        with Client(real.socket, timeout=120) as client:
            expected = contract_script(client)
    finally:
        assert real.stop() == 0
    with Client(daemon.path, timeout=10) as client:
        actual = contract_script(client)
    for label in expected:
        assert actual[label] == expected[label], label
