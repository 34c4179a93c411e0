"""Who may reach the daemon and what it reads: the socket's directory and mode, SO_PEERCRED, HTTP API
keys with per-key sessions, Host and Origin checks on loopback, JSON content types, and the files
retrieval and skills may read (no special files, no symlinks out of a root)."""

from __future__ import annotations

import asyncio
import json
import os
import socket as socketlib
import stat
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import pytest

from ellm.errors import BadRequest
from ellmd.runtime.context.retrieval import RagLibrary, RetrievalError
from ellmd.runtime.context.skills import SkillLibrary
from ellmd.server.unix import UnixServer, peer_uid
from ellmd.text.chat_template import ChatTemplate, TemplateError

from daemon import ROOT, Daemon
from test_frames import connect, read
from test_http import free_port

KEYS = ["key-of-alice", "key-of-bob"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("security")
    keys = tmp / "keys"
    keys.write_text("# API keys\n" + "\n".join(KEYS) + "\n")
    port = free_port()
    d = Daemon(tmp, slots=2, extra=["--http", f"127.0.0.1:{port}", "--api-key-file", str(keys)]).start()
    d.port = port
    yield d
    assert d.stop() == 0


def http(port: int, path: str, body: dict | None = None, key: str | None = None, headers=None):
    """(status, headers, JSON body) of a GET (body None) or a JSON POST."""
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as reply:
            return reply.status, dict(reply.headers), json.load(reply)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.load(e)


def start_fails(tmp: Path, *args) -> str:
    """The stderr of an `ellmd start` that must refuse (before loading the model)."""
    command = [sys.executable, "-m", "ellmd.cli", "start", "--store", str(tmp / "store"), *args]
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp / "config")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    return result.stderr


# ---- the Unix socket ----------------------------------------------------------------------


def test_socket_is_private_from_its_creation(daemon):
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o600
    directory = os.stat(daemon.socket.parent)
    assert directory.st_uid == os.getuid() and stat.S_IMODE(directory.st_mode) & 0o077 == 0


def test_a_shared_or_foreign_socket_directory_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    assert "make it private (chmod 700" in start_fails(tmp_path, "--socket", str(shared / "ellmd.sock"))
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)  # the tests run as root: give it to nobody
    assert "belongs to uid 65534" in start_fails(tmp_path, "--socket", str(foreign / "ellmd.sock"))


def test_peer_credentials(tmp_path):
    a, b = socketlib.socketpair(socketlib.AF_UNIX)
    assert peer_uid(a) == os.getuid()
    a.close(), b.close()

    async def refused_as_another_uid():
        server = UnixServer(runtime=None, path=tmp_path / "run" / "s.sock", on_shutdown=None, info={})
        server.uid = os.getuid() + 1  # as if the daemon ran as another user than this process
        await server.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(server.path))
            data = await asyncio.wait_for(reader.read(), 10)  # everything until the daemon hangs up
            writer.close()
            return data
        finally:
            await server.close()

    reply = msgpack.unpackb(asyncio.run(refused_as_another_uid()))
    assert reply["error"]["code"] == "bad_request" and f"uid {os.getuid()}" in reply["error"]["message"]


# ---- HTTP -----------------------------------------------------------------------------------


def test_api_keys(daemon):
    port = daemon.port
    status, headers, body = http(port, "/v1/models")
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer" and body["error"]["code"] == "invalid_api_key"
    assert http(port, "/v1/models", key="not-a-key")[0] == 401
    assert http(port, "/v1/models", headers={"Authorization": "Basic a2V5LW9mLWFsaWNl"})[0] == 401
    assert http(port, "/health")[0] == 200  # probes need no key
    for key in KEYS:
        status, _, body = http(port, "/v1/models", key=key)
        assert status == 200 and body["data"][0]["id"]


def test_listening_beyond_loopback_needs_a_key(tmp_path):
    (tmp_path / "run").mkdir(mode=0o700)
    stderr = start_fails(tmp_path, "--socket", str(tmp_path / "run" / "s.sock"), "--http", f"0.0.0.0:{free_port()}")
    assert "needs an API key" in stderr


def test_host_and_origin_on_loopback(daemon):
    port, key = daemon.port, KEYS[0]
    status, _, body = http(port, "/v1/models", key=key, headers={"Host": f"attacker.example:{port}"})
    assert status == 403 and "Host" in body["error"]["message"]  # DNS rebinding
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert http(port, "/v1/models", key=key, headers={"Host": host})[0] == 200
    status, _, body = http(port, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, key=key,
                           headers={"Origin": "https://attacker.example"})
    assert status == 403 and "attacker.example" in body["error"]["message"]
    assert http(port, "/v1/models", key=key, headers={"Origin": f"http://localhost:{port}"})[0] == 200


def test_bodies_are_json_with_a_json_content_type(daemon):
    port, key = daemon.port, KEYS[0]
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, _, body = http(port, "/v1/completions", {"prompt": "Hi"}, key=key, headers={"Content-Type": kind})
        assert status == 415 and "application/json" in body["error"]["message"], kind


def test_sessions_belong_to_the_key_that_made_them(daemon):
    port, alice, bob = daemon.port, *KEYS
    question = {"messages": [{"role": "user", "content": "Hello."}], "max_tokens": 2, "temperature": 0}
    status, _, first = http(port, "/v1/chat/completions", {**question, "session_id": "alices"}, key=alice)
    assert status == 200 and first["session_id"] == "alices"
    # ids are per key: Bob's "alices" is a session of his own (tests/test_owners.py)
    status, _, body = http(port, "/v1/chat/completions", {**question, "session_id": "alices",
                                                         "messages": [{"role": "user", "content": "Bye."}]}, key=bob)
    assert status == 200 and body["session_id"] == "alices"
    status, _, body = http(port, "/v1/chat/completions", question, key=bob,
                           headers={"X-Session-Id": "alices"})
    assert status == 200
    follow = {**question, "session_id": "alices", "messages": [
        *question["messages"], {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Again."}]}
    status, _, body = http(port, "/v1/chat/completions", follow, key=alice)
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["total_tokens"] - 1


def test_anthropic_clients_send_their_key_as_x_api_key(daemon):
    port, alice = daemon.port, KEYS[0]
    count = {"model": "smol", "messages": [{"role": "user", "content": "Hello."}]}
    status, _, body = http(port, "/v1/messages/count_tokens", count, headers={"x-api-key": alice})
    assert status == 200 and body["input_tokens"] > 0
    status, _, body = http(port, "/v1/messages/count_tokens", count, headers={"x-api-key": "not-a-key"})
    assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"


def test_stored_responses_belong_to_the_key_that_made_them(daemon):
    port, alice, bob = daemon.port, *KEYS
    status, _, first = http(port, "/v1/responses", {"input": "Hello.", "max_output_tokens": 2, "temperature": 0},
                            key=alice)
    assert status == 200
    follow = {"input": "Again.", "previous_response_id": first["id"], "max_output_tokens": 2, "temperature": 0}
    status, _, body = http(port, "/v1/responses", follow, key=bob)
    assert status == 404 and body["error"]["param"] == "previous_response_id"  # as if it did not exist
    status, _, body = http(port, "/v1/responses", follow, key=alice)
    assert status == 200 and body["usage"]["input_tokens_details"]["cached_tokens"] > 0


# ---- what retrieval and skills read ------------------------------------------------------------


def run_with_deadline(function, seconds: float = 30):
    """function() in a thread; fails (instead of hanging) when it blocks, raises what it raised."""
    result = {}

    def call():
        try:
            result["value"] = function()
        except Exception as e:
            result["error"] = e

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"{function} blocked"
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_rag_reads_only_regular_files_inside_the_folder(tmp_path):
    folder, outside = tmp_path / "docs", tmp_path / "secret"
    folder.mkdir(), outside.mkdir()
    (folder / "guide.md").write_text("The blue whale is the largest animal.\n")
    os.mkfifo(folder / "notes.txt")  # opening it for reading would block forever
    (outside / "passwords.txt").write_text("hunter2 is the password\n")
    (folder / "link.txt").symlink_to(outside / "passwords.txt")
    (folder / "linked").symlink_to(outside, target_is_directory=True)
    library = RagLibrary(tmp_path / "rag")
    summary = run_with_deadline(lambda: library.index(folder, name="docs"))
    assert summary["files"] == 1 and summary["files_indexed"] == 1
    passages = library.search("password hunter2", k=4, name="docs")
    assert all("hunter2" not in p.text for p in passages)
    for path in (tmp_path / "rag").rglob("*"):  # indexes hold the documents' text: private
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    assert stat.S_IMODE((tmp_path / "rag").stat().st_mode) == 0o700


@pytest.mark.parametrize("name", ["../docs", "/etc", "a/b", ".hidden", "", "x" * 65])
def test_index_names_are_plain_names(tmp_path, name):
    library = RagLibrary(tmp_path / "rag")
    for call in (lambda: library.search("q", name=name), lambda: library.index(tmp_path, name=name),
                 lambda: library.remove(name)):
        with pytest.raises(RetrievalError, match="bad index name") as error:
            call()
        assert error.value.code == "bad_request"


def test_rag_inject_refuses_a_path_as_index_name(daemon):
    with daemon.client() as client:
        session = client.open_session()
        for name in ("../x", "/tmp/x"):
            with pytest.raises(BadRequest, match="index"):
                session.inject(query="anything", index=name)
        assert session.info()["tokens"] == 0


def test_skills_stay_inside_their_root(tmp_path):
    root, outside = tmp_path / "skills", tmp_path / "outside"
    (root / "good").mkdir(parents=True), outside.mkdir()
    (root / "good" / "SKILL.md").write_text("---\nname: good\ndescription: fine\n---\nDo good.\n")
    (root / "good" / "notes.md").write_text("notes\n")
    os.mkfifo(root / "good" / "pipe.md")
    (root / "good" / "escape.md").symlink_to(outside / "secret.md")
    (outside / "secret.md").write_text("secret\n")
    (outside / "SKILL.md").write_text("---\nname: evil\ndescription: outside\n---\nLeak.\n")
    (root / "evil").symlink_to(outside, target_is_directory=True)
    (root / "blocked").mkdir()
    os.mkfifo(root / "blocked" / "SKILL.md")
    library = SkillLibrary([root], plugins=False)
    listed = {entry["name"]: entry for entry in run_with_deadline(library.list)}
    assert listed["good"]["files"] == ["notes.md"]
    assert "leads out of the skill root" in listed["evil"]["error"]
    assert "not a regular file" in listed["blocked"]["error"]
    good = library.get("good")
    for file in ("pipe.md", "escape.md", "../../outside/secret.md"):
        with pytest.raises(Exception) as error:
            run_with_deadline(lambda: good.message(file))
        assert getattr(error.value, "code", None) == "bad_request", file


def test_template_rendering_is_bounded():
    template = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    template.max_chars = 100
    assert template.render([{"role": "user", "content": "x" * 100}]) == "x" * 100
    with pytest.raises(TemplateError, match="max_render_kb"):
        template.render([{"role": "user", "content": "x" * 101}])
    runaway = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}xxxx{% endfor %}{% endfor %}")
    with pytest.raises(TemplateError, match="max_render_kb"):
        run_with_deadline(lambda: runaway.render([]))
    with pytest.raises(TemplateError, match="too long"):
        ChatTemplate("{{ 'x' * 1000000000 }}").render([])
