"""The LMDB store, the fingerprint check and the daemon settings, without a model."""

from __future__ import annotations

import numpy as np
import pytest

from ellmd.errors import EllmError
from ellmd.runtime.runtime import RuntimeError_, check_fingerprint
from ellmd.runtime.store import CHUNK_TOKENS, Store, StoreError, _chunk_key
from ellmd.server.config import load_settings

BYTES_PER_TOKEN = 12
FINGERPRINT = {"model": "m1", "tokenizer": "t1", "template": "c1", "kv": "bf16:2x1x3"}


def fake_kv(tokens):
    """KV bytes that depend on the token ids, so a wrong chunk shows."""
    return lambda a, b: np.repeat(np.asarray(tokens[a:b], np.int32), 3).tobytes()


def meta(session_id="s1"):
    return {"session_id": session_id, "fingerprint": FINGERPRINT, "title": "t"}


def load(store, session_id):
    chunks = {}
    m, tokens = store.load(session_id, lambda start, data: chunks.__setitem__(start, data))
    return m, tokens, b"".join(chunks[k] for k in sorted(chunks))


def test_snapshot_writes_only_changed_chunks_and_loads_back(tmp_path):
    store = Store(tmp_path / "store")
    tokens = list(range(CHUNK_TOKENS * 2 + 10))
    first = store.snapshot(meta(), tokens, fake_kv(tokens), stored_tokens=0)
    assert first["chunks_written"] == 3 and first["bytes_written"] == len(tokens) * BYTES_PER_TOKEN
    tokens += list(range(5))
    second = store.snapshot(meta(), tokens, fake_kv(tokens), stored_tokens=first["stored_tokens"])
    assert second["chunks_written"] == 1  # only the last, partial chunk changed
    m, loaded, kv = load(store, "s1")
    assert loaded == tokens and kv == fake_kv(tokens)(0, len(tokens)) and m["tokens"] == len(tokens)
    # a rewind below the stored length rewrites from that chunk and drops the stale ones
    tokens = tokens[:10]
    third = store.snapshot(meta(), tokens, fake_kv(tokens), stored_tokens=10)
    assert third["chunks_written"] == 1
    assert load(store, "s1")[1] == tokens
    with store.env.begin() as txn:
        assert txn.get(_chunk_key("s1", 1), db=store.kv) is None


def test_a_damaged_chunk_is_reported_and_the_rest_kept(tmp_path):
    store = Store(tmp_path / "store")
    tokens = list(range(CHUNK_TOKENS + 4))
    store.snapshot(meta(), tokens, fake_kv(tokens), stored_tokens=0)
    store.snapshot(meta("s2"), tokens, fake_kv(tokens), stored_tokens=0)
    with store.env.begin(write=True) as txn:
        value = bytearray(txn.get(_chunk_key("s1", 1), db=store.kv))
        value[-1] ^= 0xFF
        txn.put(_chunk_key("s1", 1), bytes(value), db=store.kv)
    with pytest.raises(StoreError, match="chunk 1 fails its checksum"):
        load(store, "s1")
    assert load(store, "s2")[1] == tokens


def test_a_full_store_loses_nothing_committed(tmp_path):
    store = Store(tmp_path / "store", map_size=1 << 20)
    small = list(range(100))
    store.snapshot(meta(), small, fake_kv(small), stored_tokens=0)
    big = list(range(200_000))
    with pytest.raises(StoreError, match="full"):
        store.snapshot(meta("big"), big, fake_kv(big), stored_tokens=0)
    assert load(store, "s1")[1] == small
    assert store.get_meta("big") is None


def test_export_import_and_fork(tmp_path):
    store = Store(tmp_path / "a")
    tokens = list(range(300))
    store.snapshot(meta(), tokens, fake_kv(tokens), stored_tokens=0)
    blob = store.export_blob("s1")
    other = Store(tmp_path / "b")
    assert other.import_blob(blob)["session_id"] == "s1"
    assert load(other, "s1")[1:] == load(store, "s1")[1:]
    assert other.import_blob(blob)["session_id"] != "s1"  # the id is taken: a new one
    with pytest.raises(StoreError):
        other.import_blob(b"not a session")
    store.copy("s1", "fork", meta("fork"))
    assert load(store, "fork")[1:] == load(store, "s1")[1:]


def test_fingerprint_mismatch_names_the_part():
    check_fingerprint(FINGERPRINT, meta())
    for part in FINGERPRINT:
        stored = {**meta(), "fingerprint": {**FINGERPRINT, part: "other"}}
        with pytest.raises(RuntimeError_, match=f"another {part}") as raised:
            check_fingerprint(FINGERPRINT, stored)
        assert raised.value.code == "fingerprint"


def test_settings_precedence(tmp_path, monkeypatch):
    config = tmp_path / "ellmd.toml"
    config.write_text('batch_size = 3\nsequence_length = 1024\nkv_dtype = "f16"\n')
    monkeypatch.setenv("ELLMD_SEQUENCE_LENGTH", "4096")
    settings = load_settings(config, {"batch_size": 5, "kv_dtype": None})
    assert settings.batch_size == 5  # the flag beats the file
    assert settings.kv_dtype == "f16"  # the file beats the default
    assert settings.sequence_length == 4096  # the environment beats both
    config.write_text("bacth_size = 3\n")
    with pytest.raises(EllmError, match="unknown key 'bacth_size'"):
        load_settings(config, {})
    config.write_text('batch_size = "four"\n')
    with pytest.raises(EllmError, match="batch_size"):
        load_settings(config, {})
