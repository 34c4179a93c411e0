"""The daemon's resource limits, each set low here: connections (socket and HTTP), requests in flight per connection,
the engine queue (busy over the socket, 429 with Retry-After over HTTP), upload size, HTTP body size
and read timeout, and an export to a client that does not read."""

from __future__ import annotations

import http.client
import io
import json
import socket as socketlib
import time
import urllib.error
import urllib.request

import msgpack
import pytest

from ellm import Busy, Client

from daemon import Daemon
from test_frames import connect, read
from test_http import free_port

LIMITS = {"--max-connections": 4, "--max-in-flight": 2, "--max-queue": 3, "--max-upload-mb": 1,
          "--write-timeout-s": 2, "--http-max-connections": 3, "--http-max-body-mb": 1, "--http-read-timeout-s": 2}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    port = free_port()
    extra = [str(a) for item in LIMITS.items() for a in item] + ["--http", f"127.0.0.1:{port}"]
    d = Daemon(tmp_path_factory.mktemp("limits"), slots=2, extra=extra).start()
    d.port = port
    yield d
    assert d.stop() == 0


def request(sock, unpacker, request_id: int, op: str, **args) -> dict:
    sock.sendall(msgpack.packb({"id": request_id, "op": op, "args": args}, use_bin_type=True))
    return read(sock, unpacker)


def post(port: int, path: str, data: bytes, headers=None) -> tuple[int, dict, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as reply:
            return reply.status, dict(reply.headers), json.load(reply)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.load(e)


def test_connections_beyond_the_limit_are_refused(daemon):
    held = [connect(daemon.socket) for _ in range(4)]
    sock, unpacker = connect(daemon.socket, hello=False)
    reply = read(sock, unpacker)
    assert reply["error"]["code"] == "busy" and "max_connections" in reply["error"]["message"]
    assert read(sock, unpacker) is None
    sock.close()
    with pytest.raises(Busy, match="max_connections"):  # what the client makes of it
        Client(daemon.socket, timeout=30)
    for s, _ in held:
        s.close()
    deadline = time.monotonic() + 10
    while True:  # the daemon notices the closed connections on its next read
        try:
            with daemon.client() as client:
                assert client.stats()["slots"] == 2
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def health(connection: http.client.HTTPConnection) -> tuple[int, dict, dict]:
    connection.request("GET", "/health")
    reply = connection.getresponse()
    return reply.status, dict(reply.headers), json.loads(reply.read())


def test_http_connections_beyond_the_limit_are_refused(daemon):
    held = [http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30) for _ in range(2)]
    for connection in held:  # kept alive: each holds its place
        assert health(connection)[0] == 200
    silent = socketlib.create_connection(("127.0.0.1", daemon.port), timeout=30)  # the third: connected, says nothing
    deadline = time.monotonic() + 10
    while True:  # the server may accept `silent` after this client's next connection
        extra = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
        status, headers, body = health(extra)
        extra.close()
        if status == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert status == 503 and headers["Retry-After"] == "1" and headers["Connection"] == "close"
    assert body["error"]["code"] == "too_many_connections" and "http_max_connections" in body["error"]["message"]
    assert all(health(connection)[0] == 200 for connection in held)  # those served go on being served
    silent.close()  # a client that vanishes without a request frees its place, as one that closes does
    held.pop().close()
    deadline = time.monotonic() + 10
    fresh = []
    while len(fresh) < 2:  # the daemon notices the closes on its next read
        connection = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
        if health(connection)[0] == 200:
            fresh.append(connection)
        else:
            connection.close()
            assert time.monotonic() < deadline, "a closed connection's place was not freed"
            time.sleep(0.1)
    for connection in held + fresh:
        connection.close()


def test_requests_in_flight_per_connection(daemon):
    sock, unpacker = connect(daemon.socket)
    sock.sendall(b"".join(msgpack.packb({"id": i, "op": "stats", "args": {}}) for i in (1, 2, 3)))
    replies = {m["id"]: m for m in (read(sock, unpacker) for _ in range(3))}
    assert replies[1]["ok"] and replies[2]["ok"]
    assert replies[3]["error"]["code"] == "busy" and "max_in_flight" in replies[3]["error"]["message"]
    sock.close()


def test_a_full_engine_queue_answers_busy_and_429(daemon):
    with daemon.client() as client:
        sessions = [client.open_session(title=f"queued {i}").id for i in range(3)]
    a, a_unpacker = connect(daemon.socket)
    b, b_unpacker = connect(daemon.socket)
    long = {"content": "Write a very long story.", "max_tokens": 1500, "ignore_eos": True}
    for sock, request_id, session_id in ((a, 1, sessions[0]), (a, 2, sessions[1]), (b, 1, sessions[2])):
        sock.sendall(msgpack.packb({"id": request_id, "op": "session.chat", "args": {"session_id": session_id, **long}}))
    # Two generate (two slots), one waits for a slot: three outstanding, the queue's limit.
    deadline = time.monotonic() + 60
    while (reply := request(b, b_unpacker, 2, "stats")).get("ok") or reply.get("event"):
        assert time.monotonic() < deadline, "the queue never filled"
        time.sleep(0.05)
    assert reply["error"]["code"] == "busy" and "max_queue" in reply["error"]["message"]
    status, headers, body = post(daemon.port, "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 1}).encode())
    assert status == 429 and headers["Retry-After"] == "1" and body["error"]["code"] == "rate_limit_exceeded"
    a.close()  # cancels its two generations
    b.close()
    deadline = time.monotonic() + 60
    while True:  # the daemon serves again once the generations have ended
        status, _, body = post(daemon.port, "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 1}).encode())
        if status == 200:
            break
        assert status == 429 and time.monotonic() < deadline
        time.sleep(0.2)
    assert body["choices"][0]["text"] is not None


def test_upload_size(daemon):
    sock, unpacker = connect(daemon.socket)
    piece = b"x" * (700 << 10)
    first = request(sock, unpacker, 1, "session.import", data=piece, more=True)
    assert first["ok"] and first["result"]["received"] == len(piece)
    upload = first["result"]["upload"]
    over = request(sock, unpacker, 2, "session.import", upload=upload, data=piece, more=True)
    assert over["error"]["code"] == "bad_request" and "max_upload_mb" in over["error"]["message"]
    gone = request(sock, unpacker, 3, "session.import", upload=upload, data=b"", more=False)
    assert gone["error"]["code"] == "not_found"  # the upload was dropped
    sock.close()


def test_export_to_a_client_that_does_not_read_is_dropped(daemon):
    with daemon.client() as client:
        session = client.open_session(title="big")
        session.append(text="many words " * 150)  # ~300 tokens: a blob of several MiB
        session_id, tokens = session.id, session.info()["tokens"]
    sock, unpacker = connect(daemon.socket)
    sock.setsockopt(socketlib.SOL_SOCKET, socketlib.SO_RCVBUF, 4096)
    sock.sendall(msgpack.packb({"id": 1, "op": "session.export", "args": {"session_id": session_id}}))
    time.sleep(LIMITS["--write-timeout-s"] + 2)  # read nothing meanwhile
    messages = []
    while (message := read(sock, unpacker)) is not None:
        messages.append(message)
    assert all(m.get("event") == "chunk" for m in messages)  # some data maybe, never the reply
    sock.close()
    assert "stopped reading its export" in daemon.log.read_text()
    with daemon.client() as client:  # the session is whole and exports to a client that reads
        out = io.BytesIO()
        result = client.session(session_id).export(out)
        assert result["bytes"] == len(out.getvalue()) > (4 << 20) and result["tokens"] == tokens


def test_http_body_size_and_read_timeout(daemon):
    status, _, body = post(daemon.port, "/v1/completions", b'{"prompt": "' + b"x" * (2 << 20) + b'"}')
    assert status == 413
    with socketlib.create_connection(("127.0.0.1", daemon.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\"")
        started = time.monotonic()
        reply = sock.recv(65536).decode()
        assert reply.startswith("HTTP/1.1 408") and "http_read_timeout_s" in reply
        assert time.monotonic() - started < LIMITS["--http-read-timeout-s"] + 5
    with socketlib.create_connection(("127.0.0.1", daemon.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never finished
        started = time.monotonic()
        assert sock.recv(65536) == b""  # closed
        assert time.monotonic() - started < LIMITS["--http-read-timeout-s"] + 5
