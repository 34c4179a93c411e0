"""The session store: one LMDB environment holding metadata, token ids and KV chunks.

Databases:
  meta    session id -> msgpack map (title, tags, times, turns, fingerprint, token count, ...)
  tokens  session id -> int32 token ids, little-endian
  kv      session id + chunk index (u32 big-endian) -> 8-byte checksum + KV bytes of
          CHUNK_TOKENS tokens (the last chunk may be shorter), as KVCache.export lays them out.
          The checksum is XXH3-64 (~10 GB/s here: a resume runs at memory speed); chunks
          written before it carry blake2b-64, which is still accepted.

KV is append-only, so a snapshot writes only the chunks from the first one that changed since the
last snapshot, in one write transaction with the metadata: a crash leaves the previous snapshot whole.
Every write is checked first (metadata against schemas.StoredMeta, each chunk's length against its
token count), and so is every read, so that neither a client nor a crash can leave a session that
loads into a slot half right. One process at a time holds the store (a lock file beside the data);
its files are the user's alone (0600, directory 0700).
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import logging
import os
import signal
import struct
import time
import uuid
from pathlib import Path

import lmdb
import msgpack
import numpy as np
import xxhash

from ellmd.errors import BadRequest, EllmError
from ellmd.runtime.schemas import check_meta

log = logging.getLogger("ellmd.store")

CHUNK_TOKENS = 256
CHECKSUM_BYTES = 8
FULL = "the store is full: raise store_map_size or delete sessions (nothing was lost)"
# Crash tests only (tests/test_crash.py, see _test_sleep): seconds slept inside each write
# transaction before it commits, so that a SIGKILL lands inside one; and a file whose presence
# makes the next write transaction SIGKILL the process before it commits. Unset in normal use.
TXN_SLEEP = float(os.environ.get("ELLMD_TEST_TXN_SLEEP", "0") or 0)
TXN_KILL = os.environ.get("ELLMD_TEST_TXN_KILL")


class StoreError(EllmError):
    """The store is full, damaged or unreadable; what was committed before stays intact."""

    code = "store"


def pack(value) -> bytes:
    """The one msgpack configuration the store writes with (unpack reads it back)."""
    return msgpack.packb(value, use_bin_type=True)


def unpack(data) -> object:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _checksum(data) -> bytes:
    return xxhash.xxh3_64_digest(data)


def _checksum_ok(value) -> bool:
    """Does a stored chunk (checksum + data, any buffer) match its checksum?"""
    checksum, data = value[:CHECKSUM_BYTES], value[CHECKSUM_BYTES:]
    if _checksum(data) == checksum:
        return True
    return hashlib.blake2b(data, digest_size=CHECKSUM_BYTES).digest() == checksum  # written by an older ellmd


def _chunk_key(session_id: str, index: int) -> bytes:
    return session_id.encode() + b"/" + struct.pack(">I", index)


def chunk_count(tokens: int) -> int:
    return (tokens + CHUNK_TOKENS - 1) // CHUNK_TOKENS


def chunk_tokens(tokens: int, index: int) -> int:
    """Tokens held by chunk `index` of a session of `tokens` tokens."""
    return min(tokens, (index + 1) * CHUNK_TOKENS) - index * CHUNK_TOKENS


class Store:
    """Sessions on disk. Thread-safe for one writer (the engine thread) and many readers."""

    def __init__(self, path: Path, map_size: int = 1 << 40):
        path = Path(path)
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(path, 0o700)
            self._lock = lock(path / "ellmd.lock")
            self.env = lmdb.open(str(path), map_size=map_size, max_dbs=4, subdir=True, mode=0o600)
            for name in ("data.mdb", "lock.mdb"):  # stores made before files were private
                if (path / name).exists():
                    os.chmod(path / name, 0o600)
        except (lmdb.Error, OSError) as e:
            raise StoreError(f"cannot open the store at {path}: {e}") from None
        self.path = path
        self.meta = self.env.open_db(b"meta")
        self.tokens = self.env.open_db(b"tokens")
        self.kv = self.env.open_db(b"kv")
        self._scratch = bytearray()  # one chunk's value as it is written (see _value)
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="store-checksum")

    def close(self) -> None:
        self._hasher.shutdown()
        self.env.close()
        os.close(self._lock)

    # ---- writes -----------------------------------------------------------------------------

    def snapshot(self, meta: dict, tokens, export, stored_tokens: int, bytes_per_token: int | None = None) -> dict:
        """Write a session: metadata, all token ids, and the KV chunks changed since the last snapshot.

        export(start, stop) -> KV bytes of tokens [start, stop); stored_tokens: how many tokens' KV
        on disk is still valid (tokens before it need not be written again). A chunk whose length
        is not its tokens' (bytes_per_token each) is refused: nothing is written.
        Returns {chunks_written, bytes_written, stored_tokens}.
        """
        session_id = meta["session_id"]
        count = len(tokens)
        last = chunk_count(count)
        written = 0
        try:
            with self.env.begin(write=True) as txn:
                old = txn.get(session_id.encode(), db=self.meta)
                old = unpack(old) if old else {"tokens": 0, "chunks": 0}
                record = self._checked({**meta, "tokens": count, "chunks": last})
                first = first_changed(count, stored_tokens, old["tokens"])
                for index in range(first, last):
                    start = index * CHUNK_TOKENS
                    data = self._export(session_id, export, start, start + chunk_tokens(count, index), bytes_per_token)
                    value = self._value(data)
                    txn.put(_chunk_key(session_id, index), value, db=self.kv)
                    written += len(data)
                for index in range(last, old["chunks"]):  # the session was rewound: drop stale chunks
                    txn.delete(_chunk_key(session_id, index), db=self.kv)
                txn.put(session_id.encode(), np.asarray(tokens, "<i4").tobytes(), db=self.tokens)
                txn.put(session_id.encode(), pack(record), db=self.meta)
                _test_sleep("snapshot")
        except lmdb.MapFullError:
            raise StoreError(FULL) from None
        except lmdb.Error as e:
            raise StoreError(f"snapshot of {session_id} failed: {e} (the previous snapshot is intact)") from None
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
        value[:CHECKSUM_BYTES] = _checksum(data)
        return value

    @staticmethod
    def _export(session_id, export, start: int, stop: int, bytes_per_token):
        try:
            data = export(start, stop)
        except EllmError as e:
            raise StoreError(f"snapshot of {session_id} refused: its KV for tokens [{start}, {stop}) "
                             f"cannot be read ({e}); the previous snapshot is intact") from None
        if bytes_per_token is not None and len(data) != (stop - start) * bytes_per_token:
            raise StoreError(f"snapshot of {session_id} refused: KV for tokens [{start}, {stop}) is {len(data)} "
                             f"bytes, not {(stop - start) * bytes_per_token}; the previous snapshot is intact")
        return data

    @staticmethod
    def _checked(record: dict) -> dict:
        try:
            return check_meta(record)
        except BadRequest as e:
            raise StoreError(f"refusing to write: {e}") from None

    def copy(self, source_id: str, target_id: str, target_meta: dict) -> None:
        """Fork a stored session: its token ids and KV chunks under a new id and metadata."""
        try:
            with self.env.begin(write=True) as txn:
                raw = txn.get(source_id.encode(), db=self.meta)
                if raw is None:
                    raise StoreError(f"session {source_id} is not in the store")
                source = unpack(raw)
                record = self._checked({**target_meta, "tokens": source["tokens"], "chunks": source["chunks"]})
                for index in range(source["chunks"]):
                    txn.put(_chunk_key(target_id, index), txn.get(_chunk_key(source_id, index), db=self.kv), db=self.kv)
                txn.put(target_id.encode(), txn.get(source_id.encode(), db=self.tokens), db=self.tokens)
                txn.put(target_id.encode(), pack(record), db=self.meta)
                _test_sleep("copy")
        except lmdb.MapFullError:
            raise StoreError(FULL) from None
        except lmdb.Error as e:
            raise StoreError(f"fork of {source_id} failed: {e}") from None

    def delete(self, session_id: str) -> bool:
        try:
            with self.env.begin(write=True) as txn:
                raw = txn.get(session_id.encode(), db=self.meta)
                if raw is None:
                    return False
                for index in range(unpack(raw)["chunks"]):
                    txn.delete(_chunk_key(session_id, index), db=self.kv)
                txn.delete(session_id.encode(), db=self.tokens)
                txn.delete(session_id.encode(), db=self.meta)
                _test_sleep("delete")
        except lmdb.Error as e:
            raise StoreError(f"delete of {session_id} failed: {e}") from None
        return True

    # ---- reads ------------------------------------------------------------------------------

    def get_meta(self, session_id: str) -> dict | None:
        with self.env.begin() as txn:
            raw = txn.get(session_id.encode(), db=self.meta)
        return None if raw is None else _parse_meta(session_id, raw)

    def count(self) -> int:
        """Sessions in the store, without reading them (the metrics scrape this)."""
        with self.env.begin() as txn:
            return txn.stat(self.meta)["entries"]

    def list_meta(self) -> list[dict]:
        """Every stored session's metadata; a damaged entry is logged and left out, not fatal."""
        listed = []
        with self.env.begin() as txn:
            for key, value in txn.cursor(db=self.meta):
                try:
                    listed.append(_parse_meta(bytes(key).decode(errors="replace"), value))
                except StoreError as e:
                    log.error("not listed: %s", e)
        return listed

    def load(self, session_id: str, write_chunk, bytes_per_token: int | None = None,
             stop: int | None = None) -> tuple[dict, list[int]]:
        """Read a session back: write_chunk(start, data) receives each KV chunk in order, as a view
        of LMDB's memory (no copy, valid during the call). Every chunk is checked first for presence
        and length, so that a session missing one writes nothing; a chunk failing its checksum
        stops the load there (what was written before it is the caller's to discard: Residency
        rewinds the slot). stop: load only the chunks that hold tokens [0, stop) (a shared prefix).
        Returns (meta, token ids); raises StoreError naming the session."""
        with self.env.begin(buffers=True) as txn:
            raw = txn.get(session_id.encode(), db=self.meta)
            if raw is None:
                raise StoreError(f"session {session_id} is not in the store")
            meta = _parse_meta(session_id, bytes(raw))
            raw_tokens = txn.get(session_id.encode(), db=self.tokens)
            tokens = np.frombuffer(raw_tokens or b"", "<i4").tolist()
            if len(tokens) != meta["tokens"] or meta["chunks"] != chunk_count(len(tokens)):
                raise StoreError(f"session {session_id} is damaged: {len(tokens)} token ids, metadata says "
                                 f"{meta['tokens']} in {meta['chunks']} chunks")
            chunks = []
            for index in range(chunk_count(len(tokens) if stop is None else min(stop, len(tokens)))):
                value = txn.get(_chunk_key(session_id, index), db=self.kv)
                if value is None:
                    raise StoreError(f"session {session_id} is damaged: KV chunk {index} is missing")
                expected = chunk_tokens(len(tokens), index)
                held = len(value) - CHECKSUM_BYTES
                if bytes_per_token is not None and held != expected * bytes_per_token:
                    raise StoreError(f"session {session_id} is damaged: KV chunk {index} holds "
                                     f"{max(held, 0) // bytes_per_token} tokens, not {expected}")
                chunks.append(value)
            # Checksums run one thread ahead of the copies (both outside the GIL), so a resume costs
            # about one pass over the bytes, not two.
            checked = [self._hasher.submit(_checksum_ok, value) for value in chunks]
            try:
                for index, value in enumerate(chunks):
                    if not checked[index].result():
                        raise StoreError(f"session {session_id} is damaged: KV chunk {index} fails its checksum")
                    write_chunk(index * CHUNK_TOKENS, value[CHECKSUM_BYTES:])
            finally:  # no checksum may still read LMDB's memory once the transaction ends
                for future in checked:
                    future.cancel()
                concurrent.futures.wait(checked)
        return meta, tokens

    def export_blob(self, session_id: str) -> bytes:
        """A self-contained copy of a stored session (metadata, tokens, checksummed KV chunks)."""
        with self.env.begin() as txn:
            raw = txn.get(session_id.encode(), db=self.meta)
            if raw is None:
                raise StoreError(f"session {session_id} is not in the store")
            meta = unpack(raw)
            chunks = [txn.get(_chunk_key(session_id, i), db=self.kv) for i in range(meta["chunks"])]
            tokens = txn.get(session_id.encode(), db=self.tokens)
        return pack({"format": "ellm-session", "version": 1, "meta": meta, "tokens": tokens, "chunks": chunks})

    def import_blob(self, blob: bytes, check=None, vocab_size: int | None = None,
                    bytes_per_token: int | None = None, owner: str | None = None) -> dict:
        """Store a session exported by export_blob and return its metadata, after checking it whole:
        its form, its metadata (schemas.StoredMeta; token ids within vocab_size), every chunk's
        checksum and length, and check(meta), which may raise. A blob that fails is BadRequest.
        `owner`, when given, becomes the session's owner."""
        meta, tokens, chunks = parse_blob(blob, vocab_size, bytes_per_token)
        if owner is not None:
            meta["owner"] = owner
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
                txn.put(session_id.encode(), pack(meta), db=self.meta)
                _test_sleep("import")
        except lmdb.MapFullError:
            raise StoreError(FULL) from None
        except lmdb.Error as e:
            raise StoreError(f"import failed: {e}") from None
        return meta

    def stats(self) -> dict:
        info, stat = self.env.info(), self.env.stat()
        return {"path": str(self.path), "map_size": info["map_size"],
                "bytes_used": (info["last_pgno"] + 1) * stat["psize"]}


def first_changed(count: int, stored_tokens: int, old_tokens: int) -> int:
    """The first chunk a snapshot must write: every chunk before it is on disk, whole and valid.

    A chunk is valid when its tokens are below stored_tokens (their KV has not changed) and the
    stored chunk holds as many tokens as it must now (a partial last chunk grows, or shrinks on a
    rewind). An evicted session has nothing to write: its chunks are all valid.
    """
    valid = min(count, stored_tokens, old_tokens)
    first = valid // CHUNK_TOKENS
    if count == old_tokens == valid:
        first = chunk_count(count)  # the partial last chunk is as stored too
    return first


def _parse_meta(session_id: str, raw) -> dict:
    try:
        return check_meta(unpack(raw))
    except Exception as e:  # msgpack's errors, or BadRequest from the schema
        raise StoreError(f"session {session_id} is damaged: {str(e)[:300]}") from None


def parse_blob(blob: bytes, vocab_size, bytes_per_token) -> tuple[dict, bytes, list[bytes]]:
    """(meta, token bytes, chunks) of an exported session, checked whole; BadRequest if it is not one."""
    try:
        document = unpack(blob)
        if not isinstance(document, dict) or document.get("format") != "ellm-session" or document.get("version") != 1:
            raise ValueError("unknown format or version")
        meta, tokens, chunks = document["meta"], document["tokens"], document["chunks"]
        if not isinstance(tokens, bytes) or len(tokens) % 4 or not isinstance(chunks, list) \
                or not all(isinstance(c, bytes) and len(c) >= CHECKSUM_BYTES for c in chunks):
            raise ValueError("tokens or chunks are not binary")
    except Exception as e:  # any malformed file is reported the same way
        raise BadRequest(f"not an exported ellm session ({str(e)[:200]})") from None
    token_ids = np.frombuffer(tokens, "<i4")
    meta = check_meta(meta, token_ids, vocab_size)
    if meta["tokens"] != len(token_ids) or meta["chunks"] != len(chunks) or len(chunks) != chunk_count(len(token_ids)):
        raise BadRequest(f"the exported session is damaged: {len(token_ids)} token ids, {len(chunks)} chunks, "
                         f"metadata says {meta['tokens']} in {meta['chunks']}")
    for index, value in enumerate(chunks):
        if not _checksum_ok(value):
            raise BadRequest(f"the exported session is damaged: KV chunk {index} fails its checksum")
        expected = chunk_tokens(len(token_ids), index)
        if bytes_per_token is not None and len(value) - CHECKSUM_BYTES != expected * bytes_per_token:
            raise BadRequest(f"the exported session is damaged: KV chunk {index} does not hold {expected} tokens")
    return meta, tokens, chunks


def lock(path: Path) -> int:
    """Hold an exclusive lock on path for the life of the process; refuse if another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StoreError(f"the store at {path.parent} is in use by another ellmd (pid {holder}): "
                         "stop it, or give this one another --store") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _test_sleep(transaction: str) -> None:
    """With ELLMD_TEST_TXN_SLEEP: sleep inside a write transaction, just before it commits, between
    two log lines that tell a crash test where its SIGKILL landed (scripts/crash_loop.py); and
    when the ELLMD_TEST_TXN_KILL file exists, die there by SIGKILL."""
    if TXN_SLEEP:
        log.info("test: inside the %s transaction", transaction)
        time.sleep(TXN_SLEEP)
    if TXN_KILL and os.path.exists(TXN_KILL):
        os.kill(os.getpid(), signal.SIGKILL)
    if TXN_SLEEP:
        log.info("test: leaving the %s transaction", transaction)
