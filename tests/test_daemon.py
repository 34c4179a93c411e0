"""The real daemon (a subprocess) on a temporary socket and store, with the built-in SmolLM2 model.

Greedy decoding throughout, so results are reproducible; comparisons between two runs use the
logits (as log-probabilities) of the first generated token.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket as socketlib
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest

from ellm.errors import BadRequest, NotFound, UnknownOp

from daemon import Daemon

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("daemon"), slots=2, extra=("--gap-ratio", "0.5")).start()
    yield d
    assert d.stop() == 0


def assert_same_top(ours, theirs, tol):
    """The same candidate tokens, with log-probabilities within tol."""
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    assert [lp for _, lp in ours] == pytest.approx([lp for _, lp in theirs], abs=tol)


def test_turn_prefills_only_new_tokens(daemon):
    with daemon.client() as client:
        session = client.open_session(title="turns")
        first = session.chat("Name a color.", max_tokens=8)
        assert first.usage["reused_tokens"] == 0
        assert first.usage["generated_tokens"] == len(first.token_ids) > 0
        previous = first
        for message in ("Name another one.", "And a third?"):
            turn = session.chat(message, max_tokens=8)
            usage = turn.usage
            # Everything up to the previous turn's last token was already in the KV: only that token
            # (and the turn's end), the new message and the generation prompt are prefilled.
            assert usage["reused_tokens"] == previous.usage["prompt_tokens"] + len(previous.token_ids) - 1
            assert usage["prefilled_tokens"] + usage["reused_tokens"] == usage["prompt_tokens"]
            assert usage["prefilled_tokens"] < 30 < usage["reused_tokens"]
            previous = turn
        info = session.info()
        assert [t["kind"] for t in info["turns"]] == ["message", "generation"] * 3
        assert info["turns"][-1]["end"] == info["tokens"]


def test_sessions_continue_after_eviction(daemon):
    """Five sessions over two slots: each second turn equals the same turn run without eviction."""
    prompts = [f"Tell me about the number {i}." for i in range(5)]
    with daemon.client() as client:
        evicted = [client.open_session(title=f"evicted {i}") for i in range(5)]
        for session, prompt in zip(evicted, prompts):
            session.chat(prompt, max_tokens=6)
        # By now sessions 0..2 have left their slots: the second turn resumes them from the store.
        second = [s.chat("Why?", max_tokens=6, logprobs=5) for s in evicted]
        for prompt, result in zip(prompts, second):
            alone = client.open_session(title="alone")
            alone.chat(prompt, max_tokens=6)
            reference = alone.chat("Why?", max_tokens=6, logprobs=5)
            assert result.token_ids == reference.token_ids
            assert_same_top(result.logprobs[0]["top"], reference.logprobs[0]["top"], 1e-4)
        stats = client.stats()
        assert stats["sessions_resident"] == 2
        assert stats["sessions_stored"] >= 10
        scheduler = stats["scheduler"]
        assert scheduler["gap_ratio"] == 0.5  # the start flag reached the engine loop's policy
        assert scheduler["decode_step_ms"] > 0 and scheduler["prefill_token_ms"] > 0  # measured as it ran


def test_fork_and_rewind(daemon):
    with daemon.client() as client:
        session = client.open_session(title="fork me")
        session.chat("Say hello.", max_tokens=5)
        before = session.info()
        fork = session.fork(title="the fork")
        assert fork.id != session.id
        assert fork.info()["tokens"] == before["tokens"]
        a = session.chat("Now say goodbye.", max_tokens=1, logprobs=5)
        b = fork.chat("Now say goodbye.", max_tokens=1, logprobs=5)
        assert a.token_ids == b.token_ids
        assert_same_top(a.logprobs[0]["top"], b.logprobs[0]["top"], 1e-4)
        # Rewind to before "Now say goodbye." and ask it again: the same first-token distribution.
        info = session.rewind(turn=2)
        assert info["tokens"] == before["tokens"] and len(info["turns"]) == 2
        again = session.chat("Now say goodbye.", max_tokens=1, logprobs=5)
        assert_same_top(again.logprobs[0]["top"], a.logprobs[0]["top"], 2e-2)
        session.rewind(tokens=3)
        assert session.info()["tokens"] == 3


def test_concurrent_clients(daemon):
    results, errors = {}, []

    def run(index):
        try:
            with daemon.client() as client:
                session = client.open_session(title=f"concurrent {index}")
                results[index] = session.chat(f"Count to {index + 3}.", max_tokens=12, ignore_eos=True)
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    assert sorted(results) == [0, 1, 2]
    for result in results.values():
        assert result.finish_reason == "length" and len(result.token_ids) == 12


def raw_connection(path: Path) -> tuple[socketlib.socket, msgpack.Unpacker]:
    sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    sock.connect(str(path))
    sock.settimeout(60)
    return sock, msgpack.Unpacker(raw=False)


def read_message(sock, unpacker):
    while True:
        for message in unpacker:
            return message
        data = sock.recv(1 << 16)
        if not data:
            return None
        unpacker.feed(data)


def test_disconnect_mid_stream_keeps_what_was_generated(daemon):
    with daemon.client() as client:
        session_id = client.open_session(title="disconnect").id
    sock, unpacker = raw_connection(daemon.socket)
    sock.sendall(msgpack.packb({"id": 0, "op": "hello", "args": {"protocol": 1, "client": "test"}}))
    assert read_message(sock, unpacker)["ok"]
    sock.sendall(msgpack.packb({"id": 1, "op": "session.chat", "args": {
        "session_id": session_id, "content": "Write a long story.", "max_tokens": 1000, "ignore_eos": True}}))
    events = [read_message(sock, unpacker) for _ in range(3)]
    assert all(e["event"] == "token" for e in events)
    sock.close()
    with daemon.client() as client:
        session = client.session(session_id)
        deadline = time.monotonic() + 60
        while session.info()["busy"] and time.monotonic() < deadline:
            time.sleep(0.1)
        info = session.info()
        assert not info["busy"]
        generation = info["turns"][-1]
        assert generation["kind"] == "generation"
        assert generation["end"] == info["tokens"]
        assert 3 <= generation["end"] - generation["start"] < 1000
        # The session goes on from where it was cut.
        assert session.chat("Thanks.", max_tokens=2).usage["reused_tokens"] > 0


@pytest.mark.parametrize("payload, code", [
    (b"\xc1\xc1\xc1 garbage", "bad_frame"),
    (msgpack.packb([1, 2, 3]), "bad_frame"),
    (msgpack.packb({"id": 1, "op": "session.info", "args": {"session_id": "x" * (17 << 20)}}), "bad_frame"),
])
def test_bad_frames_get_an_error_and_the_daemon_keeps_serving(daemon, payload, code):
    sock, unpacker = raw_connection(daemon.socket)
    sock.sendall(msgpack.packb({"id": 0, "op": "hello", "args": {"protocol": 1}}))
    assert read_message(sock, unpacker)["ok"]
    try:
        sock.sendall(payload)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the daemon may close before reading all of an oversized frame
    reply = read_message(sock, unpacker)
    assert reply["ok"] is False and reply["error"]["code"] == code
    sock.close()
    with daemon.client() as client:
        assert client.stats()["slots"] == 2


def test_bad_requests_get_typed_errors(daemon):
    with daemon.client() as client:
        with pytest.raises(UnknownOp):
            client.call("session.explode")
        with pytest.raises(NotFound):
            client.call("session.info", session_id="no-such-session")
        with pytest.raises(BadRequest):
            client.call("session.info", session_id=42)
        session = client.open_session(system="Be brief.")
        opened = session.info()["turns"]
        assert [(t["kind"], t["role"], t["start"]) for t in opened] == [("message", "system", 0)]
        with pytest.raises(BadRequest):
            client.call("session.append", session_id=session.id, text="a", tokens=[1])
        with pytest.raises(BadRequest):
            client.call("session.chat", session_id=session.id, content="hi", colour="blue")
        with pytest.raises(BadRequest):
            session.append(tokens=[10**9])
        with pytest.raises(BadRequest):
            session.chat("hi", temperature=-1)
        assert client.stats()["slots"] == 2


def test_over_capacity_turn_is_refused_and_leaves_the_session_unchanged(daemon):
    from ellm.errors import CapacityError

    with daemon.client() as client:
        session = client.open_session()
        session.chat("Hello.", max_tokens=4)
        before = session.info()
        with pytest.raises(CapacityError):
            session.append(text="word " * 3000)
        after = session.info()
        assert after["tokens"] == before["tokens"] and after["turns"] == before["turns"]


def test_resume_after_restart_equals_never_evicted(tmp_path):
    daemon = Daemon(tmp_path, slots=2).start()
    with daemon.client() as client:
        session = client.open_session(title="survivor")
        session.chat("What is the capital of France?", max_tokens=8)
        fork = session.fork(title="stored copy")  # a stored twin that never becomes resident here
        reference = session.chat("And of Italy?", max_tokens=8, logprobs=5)
        fork_id = fork.id
    assert daemon.stop() == 0
    daemon = Daemon(tmp_path, slots=2).start()
    try:
        with daemon.client() as client:
            listed = {s["session_id"]: s for s in client.list_sessions()}
            assert fork_id in listed and listed[fork_id]["title"] == "stored copy"
            resumed = client.session(fork_id).chat("And of Italy?", max_tokens=8, logprobs=5)
            assert resumed.usage["reused_tokens"] == reference.usage["reused_tokens"]
            assert resumed.token_ids == reference.token_ids
            for ours, theirs in zip(resumed.logprobs, reference.logprobs):
                assert ours["top"] == theirs["top"]  # the same KV bytes: bit-identical logits
    finally:
        assert daemon.stop() == 0


def test_sigkill_during_snapshots_leaves_a_usable_store(tmp_path):
    daemon = Daemon(tmp_path, slots=1).start()
    committed = []
    with daemon.client() as client:
        session = client.open_session(title="crash")
        session_id = session.id

        def hammer():
            try:
                for i in range(1000):
                    session.append(text=f" step {i} " + "data " * 40)
                    committed.append(session.snapshot())
            except Exception:
                pass  # the daemon was killed under us

        worker = threading.Thread(target=hammer)
        worker.start()
        deadline = time.monotonic() + 120
        while len(committed) < 5 and worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(committed) >= 5, "the snapshots did not get going"
        daemon.kill()
        worker.join(timeout=60)
    daemon = Daemon(tmp_path, slots=1).start()
    try:
        with daemon.client() as client:
            session = client.session(session_id)
            info = session.info()
            assert info["tokens"] >= committed[-1]["stored_tokens"]  # nothing acknowledged was lost
            assert session.resume()["tokens"] == info["tokens"]
            assert session.chat("Go on.", max_tokens=2).usage["reused_tokens"] > 0
    finally:
        assert daemon.stop() == 0


def test_second_daemon_on_the_same_socket_is_refused(daemon):
    result = subprocess.run(daemon.args, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode != 0
    assert "already serving" in result.stderr
    with daemon.client() as client:
        assert client.stats()["slots"] == 2


def test_sigterm_stops_the_daemon_whichever_thread_it_lands_on(tmp_path):
    """The kernel may hand a process's signal to any of its threads, and Python runs handlers on the
    main thread only, which the engine loop keeps waiting on its queue: SIGTERM taken by another
    thread stopped nothing. Sent to the newest thread here (tgkill), it stops the daemon cleanly."""
    daemon = Daemon(tmp_path).start()
    try:
        pid = daemon.process.pid
        newest = max(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
        assert ctypes.CDLL(None, use_errno=True).tgkill(pid, newest, signal.SIGTERM) == 0
        assert daemon.process.wait(timeout=120) == 0
        assert "stopped" in daemon.log.read_text()
    finally:
        if daemon.process.poll() is None:
            daemon.kill()


def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_daemon_goes_on(daemon):
    dump = daemon.stacks()
    assert "_run_module_as_main" in dump, dump  # the main thread's, the last written
    assert "in _loop" in dump and "in run" in dump  # the engine loop, waiting on its queue
    assert dump.lower().count("thread 0x") >= 2  # and the servers' thread beside it
    with daemon.client() as client:
        session = client.open_session(title="after a stack dump")
        session.append(tokens=[1, 2, 3])
        assert session.info()["tokens"] == 3
        session.delete()


def ellm_cli(daemon, *args):
    result = subprocess.run([sys.executable, "-m", "ellm", "--socket", str(daemon.socket), *args],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    return result


def test_ellm_cli_against_the_daemon(daemon, tmp_path):
    import json

    chat = ellm_cli(daemon, "chat", "-m", "Say hi.", "--max-tokens", "5", "--json")
    assert chat.returncode == 0, chat.stderr
    reply = json.loads(chat.stdout)
    assert reply["text"] and reply["usage"]["generated_tokens"] > 0
    session_id = reply["session_id"]
    listed = json.loads(ellm_cli(daemon, "session", "list", "--json").stdout)["sessions"]
    assert session_id in [s["session_id"] for s in listed]
    again = json.loads(ellm_cli(daemon, "chat", "--session", session_id, "-m", "Again.", "--max-tokens", "3", "--json").stdout)
    assert again["usage"]["reused_tokens"] > 0

    before = json.loads(ellm_cli(daemon, "session", "show", session_id, "--json").stdout)
    blob = tmp_path / "session.ellm"
    assert ellm_cli(daemon, "session", "export", session_id, str(blob)).returncode == 0
    assert ellm_cli(daemon, "session", "delete", session_id).returncode == 0
    imported = ellm_cli(daemon, "session", "import", str(blob), "--json")
    assert imported.returncode == 0, imported.stderr
    info = json.loads(ellm_cli(daemon, "session", "show", session_id, "--json").stdout)
    assert info["tokens"] == before["tokens"] and info["turns"] == before["turns"]


def test_ellm_cli_without_a_daemon(tmp_path):
    result = subprocess.run([sys.executable, "-m", "ellm", "--socket", str(tmp_path / "none.sock"), "status"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2
    assert "ellmd start" in result.stderr and "Traceback" not in result.stderr


def test_detach_status_stop(tmp_path):
    import json

    env = {**os.environ, "ELLMD_SOCKET": str(tmp_path / "run" / "ellmd.sock"), "ELLMD_STORE": str(tmp_path / "store"),
           "ELLMD_SEQUENCE_LENGTH": "1024", "ELLMD_BATCH_SIZE": "1", "XDG_CONFIG_HOME": str(tmp_path / "config")}

    def ellmd(*args):
        return subprocess.run([sys.executable, "-m", "ellmd.cli", *args], capture_output=True, text=True,
                              timeout=600, cwd=ROOT, env=env)

    started = ellmd("start", "--detach", "--threads", "2")
    assert started.returncode == 0, started.stderr
    assert (tmp_path / "run" / "ellmd.pid").exists()
    status = ellmd("status", "--json")
    assert status.returncode == 0, status.stderr
    stats = json.loads(status.stdout)
    assert stats["slots"] == 1 and stats["sequence_length"] == 1024
    assert ellmd("status").returncode == 0
    stopped = ellmd("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert not (tmp_path / "run" / "ellmd.sock").exists()
    again = ellmd("status")
    assert again.returncode == 2 and "ellmd start" in again.stderr


def test_stop_returns_promptly_with_idle_clients_and_answers_every_request(tmp_path):
    daemon = Daemon(tmp_path, slots=1).start()
    with daemon.client() as client:
        generating, waiting = client.open_session().id, client.open_session().id
    idle = [raw_connection(daemon.socket) for _ in range(3)]
    for sock, unpacker in idle[:2]:  # two idle after hello, one idle before it
        sock.sendall(msgpack.packb({"id": 0, "op": "hello", "args": {"protocol": 1}}))
        assert read_message(sock, unpacker)["ok"]
    sock, unpacker = raw_connection(daemon.socket)
    sock.sendall(msgpack.packb({"id": 0, "op": "hello", "args": {"protocol": 1}}))
    assert read_message(sock, unpacker)["ok"]
    long = {"content": "Write a long story.", "max_tokens": 1500, "ignore_eos": True}
    sock.sendall(msgpack.packb({"id": 1, "op": "session.chat", "args": {"session_id": generating, **long}}))
    assert read_message(sock, unpacker)["event"] == "token"  # generating in the only slot
    sock.sendall(msgpack.packb({"id": 2, "op": "session.chat", "args": {"session_id": waiting, **long}}))
    started = time.monotonic()
    stopped = subprocess.run([sys.executable, "-m", "ellmd.cli", "stop", "--socket", str(daemon.socket)],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert stopped.returncode == 0, stopped.stderr
    assert time.monotonic() - started < 30
    assert daemon.process.wait(timeout=30) == 0
    replies = {}
    while (message := read_message(sock, unpacker)) is not None:
        if "ok" in message:
            replies[message["id"]] = message
    assert replies[1]["ok"] and replies[1]["result"]["finish_reason"] == "cancelled"
    assert replies[2]["error"]["code"] == "cancelled"
    for s, u in idle:  # closed by the daemon (the one without hello may have been told why first)
        while (message := read_message(s, u)) is not None:
            assert message["ok"] is False
