"""The LMDB backend of the session store (the default; the interface is base.SessionStore).

One LMDB environment, databases:
  meta    session id -> msgpack map (title, tags, times, turns, fingerprint, token count, ...)
  tokens  session id -> int32 token ids, little-endian
  kv      session id + chunk index (u32 big-endian) -> 8-byte checksum + KV bytes of
          CHUNK_TOKENS tokens (the last chunk may be shorter), as KVCache.export lays them out
  notes   session id + "/" + note_key(point name) -> msgpack map (session.point's note, written once)
and, for fleet replicas only, a second environment in leases/ (session id -> msgpack lease record,
leases.py), committed without fsync: a lease is about live processes, so it need not outlive a
crash of its node, and taking one then costs no disk flush on the engine thread.

KV is append-only, so a snapshot writes only the chunks from the first one that changed since the
last snapshot, in one write transaction with the metadata: a crash leaves the previous snapshot whole.
LMDB is safe for several processes on a local filesystem: fleet replicas on one node share an
environment, each write transaction (a snapshot, a lease's read-modify-write) serialized across them.
Without a replica, one process at a time holds the store (a lock file beside the data); its files
are the user's alone (0600, directory 0700).
"""

from __future__ import annotations

import concurrent.futures
import os
import struct
import uuid
from pathlib import Path

import lmdb
import numpy as np

from ellmd.runtime.store import crash_points
from ellmd.runtime.store.leases import Holder, Lease
from ellmd.runtime.store.base import (CHECKSUM_BYTES, CHUNK_TOKENS, DROP, KEEP, SessionStore, StoreError, checksum,
 check_chunk, checked_record, chunk_count, chunk_tokens,
                                      deliver_chunks, disk_full, exported_chunk, first_changed, full, loaded_tokens,
                                      lock, note_key, pack, parse_meta, private_dir, snapshot_bytes, unpack)

LEASES_MAP_SIZE = 1 << 30


def chunk_key(session_id: str, index: int) -> bytes:
    return session_id.encode() + b"/" + struct.pack(">I", index)


class Store(SessionStore):
    """Sessions in one LMDB environment. Thread-safe for one writer (the writer thread) and many readers."""

    def __init__(self, path: Path, map_size: int = 1 << 40, holder: Holder | None = None):
        path = Path(path)
        self._lock = None
        try:
            private_dir(path)
            self._lock = lock(path / "ellmd.lock", shared=holder is not None)
            self.env = lmdb.open(str(path), map_size=map_size, max_dbs=4, subdir=True, mode=0o600)
            self.lease_env = None
            if holder is not None:
                private_dir(path / "leases")
                self.lease_env = lmdb.open(str(path / "leases"), map_size=LEASES_MAP_SIZE, subdir=True, mode=0o600,
                                           sync=False)
            for name in ("data.mdb", "lock.mdb"):  # stores made before files were private
                if (path / name).exists():
                    os.chmod(path / name, 0o600)
        except (lmdb.Error, OSError) as e:
            if self._lock is not None:
                os.close(self._lock)
            raise StoreError(f"cannot open the store at {path}: {e}") from None
        self.path = path
        self.holder = holder
        self.meta = self.env.open_db(b"meta")
        self.tokens = self.env.open_db(b"tokens")
        self.kv = self.env.open_db(b"kv")
        self.notes = self.env.open_db(b"notes")
        self._scratch = bytearray()  # one chunk's value as it is written (see _value)
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="store-checksum")

    def close(self) -> None:
        self._hasher.shutdown()
        self.env.close()
        if self.lease_env is not None:
            self.lease_env.close()
        os.close(self._lock)

    # ---- writes -----------------------------------------------------------------------------

    def snapshot(self, meta: dict, tokens, export, stored_tokens: int, bytes_per_token: int | None = None) -> dict:
        session_id = meta["session_id"]
        count = len(tokens)
        last = chunk_count(count)
        written = needed = 0
        try:
            with self.env.begin(write=True) as txn:
                self.fence(session_id)
                old = txn.get(session_id.encode(), db=self.meta)
                old = unpack(old) if old else {"tokens": 0, "chunks": 0}
                record = checked_record({**meta, "tokens": count, "chunks": last})
                first = first_changed(count, stored_tokens, old["tokens"])
                needed = snapshot_bytes(count, first, bytes_per_token)
                for index in range(first, last):
                    start = index * CHUNK_TOKENS
                    data = exported_chunk(session_id, export, start, start + chunk_tokens(count, index), bytes_per_token)
                    txn.put(chunk_key(session_id, index), self._value(data), db=self.kv)
                    written += len(data)
                for index in range(last, old["chunks"]):  # the session was rewound: drop stale chunks
                    txn.delete(chunk_key(session_id, index), db=self.kv)
                txn.put(session_id.encode(), np.asarray(tokens, "<i4").tobytes(), db=self.tokens)
                txn.put(session_id.encode(), pack(record), db=self.meta)
                crash_points.before_commit("snapshot")
        except lmdb.Error as e:
            raise self._failed(f"snapshot of session {session_id}", e, max(needed, written)) from None
        return {"chunks_written": last - first, "bytes_written": written, "stored_tokens": count}

    def _value(self, data) -> memoryview:
        """checksum + data, in a buffer reused from chunk to chunk (LMDB copies it on put). The
        copy is numpy's, which releases the GIL: the writer thread copies while the engine thread
        runs its decode step's Python."""
        size = CHECKSUM_BYTES + len(data)
        if len(self._scratch) < size:
            self._scratch = bytearray(size)
        value = memoryview(self._scratch)[:size]
        np.frombuffer(value, np.uint8)[CHECKSUM_BYTES:] = np.frombuffer(data, np.uint8)
        value[:CHECKSUM_BYTES] = checksum(data)
        return value

    def _failed(self, action: str, error: lmdb.Error, needed: int) -> StoreError:
        """The error of a write transaction that failed (and left the store as it was): "the store is
        full" when its map or its filesystem is, with the space the write needed."""
        if isinstance(error, lmdb.MapFullError):
            stats = self.stats()
            return full(action, needed, stats["map_size"] - stats["bytes_used"], "the map (store_map_size_gb)",
                        "raise store_map_size_gb or delete sessions")
        return disk_full(action, self.path, needed, error) or \
            StoreError(f"{action} failed: {error} (the previous snapshot is intact)")

    def copy(self, source_id: str, target_id: str, target_meta: dict) -> None:
        needed = 0
        try:
            with self.env.begin(write=True) as txn:
                self.fence(target_id)
                raw = txn.get(source_id.encode(), db=self.meta)
                if raw is None:
                    raise StoreError(f"session {source_id} is not in the store")
                source = unpack(raw)
                record = checked_record({**target_meta, "tokens": source["tokens"], "chunks": source["chunks"]})
                for index in range(source["chunks"]):
                    value = txn.get(chunk_key(source_id, index), db=self.kv)
                    needed += len(value)
                    txn.put(chunk_key(target_id, index), value, db=self.kv)
                txn.put(target_id.encode(), txn.get(source_id.encode(), db=self.tokens), db=self.tokens)
                txn.put(target_id.encode(), pack(record), db=self.meta)
                crash_points.before_commit("copy")
        except lmdb.Error as e:
            raise self._failed(f"fork of session {source_id} into {target_id}", e, needed) from None

    def delete(self, session_id: str) -> bool:
        try:
            with self.env.begin(write=True) as txn:
                self.fence(session_id)
                raw = txn.get(session_id.encode(), db=self.meta)
                if raw is None:
                    return False
                for index in range(unpack(raw)["chunks"]):
                    txn.delete(chunk_key(session_id, index), db=self.kv)
                txn.delete(session_id.encode(), db=self.tokens)
                txn.delete(session_id.encode(), db=self.meta)
                prefix, cursor = session_id.encode() + b"/", txn.cursor(db=self.notes)
                while cursor.set_range(prefix) and cursor.key().startswith(prefix):
                    cursor.delete()
                crash_points.before_commit("delete")
        except lmdb.Error as e:
            raise self._failed(f"delete of session {session_id}", e, 0) from None
        return True

    def put_note(self, session_id: str, name: str, note: dict | None) -> None:
        key = f"{session_id}/{note_key(name)}".encode()
        try:
            with self.env.begin(write=True) as txn:
                self.fence(session_id)
                if note is None:
                    txn.delete(key, db=self.notes)
                else:
                    txn.put(key, pack(note), db=self.notes)
        except lmdb.Error as e:
            raise self._failed(f"the note of session {session_id}'s point {name!r}", e,
                               0 if note is None else len(pack(note))) from None

    def get_note(self, session_id: str, name: str) -> dict | None:
        with self.env.begin() as txn:
            raw = txn.get(f"{session_id}/{note_key(name)}".encode(), db=self.notes)
        return None if raw is None else unpack(raw)

    def _write_imported(self, meta: dict, tokens: bytes, chunks: list[bytes]) -> dict:
        try:
            with self.env.begin(write=True) as txn:
                if txn.get(meta["session_id"].encode(), db=self.meta) is not None:  # keep the id if it is free
                    meta = {**meta, "session_id": uuid.uuid4().hex[:12]}
                session_id = meta["session_id"]
                self.fence(session_id)
                for index, value in enumerate(chunks):
                    txn.put(chunk_key(session_id, index), value, db=self.kv)
                txn.put(session_id.encode(), tokens, db=self.tokens)
                txn.put(session_id.encode(), pack(meta), db=self.meta)
                crash_points.before_commit("import")
        except lmdb.Error as e:
            raise self._failed(f"import of session {meta['session_id']}", e, sum(map(len, chunks))) from None
        return meta

    # ---- reads ------------------------------------------------------------------------------

    def get_meta(self, session_id: str) -> dict | None:
        with self.env.begin() as txn:
            raw = txn.get(session_id.encode(), db=self.meta)
        return None if raw is None else parse_meta(session_id, raw)

    def count(self) -> int:
        with self.env.begin() as txn:
            return txn.stat(self.meta)["entries"]

    def raw_metas(self) -> list[tuple[str, bytes]]:
        with self.env.begin() as txn:
            return [(bytes(key).decode(errors="replace"), value) for key, value in txn.cursor(db=self.meta)]

    def version(self) -> int:
        """The last committed transaction's id (the environment's, shared by every process using it)."""
        return self.env.info()["last_txnid"]

    def load(self, session_id: str, write_chunk, bytes_per_token: int | None = None,
             stop: int | None = None) -> tuple[dict, list[int]]:
        """See SessionStore.load; the chunks are views of LMDB's memory (no copy)."""
        with self.env.begin(buffers=True) as txn:
            raw = txn.get(session_id.encode(), db=self.meta)
            if raw is None:
                raise StoreError(f"session {session_id} is not in the store")
            meta = parse_meta(session_id, bytes(raw))
            tokens = loaded_tokens(session_id, meta, txn.get(session_id.encode(), db=self.tokens))
            chunks = []
            for index in range(chunk_count(len(tokens) if stop is None else min(stop, len(tokens)))):
                value = txn.get(chunk_key(session_id, index), db=self.kv)
                check_chunk(session_id, index, value, len(tokens), bytes_per_token)
                chunks.append(value)
            deliver_chunks(session_id, chunks, write_chunk, self._hasher)
        return meta, tokens

    def _raw(self, session_id: str) -> tuple[dict, bytes, list[bytes]]:
        with self.env.begin() as txn:
            raw = txn.get(session_id.encode(), db=self.meta)
            if raw is None:
                raise StoreError(f"session {session_id} is not in the store")
            meta = unpack(raw)
            chunks = [txn.get(chunk_key(session_id, i), db=self.kv) for i in range(meta["chunks"])]
            return meta, txn.get(session_id.encode(), db=self.tokens), chunks

    def stats(self) -> dict:
        info, stat = self.env.info(), self.env.stat()
        return {"path": str(self.path), "backend": "lmdb", "map_size": info["map_size"],
                "bytes_used": (info["last_pgno"] + 1) * stat["psize"]}

    # ---- leases -----------------------------------------------------------------------------

    def get_lease(self, session_id: str) -> Lease | None:
        if self.lease_env is None:
            return None
        with self.lease_env.begin() as txn:
            raw = txn.get(session_id.encode())
        return None if raw is None else Lease.from_record(unpack(raw))

    def _update_leases(self, session_ids: list[str], decide) -> dict:
        """One write transaction: serialized with every other process' on this environment."""
        if self.lease_env is None:
            raise StoreError("this store is not shared: leases are for fleet replicas (--replica)")
        results = {}
        try:
            with self.lease_env.begin(write=True) as txn:
                for session_id in session_ids:
                    key = session_id.encode()
                    raw = txn.get(key)
                    new, results[session_id] = decide(None if raw is None else Lease.from_record(unpack(raw)))
                    if new == DROP:
                        txn.delete(key)
                    elif new != KEEP:
                        txn.put(key, pack(new.to_record()))
        except lmdb.Error as e:
            raise StoreError(f"updating leases failed: {e}") from None
        return results
