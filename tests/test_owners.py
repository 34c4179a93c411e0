"""Every session has an owner: a key reaches only its own sessions and the ones the operator granted
it, not those made over the Unix socket or before keys were set; ids are per key (no key can probe
or take another's); connections count per key once authenticated; /metrics is the admin's; what a
stored response keeps is bounded. Against the real daemon with several keys."""

from __future__ import annotations

from http.client import HTTPConnection
import socket
import time

import pytest

from ellm.errors import NotFound
from ellmd.errors import EllmError

from daemon import Daemon
from test_http import free_port
from test_security import http

ALICE, BOB, ROOT = "key-of-alice", "key-of-bob", "key-of-root"
KEY_FILE = f"""# API keys: NAME KEY [admin]
   # an indented comment, not a key

alice {ALICE}
bob {BOB}
root {ROOT} admin
"""
MAX_CONNECTIONS = 6  # per key
QUESTION = {"messages": [{"role": "user", "content": "Hello."}], "max_tokens": 2, "temperature": 0}


def start(tmp, keys: bool = True, extra=()) -> Daemon:
    extra = ["--http-max-connections", str(MAX_CONNECTIONS), *extra]
    if keys:
        (tmp / "keys").write_text(KEY_FILE)
        extra += ["--api-key-file", str(tmp / "keys")]
    port = free_port()
    daemon = Daemon(tmp, slots=2, extra=[*extra, "--http", f"127.0.0.1:{port}"]).start()
    daemon.port = port
    return daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start(tmp_path_factory.mktemp("owners"))
    yield d
    assert d.stop() == 0


def chat(daemon, key, session_id=None, content="Hello."):
    body = {**QUESTION, "messages": [{"role": "user", "content": content}]}
    return http(daemon.port, "/v1/chat/completions", {**body, **({"session_id": session_id} if session_id else {})},
                key=key)


def cached(body) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


# ---- the key file -----------------------------------------------------------------------------


def test_key_file_names_keys_and_skips_indented_comments(daemon):
    from ellmd.server.config import parse_key_file

    keys = parse_key_file(KEY_FILE, "keys")
    assert [(k.name, k.secret, k.admin) for k in keys] == [("alice", ALICE, False), ("bob", BOB, False),
                                                           ("root", ROOT, True)]
    assert [k.name for k in parse_key_file("a-bare-key\n", "keys")] == [keys[0].__class__("", "a-bare-key").owner[:8]]
    with pytest.raises(EllmError, match="line 1: expected KEY, NAME KEY or NAME KEY admin"):
        parse_key_file("alice key superuser\n", "keys")
    # the daemon reads it so: the indented comment is no key, each key works
    assert http(daemon.port, "/v1/models", key="# an indented comment, not a key")[0] == 401
    for key in (ALICE, BOB, ROOT):
        assert http(daemon.port, "/v1/models", key=key)[0] == 200


# ---- sessions of the socket and of other keys ---------------------------------------------------------


def test_a_socket_session_is_no_keys_until_granted(daemon):
    with daemon.client() as client:
        session = client.open_session(system="The secret word is kumquat.")
        session.append(message={"role": "user", "content": "What is the secret word?"})
        before = session.info()
        status, _, body = chat(daemon, ALICE, session.id)
        assert status == 200 and body["session_id"] == session.id  # a session of her own
        after = session.info()
        assert (after["tokens"], len(after["turns"])) == (before["tokens"], len(before["turns"]))  # untouched
        with pytest.raises(NotFound, match="no API key is named 'mallory'"):
            session.grant("mallory")
        assert session.grant("alice") == {"session_id": session.id, "key": "alice"}
        # Alice's own session of that name is found first: she names the granted one after deleting hers
        status, _, _ = http(daemon.port, "/v1/chat/completions", {**QUESTION, "session_id": "x" * 65}, key=ALICE)
        assert status == 400
        hers = [s for s in client.list_sessions() if s["session_id"].startswith(session.id + "@")]
        assert len(hers) == 1
        client.session(hers[0]["session_id"]).delete()
        status, _, body = chat(daemon, BOB, session.id)
        assert status == 200 and session.info()["tokens"] == before["tokens"]
        status, _, body = chat(daemon, ALICE, session.id, content="Again.")
        assert status == 200 and body["session_id"] == session.id
        assert session.info()["tokens"] > before["tokens"]  # she reached it
        reached = session.info()["tokens"]
        session.grant(None)
        status, _, body = chat(daemon, ALICE, session.id, content="Once more.")
        assert status == 200 and session.info()["tokens"] == reached  # taken back: hers is a new one again


def test_ids_are_per_key_no_probe_no_squat(daemon):
    status, _, first = chat(daemon, ALICE, "notes", content="Alice's first question.")
    assert status == 200 and first["session_id"] == "notes"
    status, _, body = chat(daemon, BOB, "notes", content="Bob's question.")  # his own, not a 404 (no oracle)
    assert status == 200 and body["session_id"] == "notes"
    status, _, body = chat(daemon, BOB, "future")  # Bob names an id first ...
    assert status == 200
    status, _, body = chat(daemon, ALICE, "future")  # ... Alice may still use it
    assert status == 200 and body["session_id"] == "future"
    conversation = {**QUESTION, "session_id": "notes", "messages": [
        {"role": "user", "content": "Alice's first question."},
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And then?"}]}
    status, _, body = http(daemon.port, "/v1/chat/completions", conversation, key=ALICE)
    assert status == 200 and cached(body) >= first["usage"]["total_tokens"] - 1  # hers was not taken over
    status, _, body = http(daemon.port, "/v1/chat/completions", {**QUESTION, "session_id": "notes@" + "0" * 16},
                           key=ALICE)  # an id of another scope: as if unknown, and never created
    assert status == 404


def test_an_admin_key_reaches_every_session_and_the_metrics(daemon):
    status, _, first = http(daemon.port, "/v1/responses", {"input": "Hello.", "max_output_tokens": 2,
                                                           "temperature": 0}, key=ALICE)
    assert status == 200
    assert http(daemon.port, f"/v1/responses/{first['id']}", key=BOB)[0] == 404
    # the admin names the session by the id it is kept under (as the socket lists it)
    with daemon.client() as client:
        kept = next(s["session_id"] for s in client.list_sessions() if s["session_id"].startswith(
            first["id"].split("_", 2)[2] + "@"))
    turn = first["id"].split("_")[1]
    status, _, body = http(daemon.port, f"/v1/responses/resp_{turn}_{kept}", key=ROOT)
    assert status == 200 and body["output"] == first["output"]
    status, _, body = http(daemon.port, "/metrics", key=ALICE)
    assert status == 403 and "admin key" in body["error"]["message"]
    assert http(daemon.port, "/metrics", key=BOB)[0] == 403
    status, headers, _ = metrics(daemon.port, ROOT)
    assert status == 200


def metrics(port, key):
    connection = HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("GET", "/metrics", headers={"Authorization": f"Bearer {key}"})
    reply = connection.getresponse()
    text = reply.read().decode()
    connection.close()
    assert "ellm_generated_tokens_total" in text
    return reply.status, dict(reply.headers), text


# ---- made before keys were set ----------------------------------------------------------------------


def test_what_was_made_without_keys_is_no_keys(tmp_path):
    daemon = start(tmp_path, keys=False)
    try:
        status, _, response = http(daemon.port, "/v1/responses", {
            "input": "Hello.", "instructions": "The secret word is kumquat.", "max_output_tokens": 2,
            "temperature": 0})
        assert status == 200
        assert chat(daemon, None, "old")[0] == 200
    finally:
        assert daemon.stop() == 0
    daemon = start(tmp_path)
    try:
        rid = response["id"]
        for key in (ALICE, BOB):
            status, _, body = http(daemon.port, f"/v1/responses/{rid}", key=key)
            assert status == 404 and "kumquat" not in str(body)
            follow = {"input": "Again.", "previous_response_id": rid, "max_output_tokens": 2, "temperature": 0}
            assert http(daemon.port, "/v1/responses", follow, key=key)[0] == 404
            delete = urllib_delete(daemon.port, f"/v1/responses/{rid}", key)
            assert delete == 404
        with daemon.client() as client:
            old = client.session("old").info()
        assert chat(daemon, ALICE, "old")[0] == 200  # a new session of hers ...
        with daemon.client() as client:  # ... the old one untouched
            assert client.session("old").info()["tokens"] == old["tokens"]
        status, _, body = http(daemon.port, f"/v1/responses/{rid}", key=ROOT)  # the operator's still
        assert status == 200 and body["instructions"] == "The secret word is kumquat."
    finally:
        assert daemon.stop() == 0


def urllib_delete(port, path, key) -> int:
    connection = HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("DELETE", path, headers={"Authorization": f"Bearer {key}"})
    status = connection.getresponse().status
    connection.close()
    return status


# ---- connections ------------------------------------------------------------------------------------


def keep_alive(port, key) -> HTTPConnection:
    """A connection that sent one request with `key` and stays open (keep-alive)."""
    connection = HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
    reply = connection.getresponse()
    reply.read()
    connection.status = reply.status
    return connection


def test_connections_count_per_key_after_authentication(daemon):
    idle = [socket.create_connection(("127.0.0.1", daemon.port)) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        # idle sockets from anyone: a keyed client still gets in
        assert http(daemon.port, "/v1/models", key=ALICE)[0] == 200
        bobs = [keep_alive(daemon.port, BOB) for _ in range(MAX_CONNECTIONS)]
        assert all(c.status == 200 for c in bobs)
        status, headers, body = http(daemon.port, "/v1/models", key=BOB)  # one more of Bob's
        assert status == 503 and body["error"]["code"] == "too_many_connections" and headers["Retry-After"]
        assert http(daemon.port, "/v1/models", key=ALICE)[0] == 200  # Bob locks out only Bob
        for connection in bobs:
            connection.close()
        # unauthenticated connections are closed: the oldest when more come, the others after a short time
        for sock in idle:
            sock.settimeout(120)
            assert sock.recv(1) == b""
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 60  # Bob's closed connections leave the count as the server sees them close
    while http(daemon.port, "/v1/models", key=BOB)[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)


# ---- what a stored response keeps ----------------------------------------------------------------------


@pytest.mark.parametrize("metadata, problem", [
    ({f"k{i}": "v" for i in range(17)}, "at most 16"),
    ({"k" * 65: "v"}, "at most 64 characters"),
    ({"k": "v" * 513}, "at most 512 characters"),
    ({"k": 1}, "must be a string"),
])
def test_response_metadata_is_bounded(daemon, metadata, problem):
    status, _, body = http(daemon.port, "/v1/responses", {"input": "Hello.", "max_output_tokens": 2,
                                                          "metadata": metadata}, key=ALICE)
    assert status == 400 and problem in body["error"]["message"] and body["error"]["param"] == "metadata"


def test_a_stored_responses_note_is_written_once_apart_from_its_session(tmp_path):
    from ellmd.runtime.store.lmdb import Store
    from ellmd.runtime.store.base import pack

    metadata = {f"key{i}": f"{i:x}" * 512 for i in range(16)}  # the most metadata may hold
    daemon = start(tmp_path)
    try:
        ids, previous = [], None
        for i in range(4):
            body = {"input": f"Question {i}.", "max_output_tokens": 2, "temperature": 0, "metadata": metadata,
                    **({"previous_response_id": previous} if previous else {})}
            status, _, response = http(daemon.port, "/v1/responses", body, key=ALICE)
            assert status == 200
            ids.append(previous := response["id"])
    finally:
        assert daemon.stop() == 0
    store = Store(tmp_path / "store")
    try:
        [meta] = [m for m in store.list_meta() if "responses" in m["tags"]]
        assert len([t for t in meta["turns"] if t["kind"] == "generation"]) == 4
        assert all(turn.get("note") is None for turn in meta["turns"])
        assert len(pack(meta)) < 4096  # no turn's metadata is rewritten with the session's
        for rid in ids:
            assert store.get_note(meta["session_id"], rid.split("_")[1])["metadata"] == metadata
    finally:
        store.close()
    daemon = start(tmp_path)
    try:
        for rid in ids:
            status, _, body = http(daemon.port, f"/v1/responses/{rid}", key=ALICE)
            assert status == 200 and body["metadata"] == metadata
        assert urllib_delete(daemon.port, f"/v1/responses/{ids[1]}", ALICE) == 200
        assert http(daemon.port, f"/v1/responses/{ids[1]}", key=ALICE)[0] == 404
        assert http(daemon.port, f"/v1/responses/{ids[2]}", key=ALICE)[0] == 200
    finally:
        assert daemon.stop() == 0


def test_the_operator_grants_from_the_command_line(daemon):
    from typer.testing import CliRunner

    from ellm.cli import app

    def ellm(*args):
        return CliRunner().invoke(app, ["--socket", str(daemon.socket), *args])

    with daemon.client() as client:
        session = client.open_session(system="Granted from the command line.")
        result = ellm("session", "grant", session.id, "bob")
        assert result.exit_code == 0 and f"{session.id} now belongs to key bob" in result.output
        tokens = session.info()["tokens"]
        status, _, body = chat(daemon, BOB, session.id)
        assert status == 200 and body["session_id"] == session.id and session.info()["tokens"] > tokens
        result = ellm("session", "grant", session.id, "--revoke")
        assert result.exit_code == 0 and "now belongs to no key" in result.output
        assert ellm("session", "grant", session.id).exit_code != 0  # a name, or --revoke
        result = ellm("session", "grant", "no-such-session", "bob")
        assert result.exit_code != 0 and "no session 'no-such-session'" in result.output
