"""The session store: one LMDB environment holding metadata, token ids and KV chunks.

Databases:
  meta    session id -> msgpack map (title, tags, times, turns, fingerprint, token count, ...)
  tokens  session id -> int32 token ids, little-endian
  kv      session id + chunk index (u32 big-endian) -> 8-byte blake2b checksum + KV bytes of
          CHUNK_TOKENS tokens (the last chunk may be shorter), as KVCache.export lays them out

KV is append-only, so a snapshot writes only the chunks from the first one that changed since the
last snapshot, in one write transaction with the metadata: a crash leaves the previous snapshot whole.
"""

from __future__ import annotations

import hashlib
import struct
import uuid
from pathlib import Path

import lmdb
import msgpack
import numpy as np

from ellmd.errors import EllmError

CHUNK_TOKENS = 256
CHECKSUM_BYTES = 8


class StoreError(EllmError):
    """The store is full, damaged or unreadable; what was committed before stays intact."""


def _checksum(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=CHECKSUM_BYTES).digest()


def _chunk_key(session_id: str, index: int) -> bytes:
    return session_id.encode() + b"/" + struct.pack(">I", index)


class Store:
    """Sessions on disk. Thread-safe for one writer (the engine thread) and many readers."""

    def __init__(self, path: Path, map_size: int = 1 << 40):
        path = Path(path)
        try:
            path.mkdir(parents=True, exist_ok=True)
            self.env = lmdb.open(str(path), map_size=map_size, max_dbs=4, subdir=True)
        except (lmdb.Error, OSError) as e:
            raise StoreError(f"cannot open the store at {path}: {e}") from None
        self.path = path
        self.meta = self.env.open_db(b"meta")
        self.tokens = self.env.open_db(b"tokens")
        self.kv = self.env.open_db(b"kv")

    def close(self) -> None:
        self.env.close()

    # ---- writes -----------------------------------------------------------------------------

    def snapshot(self, meta: dict, tokens, export, stored_tokens: int) -> dict:
        """Write a session: metadata, all token ids, and the KV chunks changed since the last snapshot.

        export(start, stop) -> KV bytes of tokens [start, stop); stored_tokens: how many tokens' KV
        on disk is still valid (tokens before it need not be written again).
        Returns {chunks_written, bytes_written, stored_tokens}.
        """
        session_id = meta["session_id"]
        count = len(tokens)
        first = min(stored_tokens, count) // CHUNK_TOKENS
        last = (count + CHUNK_TOKENS - 1) // CHUNK_TOKENS
        written = 0
        try:
            with self.env.begin(write=True) as txn:
                old = txn.get(session_id.encode(), db=self.meta)
                old_chunks = msgpack.unpackb(old)["chunks"] if old else 0
                for index in range(first, last):
                    data = export(index * CHUNK_TOKENS, min(count, (index + 1) * CHUNK_TOKENS))
                    txn.put(_chunk_key(session_id, index), _checksum(data) + data, db=self.kv)
                    written += len(data)
                for index in range(last, old_chunks):  # the session was rewound: drop stale chunks
                    txn.delete(_chunk_key(session_id, index), db=self.kv)
                txn.put(session_id.encode(), np.asarray(tokens, "<i4").tobytes(), db=self.tokens)
                txn.put(session_id.encode(), msgpack.packb({**meta, "tokens": count, "chunks": last}), db=self.meta)
        except lmdb.MapFullError:
            raise StoreError("the store is full: raise store_map_size or delete sessions (nothing was lost)") from None
        except lmdb.Error as e:
            raise StoreError(f"snapshot of {session_id} failed: {e} (the previous snapshot is intact)") from None
        return {"chunks_written": last - first, "bytes_written": written, "stored_tokens": count}

    def copy(self, source_id: str, target_id: str, target_meta: dict) -> None:
        """Fork a stored session: its token ids and KV chunks under a new id and metadata."""
        try:
            with self.env.begin(write=True) as txn:
                raw = txn.get(source_id.encode(), db=self.meta)
                if raw is None:
                    raise StoreError(f"session {source_id} is not in the store")
                source = msgpack.unpackb(raw)
                for index in range(source["chunks"]):
                    txn.put(_chunk_key(target_id, index), txn.get(_chunk_key(source_id, index), db=self.kv), db=self.kv)
                txn.put(target_id.encode(), txn.get(source_id.encode(), db=self.tokens), db=self.tokens)
                meta = {**target_meta, "tokens": source["tokens"], "chunks": source["chunks"]}
                txn.put(target_id.encode(), msgpack.packb(meta), db=self.meta)
        except lmdb.MapFullError:
            raise StoreError("the store is full: raise store_map_size or delete sessions (nothing was lost)") from None

    def delete(self, session_id: str) -> bool:
        try:
            with self.env.begin(write=True) as txn:
                raw = txn.get(session_id.encode(), db=self.meta)
                if raw is None:
                    return False
                for index in range(msgpack.unpackb(raw)["chunks"]):
                    txn.delete(_chunk_key(session_id, index), db=self.kv)
                txn.delete(session_id.encode(), db=self.tokens)
                txn.delete(session_id.encode(), db=self.meta)
        except lmdb.Error as e:
            raise StoreError(f"delete of {session_id} failed: {e}") from None
        return True

    # ---- reads ------------------------------------------------------------------------------

    def get_meta(self, session_id: str) -> dict | None:
        with self.env.begin() as txn:
            raw = txn.get(session_id.encode(), db=self.meta)
        return None if raw is None else msgpack.unpackb(raw)

    def count(self) -> int:
        """Sessions in the store, without reading them (the metrics scrape this)."""
        with self.env.begin() as txn:
            return txn.stat(self.meta)["entries"]

    def list_meta(self) -> list[dict]:
        with self.env.begin() as txn:
            return [msgpack.unpackb(value) for _, value in txn.cursor(db=self.meta)]

    def load(self, session_id: str, write_chunk) -> tuple[dict, list[int]]:
        """Read a session back: write_chunk(start, data) receives each verified KV chunk in order.

        Returns (meta, token ids). A chunk whose checksum does not match raises StoreError.
        """
        with self.env.begin(buffers=True) as txn:
            raw = txn.get(session_id.encode(), db=self.meta)
            if raw is None:
                raise StoreError(f"session {session_id} is not in the store")
            meta = msgpack.unpackb(bytes(raw))
            tokens = np.frombuffer(bytes(txn.get(session_id.encode(), db=self.tokens)), "<i4").tolist()
            for index in range(meta["chunks"]):
                value = txn.get(_chunk_key(session_id, index), db=self.kv)
                if value is None:
                    raise StoreError(f"session {session_id} is damaged: KV chunk {index} is missing")
                value = bytes(value)
                checksum, data = value[:CHECKSUM_BYTES], value[CHECKSUM_BYTES:]
                if _checksum(data) != checksum:
                    raise StoreError(f"session {session_id} is damaged: KV chunk {index} fails its checksum")
                write_chunk(index * CHUNK_TOKENS, data)
        return meta, tokens

    def export_blob(self, session_id: str) -> bytes:
        """A self-contained copy of a stored session (metadata, tokens, checksummed KV chunks)."""
        with self.env.begin() as txn:
            raw = txn.get(session_id.encode(), db=self.meta)
            if raw is None:
                raise StoreError(f"session {session_id} is not in the store")
            meta = msgpack.unpackb(raw)
            chunks = [txn.get(_chunk_key(session_id, i), db=self.kv) for i in range(meta["chunks"])]
            tokens = txn.get(session_id.encode(), db=self.tokens)
        return msgpack.packb({"format": "ellm-session", "version": 1, "meta": meta, "tokens": tokens, "chunks": chunks})

    def import_blob(self, blob: bytes, check=None) -> dict:
        """Store a session exported by export_blob, after checking every chunk (and check(meta),
        which may raise); returns its metadata."""
        try:
            document = msgpack.unpackb(blob)
            if document.get("format") != "ellm-session" or document.get("version") != 1:
                raise ValueError("unknown format or version")
            meta, tokens, chunks = document["meta"], document["tokens"], document["chunks"]
        except Exception as e:  # any malformed file is reported the same way
            raise StoreError(f"not an exported ellm session ({e})") from None
        for index, value in enumerate(chunks):
            if _checksum(value[CHECKSUM_BYTES:]) != value[:CHECKSUM_BYTES]:
                raise StoreError(f"the exported session is damaged: KV chunk {index} fails its checksum")
        if check is not None:
            check(meta)
        try:
            with self.env.begin(write=True) as txn:
                if txn.get(meta["session_id"].encode(), db=self.meta) is not None:  # keep the id if it is free
                    meta = {**meta, "session_id": uuid.uuid4().hex[:12]}
                session_id = meta["session_id"]
                for index, value in enumerate(chunks):
                    txn.put(_chunk_key(session_id, index), value, db=self.kv)
                txn.put(session_id.encode(), tokens, db=self.tokens)
                txn.put(session_id.encode(), msgpack.packb(meta), db=self.meta)
        except lmdb.MapFullError:
            raise StoreError("the store is full: raise store_map_size or delete sessions (nothing was lost)") from None
        return meta

    def stats(self) -> dict:
        info, stat = self.env.info(), self.env.stat()
        return {"path": str(self.path), "map_size": info["map_size"],
                "bytes_used": (info["last_pgno"] + 1) * stat["psize"]}
