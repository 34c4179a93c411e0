"""Hostile frames against the real daemon: each gets an error reply or a closed connection with a
reason, never a crash; a seeded fuzzer of 10,000 frames leaves a daemon that still generates."""

from __future__ import annotations

import socket as socketlib
import time
from pathlib import Path

import msgpack
import pytest

from daemon import Daemon
from scripts.fuzz_frames import HELLO, fuzz

TIMEOUT_S = 2  # the daemon's hello and frame timeouts here


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("frames"), slots=2,
               extra=["--hello-timeout-s", str(TIMEOUT_S), "--frame-timeout-s", str(TIMEOUT_S)]).start()
    yield d
    assert d.stop() == 0


def connect(path: Path, hello: bool = True) -> tuple[socketlib.socket, msgpack.Unpacker]:
    sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    sock.connect(str(path))
    sock.settimeout(30)
    unpacker = msgpack.Unpacker(raw=False)
    if hello:
        sock.sendall(HELLO)
        assert read(sock, unpacker)["ok"]
    return sock, unpacker


def read(sock, unpacker):
    """The next message, or None once the daemon has closed the connection."""
    while True:
        for message in unpacker:
            return message
        try:
            data = sock.recv(1 << 16)
        except ConnectionResetError:
            return None
        if not data:
            return None
        unpacker.feed(data)


def assert_serving(daemon) -> None:
    assert daemon.process.poll() is None
    with daemon.client() as client:
        assert client.stats()["slots"] == 2


@pytest.mark.parametrize("payload, reason", [
    (b"\x82\x81\xa1a\x01\x01\xa2id\x01", "unhashable"),  # a map as a map key
    (b"\x81\x92\x01\x02\xa1x", "unhashable"),  # an array as a map key
    (b"\x91" * 2000 + b"\x01", "not a msgpack stream"),  # nested deeper than msgpack's stack
    (b"\xc1 never a msgpack byte", "not a msgpack stream"),
    (msgpack.packb("a string"), "must be a map"),
    (b"\xdb\xff\xff\xff\xff", "unfinished"),  # a 4 GiB string header: it never completes
])
def test_garbage_gets_bad_frame_and_a_closed_connection(daemon, payload, reason):
    sock, unpacker = connect(daemon.socket)
    sock.sendall(payload)
    reply = read(sock, unpacker)
    assert reply["id"] is None and reply["error"]["code"] == "bad_frame" and reason in reply["error"]["message"]
    assert read(sock, unpacker) is None  # closed after it
    sock.close()
    assert_serving(daemon)


def test_bad_requests_keep_the_connection(daemon):
    sock, unpacker = connect(daemon.socket, hello=False)
    sock.sendall(msgpack.packb({"id": 1, "op": "stats", "args": {}}))  # before hello
    reply = read(sock, unpacker)
    assert reply["id"] == 1 and reply["error"]["code"] == "bad_request" and "hello" in reply["error"]["message"]
    sock.sendall(HELLO)
    assert read(sock, unpacker)["ok"]
    for message, code in [
        ({"id": "one", "op": "stats"}, "bad_request"),
        ({"id": 2, "op": 7, "args": {}}, "bad_request"),
        ({"id": 3, "op": "stats", "args": [1]}, "bad_request"),
        ({3: "x", "id": 4, "op": "stats", "args": {1: 2}}, "bad_request"),
        ({"id": 5, "op": "cancel", "args": {"request_id": [1]}}, "bad_request"),
        ({"id": 6, "op": "session.import", "args": {"upload": [1], "data": b"x"}}, "bad_request"),
        ({"id": 6, "op": "session.import", "args": {"upload": "u99", "data": b"x"}}, "not_found"),
        ({"id": 7, "op": "session.import", "args": {"data": "not binary", "more": True}}, "bad_request"),
        ({"id": 8, "op": "no.such.op", "args": {}}, "unknown_op"),
    ]:
        sock.sendall(msgpack.packb(message, use_bin_type=True))
        reply = read(sock, unpacker)
        assert reply["ok"] is False and reply["error"]["code"] == code, (message, reply)
    sock.sendall(msgpack.packb({"id": 9, "op": "stats", "args": {}}))
    assert read(sock, unpacker)["result"]["slots"] == 2  # the same connection still serves
    sock.close()


def test_no_hello_in_time_closes_the_connection(daemon):
    sock, unpacker = connect(daemon.socket, hello=False)
    started = time.monotonic()
    reply = read(sock, unpacker)
    assert reply["error"]["code"] == "bad_request" and "no hello within" in reply["error"]["message"]
    assert read(sock, unpacker) is None
    assert TIMEOUT_S - 0.5 < time.monotonic() - started < TIMEOUT_S + 5
    sock.close()


def test_a_frame_held_half_sent_closes_the_connection(daemon):
    sock, unpacker = connect(daemon.socket)
    frame = msgpack.packb({"id": 1, "op": "stats", "args": {}})
    sock.sendall(frame[:5])
    started = time.monotonic()
    reply = read(sock, unpacker)
    assert reply["error"]["code"] == "bad_frame" and "unfinished" in reply["error"]["message"]
    assert read(sock, unpacker) is None
    assert TIMEOUT_S - 0.5 < time.monotonic() - started < TIMEOUT_S + 5
    sock.close()


def test_a_slow_frame_that_completes_is_served(daemon):
    """Bytes dribbling in are fine while each frame completes within the frame timeout."""
    sock, unpacker = connect(daemon.socket)
    frame = msgpack.packb({"id": 1, "op": "stats", "args": {}})
    for i in range(3):  # three frames, each split in two, over 1.5 timeouts in all
        sock.sendall(frame[:4])
        time.sleep(TIMEOUT_S / 4)
        sock.sendall(frame[4:])
        assert read(sock, unpacker)["ok"]
        time.sleep(TIMEOUT_S / 4)
    sock.close()


def test_idle_connection_after_hello_stays_open(daemon):
    sock, unpacker = connect(daemon.socket)
    time.sleep(TIMEOUT_S + 1)
    sock.sendall(msgpack.packb({"id": 1, "op": "stats", "args": {}}))
    assert read(sock, unpacker)["ok"]
    sock.close()


def test_oversized_frame(daemon):
    sock, unpacker = connect(daemon.socket)
    try:
        sock.sendall(msgpack.packb({"id": 1, "op": "session.info", "args": {"session_id": "x" * (17 << 20)}}))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the daemon may hang up before reading all of it
    reply = read(sock, unpacker)
    assert reply["error"]["code"] == "bad_frame" and "larger than" in reply["error"]["message"]
    sock.close()
    assert_serving(daemon)


def test_fuzzed_frames_never_take_the_daemon_down(daemon):
    started = time.monotonic()
    stats = fuzz(daemon.socket, frames=10_000, seed=8)
    assert stats["frames"] == 10_000 and stats["replies"] > 1000
    assert time.monotonic() - started < 120
    assert daemon.process.poll() is None
    assert "Traceback" not in daemon.log.read_text()  # no request reached a bug
    with daemon.client() as client:
        reply = client.open_session(title="after the fuzz").chat("Say hi.", max_tokens=4)
        assert reply.token_ids and reply.text
