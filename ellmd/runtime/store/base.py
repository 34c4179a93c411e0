"""The session store's interface (SessionStore) and what every backend shares.

A backend keeps, per session: its metadata (a msgpack map checked against meta.StoredMeta),
its token ids (int32, little-endian) and its KV in chunks of CHUNK_TOKENS tokens (the last may be
shorter), each stored as an 8-byte checksum followed by the KV bytes as KVCache.export lays them
out. The checksum is XXH3-64 (~10 GB/s here: a resume runs at memory speed); chunks written
before it carry blake2b-64, which is still accepted. Backends: store.Store (one LMDB environment,
the default) and directory.DirectoryStore (a directory per session, for a shared filesystem);
store.open_store picks one.

The contract every backend keeps:
  - a snapshot, copy, delete or import is all or nothing: a crash or an error leaves the
    previous state of the session whole and loadable;
  - every write is checked first (metadata, each chunk's length) and so is every read (presence,
    length, checksum), so that neither a client nor a crash leaves a session that loads half right;
  - one writer per session (the engine's writer thread, or the replica holding its lease), any
    number of readers;
  - leases (leases.py): one read-modify-write of a session's lease record at a time across every
    process that opens the store (`_update_leases`); opened for a fleet replica (`holder` set),
    the store refuses to write a session whose live lease another replica holds.
Without a holder, a store belongs to one process at a time (a lock file beside the data, `lock`);
fleet replicas share that lock, so that a lone daemon and replicas never run on one store together.
"""

from __future__ import annotations

import abc
import concurrent.futures
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import msgpack
import numpy as np
import xxhash

from ellmd.errors import BadRequest, EllmError, InvariantError
from ellmd.runtime.store.leases import Holder, Lease, may_take
from ellmd.runtime.store.meta import check_meta

log = logging.getLogger("ellmd.store")

CHUNK_TOKENS = 256
CHECKSUM_BYTES = 8
SLACK_BYTES = 1 << 20  # what a write needs beside its data (B-tree, metadata and free-list pages)
KEEP, DROP = "keep", "drop"  # what a lease decision does to the record, besides writing a new Lease


class StoreError(EllmError):
    """The store is full, damaged or unreadable; what was committed before stays intact."""

    code = "store"


class SessionStore(abc.ABC):
    """Sessions on disk: the interface Residency and the writer thread use, whatever the backend.

    Thread-safe for one writer thread and many readers. `holder`: the fleet replica this process
    is (None: the store is this process' alone).
    """

    path: Path
    holder: Holder | None = None

    # ---- writes (the writer thread) ---------------------------------------------------------

    @abc.abstractmethod
    def snapshot(self, meta: dict, tokens, export, stored_tokens: int, bytes_per_token: int | None = None) -> dict:
        """Write a session: metadata, all token ids, and the KV chunks changed since the last snapshot.

        export(start, stop) -> KV bytes of tokens [start, stop); stored_tokens: how many tokens' KV
        on disk is still valid (tokens before it need not be written again, see first_changed). A
        chunk whose length is not its tokens' (bytes_per_token each) is refused: nothing is written.
        Returns {chunks_written, bytes_written, stored_tokens}.
        """

    @abc.abstractmethod
    def copy(self, source_id: str, target_id: str, target_meta: dict) -> None:
        """Fork a stored session: its token ids and KV chunks under a new id and metadata."""

    @abc.abstractmethod
    def delete(self, session_id: str) -> bool:
        """Remove a session (and its notes); False if there was none."""

    @abc.abstractmethod
    def put_note(self, session_id: str, name: str, note: dict | None) -> None:
        """Keep a caller's record with a session's named point (None: drop it). Notes are kept apart
        from the session's metadata, so each is written once, not with every snapshot."""

    @abc.abstractmethod
    def get_note(self, session_id: str, name: str) -> dict | None:
        """A note put_note kept, or None."""

    # ---- reads ------------------------------------------------------------------------------

    @abc.abstractmethod
    def get_meta(self, session_id: str) -> dict | None:
        """A session's metadata, checked (StoreError if damaged); None if there is no such session."""

    @abc.abstractmethod
    def count(self) -> int:
        """Sessions in the store, without reading them (the metrics scrape this)."""

    @abc.abstractmethod
    def raw_metas(self) -> list[tuple[str, bytes]]:
        """(session id, its metadata as stored, unparsed) of every stored session; an entry that
        cannot be read is logged and left out, not fatal."""

    def version(self) -> object | None:
        """A value that changes whenever a write is committed, by any process (None: the backend
        cannot tell; a reader then compares each session's metadata)."""
        return None

    def list_meta(self) -> list[dict]:
        """Every stored session's metadata; a damaged entry is logged and left out, not fatal."""
        listed = []
        for session_id, raw in self.raw_metas():
            try:
                listed.append(parse_meta(session_id, raw))
            except StoreError as e:
                log.error("not listed: %s", e)
        return listed

    @abc.abstractmethod
    def load(self, session_id: str, write_chunk, bytes_per_token: int | None = None,
             stop: int | None = None) -> tuple[dict, list[int]]:
        """Read a session back: write_chunk(start, data) receives each KV chunk in order (a view,
        valid during the call). Every chunk is checked first for presence and length, so that a
        session missing one writes nothing; a chunk failing its checksum stops the load there
        (what was written before it is the caller's to discard). stop: load only the chunks that
        hold tokens [0, stop) (a shared prefix). Returns (meta, token ids); raises StoreError
        naming the session."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """{path, backend, bytes_used, ...}: what `stats` reports of the store."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the store (and its lock file, when it has one)."""

    # ---- export and import: the blob format, over each backend's raw read and write -----------

    @abc.abstractmethod
    def _raw(self, session_id: str) -> tuple[dict, bytes, list[bytes]]:
        """(metadata as stored, token bytes, chunk values) of a session; StoreError if absent."""

    @abc.abstractmethod
    def _write_imported(self, meta: dict, tokens: bytes, chunks: list[bytes]) -> dict:
        """Store a checked session under its id, or a new one if that is taken; returns its metadata."""

    def export_blob(self, session_id: str) -> bytes:
        """A self-contained copy of a stored session (metadata, tokens, checksummed KV chunks)."""
        meta, tokens, chunks = self._raw(session_id)
        return pack({"format": "ellm-session", "version": 1, "meta": meta, "tokens": tokens, "chunks": chunks})

    def import_blob(self, blob: bytes, check=None, vocab_size: int | None = None,
                    bytes_per_token: int | None = None, owner: str | None = None) -> dict:
        """Store a session exported by export_blob and return its metadata, after checking it whole:
        its form, its metadata (meta.StoredMeta; token ids within vocab_size), every chunk's
        checksum and length, and check(meta), which may raise. A blob that fails is BadRequest.
        `owner`, when given, becomes the session's owner."""
        meta, tokens, chunks = parse_blob(blob, vocab_size, bytes_per_token)
        if owner is not None:
            meta["owner"] = owner
        if check is not None:
            check(meta)
        return self._write_imported(meta, tokens, chunks)

    # ---- leases -----------------------------------------------------------------------------

    @abc.abstractmethod
    def get_lease(self, session_id: str) -> Lease | None:
        """The lease record of a session (expired or not), or None."""

    @abc.abstractmethod
    def _update_leases(self, session_ids: list[str], decide: Callable) -> dict:
        """For each id, atomically across processes: decide(current Lease | None) -> (a new Lease,
        KEEP or DROP; a result); returns {id: result}."""

    def take_lease(self, session_id: str, holder: Holder, ttl: float) -> Lease | None:
        """Take or renew a session's lease for `holder`; None, or the live lease that refuses it."""
        def decide(current):
            now = time.time()
            return (Lease(holder, now + ttl), None) if may_take(current, holder, now) else (KEEP, current)
        return self._update_leases([session_id], decide)[session_id]

    def renew_leases(self, session_ids: list[str], holder: Holder, ttl: float) -> list[str]:
        """Extend the leases `holder` still holds; returns the ids it no longer holds."""
        def decide(current):
            ours = current is not None and current.holder == holder
            return (Lease(holder, time.time() + ttl), False) if ours else (KEEP, True)
        return [i for i, lost in self._update_leases(session_ids, decide).items() if lost]

    def release_lease(self, session_id: str, holder: Holder) -> bool:
        """Drop a session's lease if `holder` holds it; returns whether it did."""
        def decide(current):
            return (DROP, True) if current is not None and current.holder == holder else (KEEP, False)
        return self._update_leases([session_id], decide)[session_id]

    def fence(self, session_id: str) -> None:
        """Refuse to write a session another live replica holds (see leases.py): StoreError."""
        lease = None if self.holder is None else self.get_lease(session_id)
        if lease is not None and not may_take(lease, self.holder, time.time()):
            raise StoreError(f"session {session_id} is leased to {lease.holder.describe()}: "
                             f"{self.holder.describe()} may not write it")


# ---- what every backend shares -----------------------------------------------------------------


def pack(value) -> bytes:
    """The one msgpack configuration the store writes with (unpack reads it back)."""
    return msgpack.packb(value, use_bin_type=True)


def unpack(data) -> object:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def note_key(name: str) -> str:
    """The name a note is kept under (a point's name may be any text: hashed to a plain key)."""
    return hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def checksum(data) -> bytes:
    return xxhash.xxh3_64_digest(data)


def checksum_ok(value) -> bool:
    """Does a stored chunk (checksum + data, any buffer) match its checksum?"""
    stored, data = value[:CHECKSUM_BYTES], value[CHECKSUM_BYTES:]
    if checksum(data) == stored:
        return True
    return hashlib.blake2b(data, digest_size=CHECKSUM_BYTES).digest() == stored  # written by an older ellmd


def chunk_count(tokens: int) -> int:
    return (tokens + CHUNK_TOKENS - 1) // CHUNK_TOKENS


def chunk_tokens(tokens: int, index: int) -> int:
    """Tokens held by chunk `index` of a session of `tokens` tokens."""
    return min(tokens, (index + 1) * CHUNK_TOKENS) - index * CHUNK_TOKENS


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


def megabytes(count: int) -> str:
    return f"{count / 1e6:.1f} MB"


def full(action: str, needed: int, free: int, where: str, remedy: str) -> StoreError:
    """The error of a write that did not fit: "the store is full", the space it needed, the space left."""
    return StoreError(f"{action} failed: the store is full: it needs {megabytes(needed)} of free space and "
                      f"{where} has {megabytes(max(free, 0))}; {remedy} (nothing was lost)")


def disk_full(action: str, path: Path, needed: int, error: Exception) -> StoreError | None:
    """A write that failed on a full filesystem, as `full`; None if the filesystem has room. LMDB
    reports a short write (ENOSPC on most filesystems) as EIO, so the free space decides."""
    free = shutil.disk_usage(path).free
    if getattr(error, "errno", None) == errno.ENOSPC or free < needed + SLACK_BYTES:
        return full(action, needed, free, f"the filesystem of {path}", "free disk space or delete sessions")
    return None


def snapshot_bytes(count: int, first: int, bytes_per_token: int | None) -> int:
    """KV bytes a snapshot writes: its chunks from `first` on (0 when the token size is not given)."""
    return max(count - first * CHUNK_TOKENS, 0) * (bytes_per_token or 0)


def checked_record(record: dict) -> dict:
    """Metadata about to be written, checked against meta.StoredMeta (StoreError if not)."""
    try:
        return check_meta(record)
    except BadRequest as e:
        raise StoreError(f"refusing to write: {e}") from None


def exported_chunk(session_id: str, export, start: int, stop: int, bytes_per_token):
    """export(start, stop), checked to hold (stop - start) tokens' KV; StoreError otherwise."""
    try:
        data = export(start, stop)
    except (EllmError, InvariantError) as e:
        if isinstance(e, InvariantError):  # a bug of the caller's: the snapshot is refused all the same
            log.error("snapshot of %s: its KV cannot be read", session_id, exc_info=e)
        raise StoreError(f"snapshot of {session_id} refused: its KV for tokens [{start}, {stop}) "
                         f"cannot be read ({e}); the previous snapshot is intact") from None
    if bytes_per_token is not None and len(data) != (stop - start) * bytes_per_token:
        raise StoreError(f"snapshot of {session_id} refused: KV for tokens [{start}, {stop}) is {len(data)} "
                         f"bytes, not {(stop - start) * bytes_per_token}; the previous snapshot is intact")
    return data


def parse_meta(session_id: str, raw) -> dict:
    """Stored metadata bytes, parsed and checked; StoreError naming the session if damaged."""
    try:
        return check_meta(unpack(raw))
    except Exception as e:  # msgpack's errors, or BadRequest from the schema
        raise StoreError(f"session {session_id} is damaged: {str(e)[:300]}") from None


def loaded_tokens(session_id: str, meta: dict, raw_tokens) -> list[int]:
    """A session's token ids, checked against its metadata's counts."""
    tokens = np.frombuffer(raw_tokens or b"", "<i4").tolist()
    if len(tokens) != meta["tokens"] or meta["chunks"] != chunk_count(len(tokens)):
        raise StoreError(f"session {session_id} is damaged: {len(tokens)} token ids, metadata says "
                         f"{meta['tokens']} in {meta['chunks']} chunks")
    return tokens


def check_chunk(session_id: str, index: int, value, tokens: int, bytes_per_token: int | None) -> None:
    """A stored chunk (None: missing) must hold its tokens' KV; StoreError otherwise."""
    if value is None:
        raise StoreError(f"session {session_id} is damaged: KV chunk {index} is missing")
    expected = chunk_tokens(tokens, index)
    held = len(value) - CHECKSUM_BYTES
    if bytes_per_token is not None and held != expected * bytes_per_token:
        raise StoreError(f"session {session_id} is damaged: KV chunk {index} holds "
                         f"{max(held, 0) // bytes_per_token} tokens, not {expected}")


def deliver_chunks(session_id: str, chunks: list, write_chunk, hasher: concurrent.futures.Executor) -> None:
    """Hand checked chunk values (checksum + data buffers) to write_chunk(start, data), in order;
    StoreError at the first that fails its checksum. Checksums run one thread ahead of the copies
    (both outside the GIL), so a resume costs about one pass over the bytes, not two."""
    checked = [hasher.submit(checksum_ok, value) for value in chunks]
    try:
        for index, value in enumerate(chunks):
            if not checked[index].result():
                raise StoreError(f"session {session_id} is damaged: KV chunk {index} fails its checksum")
            write_chunk(index * CHUNK_TOKENS, value[CHECKSUM_BYTES:])
    finally:  # no checksum may still read the buffers once the caller lets them go
        for future in checked:
            future.cancel()
        concurrent.futures.wait(checked)


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
        if not checksum_ok(value):
            raise BadRequest(f"the exported session is damaged: KV chunk {index} fails its checksum")
        expected = chunk_tokens(len(token_ids), index)
        if bytes_per_token is not None and len(value) - CHECKSUM_BYTES != expected * bytes_per_token:
            raise BadRequest(f"the exported session is damaged: KV chunk {index} does not hold {expected} tokens")
    return meta, tokens, chunks


def lock(path: Path, shared: bool = False) -> int:
    """Hold a lock on path for the life of the process; refuse if another holds it against us.
    Exclusive: a daemon that holds the store alone (its pid written in the file); shared: fleet
    replicas, any number of them, none while a lone daemon runs, nor it while they run."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        who = f"another ellmd (pid {holder})" if holder else "fleet replicas (ellmd start --replica)"
        raise StoreError(f"the store at {path.parent} is in use by {who}: stop it, or give this one another "
                         "--store" + ("" if shared else ", or run each as a --replica")) from None
    os.ftruncate(fd, 0)
    if not shared:
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def private_dir(path: Path) -> None:
    """Create a store directory (and its parents) readable by the user alone."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
