"""The store under the real daemon: eviction, one daemon per store, private files."""

from __future__ import annotations

import stat

import msgpack
import pytest

from ellmd.runtime.store.lmdb import CHECKSUM_BYTES

from daemon import Daemon


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("one-slot"), slots=1).start()
    yield d
    assert d.stop() == 0


def exported(client, session_id) -> dict:
    blob = bytearray()
    for event in client.stream("session.export", session_id=session_id):
        blob += event["data"]
    return msgpack.unpackb(bytes(blob), raw=False)


def first_logprobs(session):
    return session.generate(max_tokens=1, logprobs=5).logprobs[0]


def test_an_evicted_session_snapshots_whole(one_slot):
    """With one slot, a session evicted with a partial last chunk (327 tokens: 256 + 71) and then
    snapshotted again used to get an empty second chunk with a valid checksum."""
    with one_slot.client() as client:
        per_token = client.stats()["kv_bytes_per_token"]
        prompt = [(7 * i) % 40000 + 100 for i in range(327)]
        a = client.open_session()
        a.append(tokens=prompt)
        b = client.open_session()
        b.append(tokens=list(range(1000, 1400)))  # evicts a (b must outgrow it, as in the report)
        assert not a.info()["resident"]
        a.snapshot()  # a is not resident: only its metadata may be written
        document = exported(client, a.id)
        kv = sum(len(chunk) - CHECKSUM_BYTES for chunk in document["chunks"])
        assert kv == 327 * per_token
        resumed = first_logprobs(a)
        recomputed = client.open_session()
        recomputed.append(tokens=prompt)
        assert first_logprobs(recomputed) == resumed  # bit-identical: the KV came back whole


def test_a_second_daemon_on_the_same_store_is_refused(one_slot, tmp_path):
    second = Daemon(tmp_path, slots=1)
    second.store = one_slot.store
    second.args[second.args.index("--store") + 1] = str(one_slot.store)
    with pytest.raises(RuntimeError, match="daemon exited"):
        second.start()
    log = second.log.read_text()
    assert f"the store at {one_slot.store} is in use by another ellmd (pid {one_slot.process.pid})" in log
    # refused before the model loads: none of the engine's start-up phases (the first daemon's log has them) began
    assert "loading weights" in one_slot.log.read_text()
    assert not any(phase in log for phase in ("loading weights", "committing KV", "compiling kernels"))
    with one_slot.client() as client:  # the first one never noticed
        assert client.stats()["slots"] == 1


def test_store_files_are_private(one_slot):
    assert stat.S_IMODE(one_slot.store.stat().st_mode) == 0o700
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in one_slot.store.iterdir()}
    assert set(modes) >= {"data.mdb", "lock.mdb", "ellmd.lock"} and set(modes.values()) == {0o600}
