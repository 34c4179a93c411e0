"""A q8_0 KV cache (and q8_0 keys with q4_0 values) under the real daemon: snapshots, resume and fork
move the blocks as they are (the same continuation as a session never evicted), and a daemon of
another KV format refuses them."""

from __future__ import annotations

import pytest
from ellm.errors import EllmError

from daemon import Daemon

PROMPT = [(7 * i) % 40000 + 100 for i in range(300)]


def greedy(session, n=8):
    return session.generate(max_tokens=n, temperature=0).token_ids


def assert_capacity(stats):
    """The budget per KV format: tokens per GiB, sessions of the configured length in this KV memory
    and on the store's disk."""
    formats = stats["kv_capacity"]
    assert {name: c["bytes_per_token"] for name, c in formats.items()} == {"bf16": 23_040, "q8_0": 11_880,
                                                                           "q8_0/q4_0": 9_180, "q4_0": 6_480}
    memory = stats["kv_bytes_used"] + stats["kv_bytes_free"]
    for c in formats.values():
        session = c["bytes_per_token"] * stats["sequence_length"]
        assert c["tokens_per_gib"] == 2**30 // c["bytes_per_token"]
        assert c["sessions_in_memory"] == memory // session
        assert c["sessions_on_disk"] > 0
    assert formats["q4_0"]["sessions_in_memory"] >= 3 * formats["bf16"]["sessions_in_memory"]


def test_q8_0_sessions_move_as_held_and_another_format_refuses_them(tmp_path):
    daemon = Daemon(tmp_path, slots=1, extra=("--kv-dtype", "q8_0")).start()
    try:
        with daemon.client() as client:
            stats = client.stats()
            assert stats["kv_bytes_per_token"] == 23_040 * 66 // 128  # SmolLM2-135M: 11,880
            assert stats["kv_dtype"] == "q8_0"
            assert_capacity(stats)
            never_evicted = client.open_session()
            never_evicted.append(tokens=PROMPT)
            want = greedy(never_evicted)
            a = client.open_session()
            a.append(tokens=PROMPT)  # evicts never_evicted: one slot
            fork = a.fork()
            b = client.open_session()
            b.append(tokens=list(range(1000, 1400)))  # evicts a: its q8_0 blocks go to the store
            assert not a.info()["resident"]
            assert greedy(a) == want  # resumed from its snapshot: no forward pass over the prompt
            assert greedy(fork) == want
            stored_id = a.id
    finally:
        assert daemon.stop() == 0
    bf16 = Daemon(tmp_path, slots=1).start()
    try:
        with bf16.client() as client:
            with pytest.raises(EllmError, match=r"another kv \(q8_0:30x3x64 != bf16:30x3x64\)"):
                client.session(stored_id).resume()
            assert client.stats()["kv_bytes_per_token"] == 23_040  # and it keeps serving
    finally:
        assert bf16.stop() == 0


def test_keys_and_values_in_two_formats_move_as_held(tmp_path):
    """q8_0 keys, q4_0 values: 9,180 bytes a token; an evicted session resumes to the same
    continuation, and a q8_0 daemon refuses it, naming both formats."""
    daemon = Daemon(tmp_path, slots=1, extra=("--kv-dtype", "q8_0/q4_0")).start()
    try:
        with daemon.client() as client:
            stats = client.stats()
            assert (stats["kv_dtype"], stats["kv_bytes_per_token"]) == ("q8_0/q4_0", 9_180)
            never_evicted = client.open_session()
            never_evicted.append(tokens=PROMPT)
            want = greedy(never_evicted)
            a = client.open_session()
            a.append(tokens=PROMPT)  # evicts never_evicted
            client.open_session().append(tokens=list(range(1000, 1100)))  # evicts a
            assert not a.info()["resident"]
            assert greedy(a) == want
            stored_id = a.id
    finally:
        assert daemon.stop() == 0
    q8_0 = Daemon(tmp_path, slots=1, extra=("--kv-dtype", "q8_0")).start()
    try:
        with q8_0.client() as client:
            with pytest.raises(EllmError, match=r"another kv \(q8_0/q4_0:30x3x64 != q8_0:30x3x64\)"):
                client.session(stored_id).resume()
    finally:
        assert q8_0.stop() == 0


def test_q4_0_keys_centred_alike_at_every_start_and_another_key_mean_is_refused(tmp_path):
    """q4_0 keys are stored less a mean key calibrated at start, named in the fingerprint: a
    restarted daemon takes the same one (cached at the first start) and resumes a stored session to
    the same continuation;
    a session stored under another mean key is refused, naming both."""
    import re

    from ellmd.runtime.store import open_store

    daemon = Daemon(tmp_path, slots=1, extra=("--kv-dtype", "q4_0")).start()
    try:
        with daemon.client() as client:
            never_evicted = client.open_session()
            never_evicted.append(tokens=PROMPT)
            want = greedy(never_evicted)
            a = client.open_session()
            a.append(tokens=PROMPT)  # evicts never_evicted: one slot
            kv = a.info()["fingerprint"]["kv"]
            assert re.fullmatch(r"q4_0:30x3x64:m[0-9a-f]{8}", kv), kv
    finally:
        assert daemon.stop() == 0  # snapshots a
    store = open_store("lmdb", tmp_path / "store")
    meta = store.get_meta(a.id)
    other = "0123456789ab"  # a copy of a made under another mean key
    store.copy(a.id, other, {**meta, "session_id": other, "fingerprint": {**meta["fingerprint"],
                                                                          "kv": "q4_0:30x3x64:m00000000"}})
    store.close()
    again = Daemon(tmp_path, slots=1, extra=("--kv-dtype", "q4_0")).start()
    try:
        with again.client() as client:
            assert greedy(client.session(a.id)) == want  # the same mean key: resumed, no forward pass
            with pytest.raises(EllmError, match=re.escape(f"another kv (q4_0:30x3x64:m00000000 != {kv})")):
                client.session(other).resume()
            assert client.stats()["kv_dtype"] == "q4_0"  # and it keeps serving
    finally:
        assert again.stop() == 0
