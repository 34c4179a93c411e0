"""The LMDB store, the fingerprint check and the daemon settings, without a model."""

from __future__ import annotations

import hashlib
import os
import stat

import msgpack
import numpy as np
import pytest

from ellmd.errors import BadRequest, EllmError, InvariantError
from ellmd.runtime.errors import ProtocolError
from ellmd.runtime.residency import check_fingerprint
from ellmd.runtime.store.lmdb import CHECKSUM_BYTES, CHUNK_TOKENS, Store, StoreError, checksum, chunk_key, first_changed
from ellmd.server.config import load_settings

BYTES_PER_TOKEN = 12
FINGERPRINT = {"model": "m1", "tokenizer": "t1", "template": "c1", "kv": "bf16:2x1x3"}


def fake_kv(tokens):
    """KV bytes that depend on the token ids, so a wrong chunk shows."""
    return lambda a, b: np.repeat(np.asarray(tokens[a:b], np.int32), 3).tobytes()


def meta(session_id="s1"):
    return {"session_id": session_id, "fingerprint": FINGERPRINT, "title": "t"}


def load(store, session_id, bytes_per_token=None):
    chunks = {}
    m, tokens = store.load(session_id, lambda start, data: chunks.__setitem__(start, bytes(data)), bytes_per_token)
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
        assert txn.get(chunk_key("s1", 1), db=store.kv) is None


def test_a_damaged_chunk_is_reported_and_the_rest_kept(tmp_path):
    store = Store(tmp_path / "store")
    tokens = list(range(CHUNK_TOKENS + 4))
    store.snapshot(meta(), tokens, fake_kv(tokens), stored_tokens=0)
    store.snapshot(meta("s2"), tokens, fake_kv(tokens), stored_tokens=0)
    with store.env.begin(write=True) as txn:
        value = bytearray(txn.get(chunk_key("s1", 1), db=store.kv))
        value[-1] ^= 0xFF
        txn.put(chunk_key("s1", 1), bytes(value), db=store.kv)
    with pytest.raises(StoreError, match="chunk 1 fails its checksum"):
        load(store, "s1")
    assert load(store, "s2")[1] == tokens


def test_chunks_written_with_the_older_blake2b_checksum_still_load_and_still_catch_damage(tmp_path):
    store = Store(tmp_path / "store")
    tokens = list(range(CHUNK_TOKENS + 4))
    store.snapshot(meta(), tokens, fake_kv(tokens), stored_tokens=0)
    data = fake_kv(tokens)(CHUNK_TOKENS, len(tokens))
    with store.env.begin(write=True) as txn:
        txn.put(chunk_key("s1", 1), hashlib.blake2b(data, digest_size=CHECKSUM_BYTES).digest() + data, db=store.kv)
    assert load(store, "s1")[2] == fake_kv(tokens)(0, len(tokens))
    with store.env.begin(write=True) as txn:
        damaged = bytearray(data)
        damaged[5] ^= 0x01
        txn.put(chunk_key("s1", 1), hashlib.blake2b(data, digest_size=CHECKSUM_BYTES).digest() + damaged,
                db=store.kv)
    with pytest.raises(StoreError, match="chunk 1 fails its checksum"):
        load(store, "s1")


def test_a_load_can_stop_at_a_prefix(tmp_path):
    store = Store(tmp_path / "store")
    tokens = list(range(CHUNK_TOKENS * 3))
    store.snapshot(meta(), tokens, fake_kv(tokens), stored_tokens=0)
    starts = []
    m, loaded = store.load("s1", lambda start, data: starts.append((start, len(data))), BYTES_PER_TOKEN,
                           stop=CHUNK_TOKENS + 1)
    assert loaded == tokens and starts == [(0, CHUNK_TOKENS * BYTES_PER_TOKEN), (CHUNK_TOKENS, CHUNK_TOKENS * BYTES_PER_TOKEN)]


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
    with pytest.raises(BadRequest, match="not an exported ellm session"):  # the client's fault: bad_request
        other.import_blob(b"not a session")
    store.copy("s1", "fork", meta("fork"))
    assert load(store, "fork")[1:] == load(store, "s1")[1:]


def test_fingerprint_mismatch_names_the_part():
    check_fingerprint(FINGERPRINT, meta())
    for part in FINGERPRINT:
        stored = {**meta(), "fingerprint": {**FINGERPRINT, part: "other"}}
        with pytest.raises(ProtocolError, match=f"another {part}") as raised:
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
    config.write_text("gap_ratio = 0.25\n")
    assert load_settings(config, {}).gap_ratio == 0.25
    with pytest.raises(EllmError, match="setting gap_ratio must be positive, not 0"):
        load_settings(config, {"gap_ratio": 0})


def test_every_write_reads_back_with_one_msgpack_configuration(tmp_path):
    """An int map key once written by one configuration made session.list fail for good."""
    store = Store(tmp_path / "store")
    tokens = list(range(5))
    with pytest.raises(StoreError, match="refusing to write"):  # metadata is checked before it is written
        store.snapshot({**meta(), "tools": [{7: "x"}]}, tokens, fake_kv(tokens), 0, BYTES_PER_TOKEN)
    assert store.get_meta("s1") is None
    store.snapshot(meta("good"), tokens, fake_kv(tokens), 0, BYTES_PER_TOKEN)
    with store.env.begin(write=True) as txn:  # an entry left by an older version, or damaged
        txn.put(b"old", msgpack.packb({"session_id": "old", 7: "x"}), db=store.meta)
        txn.put(b"junk", b"\xc1\xc1", db=store.meta)
    assert [m["session_id"] for m in store.list_meta()] == ["good"]
    with pytest.raises(StoreError, match="session old is damaged"):
        store.get_meta("old")


def test_a_snapshot_never_commits_a_short_or_empty_chunk(tmp_path):
    store = Store(tmp_path / "store")
    tokens = list(range(CHUNK_TOKENS + 71))  # 327 tokens: a partial second chunk
    store.snapshot(meta(), tokens, fake_kv(tokens), 0, BYTES_PER_TOKEN)
    more = tokens + [1, 2, 3]
    for short in (lambda a, b: b"", lambda a, b: fake_kv(more)(a, b - 1)):
        with pytest.raises(StoreError, match="refused"):
            store.snapshot(meta(), more, short, len(tokens), BYTES_PER_TOKEN)
        assert load(store, "s1")[1] == tokens  # the previous snapshot is whole

    def unreadable(a, b):
        raise InvariantError("outside the slot")

    with pytest.raises(StoreError, match="cannot be read"):
        store.snapshot(meta(), more, unreadable, len(tokens), BYTES_PER_TOKEN)
    assert load(store, "s1", BYTES_PER_TOKEN)[2] == fake_kv(tokens)(0, len(tokens))


def test_an_evicted_session_snapshots_without_touching_its_kv(tmp_path):
    """The metadata of a session whose KV is all stored is rewritten without reading any KV."""
    store = Store(tmp_path / "store")
    tokens = list(range(CHUNK_TOKENS + 71))
    store.snapshot(meta(), tokens, fake_kv(tokens), 0, BYTES_PER_TOKEN)

    def no_slot(a, b):
        raise AssertionError("the KV of an evicted session was read")

    assert store.snapshot({**meta(), "title": "new"}, tokens, no_slot, len(tokens), BYTES_PER_TOKEN)["chunks_written"] == 0
    m, loaded, kv = load(store, "s1", BYTES_PER_TOKEN)
    assert m["title"] == "new" and kv == fake_kv(tokens)(0, len(tokens))
    assert first_changed(327, 327, 327) == 2 and first_changed(400, 327, 327) == 1
    assert first_changed(300, 300, 600) == 1  # rewound into chunk 1: it is rewritten shorter
    assert first_changed(512, 512, 512) == 2 and first_changed(10, 0, 0) == 0


def test_load_checks_kv_length_and_writes_nothing_of_a_damaged_session(tmp_path):
    store = Store(tmp_path / "store")
    tokens = list(range(CHUNK_TOKENS + 71))
    store.snapshot(meta(), tokens, fake_kv(tokens), 0, BYTES_PER_TOKEN)
    with store.env.begin(write=True) as txn:  # what the evicted-session bug committed: an empty chunk
        txn.put(chunk_key("s1", 1), checksum(b"") + b"", db=store.kv)
    written = []
    with pytest.raises(StoreError, match="session s1 is damaged: KV chunk 1 holds 0 tokens, not 71"):
        store.load("s1", lambda start, data: written.append(start), bytes_per_token=BYTES_PER_TOKEN)
    assert written == []  # chunk 0 was fine, but nothing was half-loaded
    with store.env.begin(write=True) as txn:
        txn.put(b"s1", np.arange(10, dtype="<i4").tobytes(), db=store.tokens)
    with pytest.raises(StoreError, match="10 token ids, metadata says 327"):
        store.load("s1", lambda start, data: written.append(start), bytes_per_token=BYTES_PER_TOKEN)


def test_a_second_process_on_the_same_store_is_refused(tmp_path):
    store = Store(tmp_path / "store")
    with pytest.raises(StoreError, match=rf"in use by another ellmd \(pid {os.getpid()}\)"):
        Store(tmp_path / "store")
    store.close()
    Store(tmp_path / "store").close()  # released with the store


def test_store_files_are_private(tmp_path):
    old = os.umask(0o022)
    try:
        store = Store(tmp_path / "store")
        tokens = list(range(10))
        store.snapshot(meta(), tokens, fake_kv(tokens), 0, BYTES_PER_TOKEN)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "store").stat().st_mode) == 0o700
    for path in (tmp_path / "store").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_import_validates_metadata_tokens_and_chunks(tmp_path):
    store = Store(tmp_path / "a")
    tokens = list(range(300))
    store.snapshot(meta(), tokens, fake_kv(tokens), 0, BYTES_PER_TOKEN)
    document = msgpack.unpackb(store.export_blob("s1"), raw=False)
    other = Store(tmp_path / "b")

    def broken(**change):
        return msgpack.packb({**document, **change}, use_bin_type=True)

    cases = [
        (broken(meta={k: v for k, v in document["meta"].items() if k != "fingerprint"}), "fingerprint"),
        (broken(meta={**document["meta"], "tokens": "300"}), "tokens"),
        (broken(meta={**document["meta"], "turns": [{"index": 0}]}), "turns"),
        (broken(tokens=document["tokens"][:-4]), "299 token ids"),
        (broken(chunks=document["chunks"][:1]), "1 chunks"),
        (broken(chunks=[document["chunks"][0], document["chunks"][1][:-BYTES_PER_TOKEN]]), "checksum"),
        (broken(format="other"), "not an exported ellm session"),
    ]
    for blob, words in cases:
        with pytest.raises(BadRequest, match=words):
            other.import_blob(blob, vocab_size=1000, bytes_per_token=BYTES_PER_TOKEN)
    with pytest.raises(BadRequest, match="outside the vocabulary"):
        other.import_blob(store.export_blob("s1"), vocab_size=100, bytes_per_token=BYTES_PER_TOKEN)
    short = document["chunks"][1][CHECKSUM_BYTES:-BYTES_PER_TOKEN]
    with pytest.raises(BadRequest, match="does not hold 44 tokens"):
        other.import_blob(broken(chunks=[document["chunks"][0], checksum(short) + short]),
                          vocab_size=1000, bytes_per_token=BYTES_PER_TOKEN)
    assert other.list_meta() == []
    assert other.import_blob(store.export_blob("s1"), vocab_size=1000, bytes_per_token=BYTES_PER_TOKEN,
                             owner="key-a")["owner"] == "key-a"
