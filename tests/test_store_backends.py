"""Both store backends through the SessionStore interface, the directory backend's crash safety,
and the lease logic, without a model."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ellmd.errors import BadRequest, EllmError
from ellmd.runtime.store.leases import Holder, Lease, Leases, may_take, pid_alive
from ellmd.runtime.store import open_store
from ellmd.runtime.store.base import CHUNK_TOKENS, StoreError
from ellmd.server.config import load_settings

BYTES_PER_TOKEN = 12
FINGERPRINT = {"model": "m1", "tokenizer": "t1", "template": "c1", "kv": "bf16:2x1x3"}
BACKENDS = ("lmdb", "directory")


def fake_kv(tokens):
    """KV bytes that depend on the token ids, so a wrong chunk shows."""
    return lambda a, b: np.repeat(np.asarray(tokens[a:b], np.int32), 3).tobytes()


def meta(session_id="s1", title="t"):
    return {"session_id": session_id, "fingerprint": FINGERPRINT, "title": title}


def load(store, session_id, bytes_per_token=BYTES_PER_TOKEN):
    chunks = {}
    m, tokens = store.load(session_id, lambda start, data: chunks.__setitem__(start, bytes(data)), bytes_per_token)
    return m, tokens, b"".join(chunks[k] for k in sorted(chunks))


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    opened = open_store(request.param, tmp_path / "store")
    yield opened
    opened.close()


def test_snapshots_load_back_rewind_and_delete(store):
    tokens = list(range(CHUNK_TOKENS * 2 + 10))
    first = store.snapshot(meta(), tokens, fake_kv(tokens), stored_tokens=0, bytes_per_token=BYTES_PER_TOKEN)
    assert first["chunks_written"] == 3
    tokens += list(range(5))
    second = store.snapshot(meta(), tokens, fake_kv(tokens), stored_tokens=first["stored_tokens"])
    assert second["chunks_written"] == 1  # only the last, partial chunk changed
    m, loaded, kv = load(store, "s1")
    assert loaded == tokens and kv == fake_kv(tokens)(0, len(tokens)) and m["tokens"] == len(tokens)
    tokens = tokens[:10]  # a rewind rewrites from that chunk and drops the stale ones
    assert store.snapshot(meta(), tokens, fake_kv(tokens), stored_tokens=10)["chunks_written"] == 1
    assert load(store, "s1")[1:] == (tokens, fake_kv(tokens)(0, 10))
    starts = []
    long = list(range(CHUNK_TOKENS * 3))
    store.snapshot(meta("s2"), long, fake_kv(long), stored_tokens=0)
    store.load("s2", lambda start, data: starts.append(start), BYTES_PER_TOKEN, stop=CHUNK_TOKENS + 1)
    assert starts == [0, CHUNK_TOKENS]
    assert store.count() == 2 and sorted(m["session_id"] for m in store.list_meta()) == ["s1", "s2"]
    assert store.delete("s1") and not store.delete("s1")
    assert store.get_meta("s1") is None and store.count() == 1
    with pytest.raises(StoreError, match="session s1 is not in the store"):
        load(store, "s1")
    assert store.stats()["bytes_used"] > 0


def test_export_import_and_fork(store, tmp_path):
    tokens = list(range(300))
    store.snapshot(meta(), tokens, fake_kv(tokens), stored_tokens=0)
    blob = store.export_blob("s1")
    for backend in BACKENDS:  # the blob is the same format whatever the backend
        other = open_store(backend, tmp_path / f"other-{backend}")
        assert other.import_blob(blob, bytes_per_token=BYTES_PER_TOKEN)["session_id"] == "s1"
        assert load(other, "s1")[1:] == load(store, "s1")[1:]
        assert other.import_blob(blob)["session_id"] != "s1"  # the id is taken: a new one
        with pytest.raises(BadRequest, match="not an exported ellm session"):
            other.import_blob(b"not a session")
        other.close()
    store.copy("s1", "fork", meta("fork"))
    assert load(store, "fork")[1:] == load(store, "s1")[1:]
    assert store.get_meta("fork")["title"] == "t"


def test_a_short_chunk_is_refused_and_the_previous_snapshot_kept(store):
    tokens = list(range(100))
    store.snapshot(meta(), tokens, fake_kv(tokens), stored_tokens=0)
    longer = tokens + [7] * 300
    with pytest.raises(StoreError, match="refused"):
        store.snapshot(meta(), longer, lambda a, b: b"short", stored_tokens=100, bytes_per_token=BYTES_PER_TOKEN)
    assert load(store, "s1")[1] == tokens


def write_chunk_file(store, index, change):
    folder = store.path / "sessions" / "_s1"
    path = next(folder.glob(f"kv.{index}.*"))
    data = bytearray(path.read_bytes())
    change(data)
    path.write_bytes(bytes(data))


def test_directory_store_a_damaged_or_short_chunk_is_a_clear_error(tmp_path):
    store = open_store("directory", tmp_path / "store")
    tokens = list(range(CHUNK_TOKENS + 4))
    store.snapshot(meta(), tokens, fake_kv(tokens), stored_tokens=0)
    store.snapshot(meta("s2"), tokens, fake_kv(tokens), stored_tokens=0)
    write_chunk_file(store, 1, lambda data: data.__setitem__(-1, data[-1] ^ 0xFF))
    with pytest.raises(StoreError, match="session s1 is damaged: KV chunk 1 fails its checksum"):
        load(store, "s1")
    write_chunk_file(store, 1, lambda data: data.__delitem__(slice(-BYTES_PER_TOKEN, None)))
    with pytest.raises(StoreError, match="KV chunk 1 holds 3 tokens, not 4"):
        load(store, "s1")
    assert load(store, "s2")[1] == tokens  # the other session is untouched
    (store.path / "sessions" / "_s2" / "meta").write_bytes(b"\xc1garbage")
    with pytest.raises(StoreError, match="session s2 is damaged"):
        store.get_meta("s2")
    assert [m["session_id"] for m in store.list_meta()] == ["s1"]  # logged and left out


SNAPSHOT_THEN_DIE = """
import sys
import numpy as np
from ellmd.runtime.store import open_store
store = open_store("directory", sys.argv[1], replica="a")
tokens = list(range(600))
store.snapshot({"session_id": "s1", "fingerprint": %r, "title": "second"}, tokens,
               lambda a, b: np.repeat(np.asarray(tokens[a:b], np.int32), 3).tobytes(), stored_tokens=10)
print("committed")
""" % FINGERPRINT


def test_directory_store_a_snapshot_killed_before_its_commit_leaves_the_previous_one(tmp_path):
    """SIGKILL between the chunk writes and the meta rename (the store's test hook): the previous
    snapshot loads whole; the next snapshot removes what the killed one left."""
    path = tmp_path / "store"
    store = open_store("directory", path, replica="a")  # a replica: the child may open the store too
    tokens = list(range(300))
    store.snapshot(meta(title="first"), tokens, fake_kv(tokens), stored_tokens=0)
    before = sorted(os.listdir(path / "sessions" / "_s1"))
    kill = tmp_path / "kill"
    kill.touch()
    env = {**os.environ, "ELLMD_TEST_TXN_KILL": str(kill)}
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(SNAPSHOT_THEN_DIE), str(path)], env=env,
                           capture_output=True, text=True)
    assert child.returncode == -9 and "committed" not in child.stdout, child.stderr
    left = sorted(os.listdir(path / "sessions" / "_s1"))
    assert set(left) > set(before)  # the killed snapshot's chunks and tokens were written, not committed
    m, loaded, kv = load(store, "s1")
    assert (m["title"], loaded, kv) == ("first", tokens, fake_kv(tokens)(0, 300))
    tokens += [5, 6]
    store.snapshot(meta(title="third"), tokens, fake_kv(tokens), stored_tokens=300)
    assert load(store, "s1")[1:] == (tokens, fake_kv(tokens)(0, 302))
    assert sorted(os.listdir(path / "sessions" / "_s1")) == ["kv.0.1", "kv.1.2", "meta", "tokens.2"]
    store.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lone_daemon_and_replicas_never_share_a_store(backend, tmp_path):
    alone = open_store(backend, tmp_path / "store")
    with pytest.raises(StoreError, match=f"in use by another ellmd \\(pid {os.getpid()}\\)"):
        open_store(backend, tmp_path / "store")
    with pytest.raises(StoreError, match="in use by another ellmd"):
        open_store(backend, tmp_path / "store", replica="a")
    alone.close()
    replica = open_store(backend, tmp_path / "store", replica="a")
    with pytest.raises(StoreError, match="in use by fleet replicas"):
        open_store(backend, tmp_path / "store")
    replica.close()


# ---- leases ----------------------------------------------------------------------------------


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_may_take_a_lease_when_free_ours_expired_or_its_holder_is_dead():
    me = Holder("a", "host1", os.getpid())
    other_alive = Holder("b", "host1", os.getppid())
    other_dead = Holder("b", "host1", dead_pid())
    elsewhere = Holder("b", "host2", dead_pid())  # a pid on another host says nothing here
    now = 1000.0
    assert may_take(None, me, now)
    assert may_take(Lease(me, now + 5), me, now)
    assert not may_take(Lease(other_alive, now + 5), me, now)
    assert may_take(Lease(other_alive, now - 1), me, now)  # expired
    assert may_take(Lease(other_dead, now + 5), me, now)  # same host, process gone
    assert not may_take(Lease(elsewhere, now + 5), me, now)
    assert pid_alive(os.getpid()) and not pid_alive(other_dead.pid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_leases_take_refuse_renew_expire_release_and_fence(backend, tmp_path):
    a = open_store(backend, tmp_path / "store", replica="a")
    b = copy.copy(a)  # another replica's view (LMDB opens an environment once per process)
    b.holder = Holder("b", a.holder.host, a.holder.pid)
    assert a.take_lease("s1", a.holder, ttl=30) is None
    refused = b.take_lease("s1", b.holder, ttl=30)
    assert refused is not None and refused.holder == a.holder
    tokens = list(range(10))
    with pytest.raises(StoreError, match="session s1 is leased to replica a"):  # the fence
        b.snapshot(meta(), tokens, fake_kv(tokens), stored_tokens=0)
    assert b.get_meta("s1") is None
    a.snapshot(meta(), tokens, fake_kv(tokens), stored_tokens=0)
    before = a.get_lease("s1").expires
    assert a.renew_leases(["s1"], a.holder, ttl=60) == [] and a.get_lease("s1").expires > before
    assert b.renew_leases(["s1"], b.holder, ttl=60) == ["s1"]  # b never held it
    assert not b.release_lease("s1", b.holder) and a.get_lease("s1").holder == a.holder
    a.take_lease("s1", a.holder, ttl=-1)  # expired at once
    assert b.take_lease("s1", b.holder, ttl=30) is None  # taken over
    assert a.renew_leases(["s1"], a.holder, ttl=30) == ["s1"]  # a has lost it
    assert b.release_lease("s1", b.holder) and b.get_lease("s1") is None
    assert a.take_lease("s1", a.holder, ttl=30) is None
    a.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dead_holder_on_this_host_loses_its_leases_at_once(backend, tmp_path):
    store = open_store(backend, tmp_path / "store", replica="b")
    dead = Holder("a", store.holder.host, dead_pid())
    assert store.take_lease("s1", dead, ttl=3600) is None
    assert store.take_lease("s1", store.holder, ttl=30) is None
    assert store.get_lease("s1").holder == store.holder
    store.close()


def test_the_heartbeat_renews_held_leases_and_reports_lost_ones(tmp_path):
    store = open_store("directory", tmp_path / "store", replica="a")
    other = open_store("directory", tmp_path / "store", replica="b")
    leases = Leases(store, ttl=0.3)
    assert leases.take("s1") is None and leases.take("s2") is None
    leases.start()
    try:
        expires = store.get_lease("s1").expires
        while store.get_lease("s1").expires == expires:  # renewed by the thread, not by this test
            pass
        while other.take_lease("s2", Holder("b", "elsewhere", 1), ttl=3600) is not None:  # taken over behind
            store.take_lease("s2", store.holder, ttl=-1)  # its back, as after a stall: expired first
        while not leases.was_lost("s2"):
            pass
        assert leases.holds("s1") and not leases.holds("s2")
    finally:
        leases.stop()
    assert leases.release("s1") and store.get_lease("s1") is None
    store.close()
    other.close()


def test_a_lease_lock_left_by_a_dead_process_is_broken(tmp_path):
    store = open_store("directory", tmp_path / "store", replica="a")
    (store.path / "lease-locks" / "_s1").write_text(f"{store.holder.host} {dead_pid()}\n")
    assert store.take_lease("s1", store.holder, ttl=30) is None
    assert not (store.path / "lease-locks" / "_s1").exists()
    store.close()


def test_fleet_settings_are_checked_before_anything_opens(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no config file of the user's
    settings = load_settings(None, {"store_backend": "directory", "replica": "a-1", "lease_ttl_s": 2.5})
    assert (settings.store_backend, settings.replica, settings.lease_ttl_s) == ("directory", "a-1", 2.5)
    assert load_settings(None, {}).replica is None and load_settings(None, {}).store_backend == "lmdb"
    with pytest.raises(EllmError, match="setting replica must match"):
        load_settings(None, {"replica": "a/b"})
    with pytest.raises(EllmError, match="setting lease_ttl_s must be positive"):
        load_settings(None, {"lease_ttl_s": 0})
    with pytest.raises(EllmError, match="store_backend must be one of lmdb, directory, not 's3'"):
        open_store("s3", tmp_path / "store")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_filesystem_is_the_store_is_full_with_the_space_needed(backend, tmp_path):
    """ENOSPC (LMDB reports its short write as EIO) used to read "mdb_txn_commit: Input/output error"."""
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(root)], check=True)
    try:
        store = open_store(backend, root, map_size=1 << 30)
        per_token, tokens = 1024, list(range(1024))  # 1 MiB a session
        written = []
        with pytest.raises(StoreError) as full:
            for i in range(8):
                store.snapshot(meta(f"s{i}"), tokens, lambda a, b: bytes((b - a) * per_token), 0, per_token)
                written.append(f"s{i}")
        assert 1 <= len(written) < 8
        message = str(full.value)
        assert message.startswith(f"snapshot of session s{len(written)} failed: the store is full: it needs 1.0 MB "
                                  f"of free space and the filesystem of {root} has "), message
        for session_id in written:  # nothing committed is lost
            assert load(store, session_id, per_token)[1] == tokens
        store.close()
    finally:
        subprocess.run(["umount", str(root)], check=True)
