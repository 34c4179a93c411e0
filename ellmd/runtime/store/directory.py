"""The directory backend of the session store: plain files, for a filesystem every node mounts (NFS).

  sessions/_<id>/meta            the commit point: msgpack {generation, meta (the packed metadata),
                                 tokens, chunks}: which generation of each file is the session's
  sessions/_<id>/tokens.<g>      int32 token ids, little-endian
  sessions/_<id>/kv.<i>.<g>      chunk i: 8-byte checksum + KV bytes, as in the LMDB backend
  notes/_<id>/<key>              session.point's notes, msgpack, each written once (key: note_key(name))
  leases/_<id>                   the session's lease record (fleet replicas, leases.py)
  lease-locks/_<id>              held (created O_EXCL) while a process reads-modifies-writes that lease
  ellmd.lock                     without a replica: the one process that holds the store

A file is never changed in place: each is written to a temporary file, fsynced and renamed, and a
snapshot writes its files under a new generation before it renames `meta` over the old one, then
removes what the new `meta` no longer names. A crash before that rename leaves the previous
snapshot whole (its files untouched), after it the new one; leftovers are removed by the
session's next write. Only the replica holding a session's lease writes it (a fence checks the
lease before the commit), so each session has one writer; readers verify every checksum. Names
are "_" + the session id (ids are [A-Za-z0-9_.-]: no "/", and no "." or ".." either once prefixed).
"""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

import numpy as np

from ellmd.runtime.store import crash_points
from ellmd.runtime.store.leases import Holder, Lease, pid_alive
from ellmd.runtime.store.base import (CHUNK_TOKENS, DROP, KEEP, SessionStore, StoreError, checksum, check_chunk, checked_record, chunk_count, chunk_tokens, deliver_chunks,
                                      disk_full, exported_chunk, first_changed, loaded_tokens, lock, log, note_key, pack,
                                      parse_meta, private_dir, snapshot_bytes, unpack)

LEASE_LOCK_STALE_S = 5.0  # a lease lock older than this was left by a crash (holding one takes milliseconds)
LEASE_LOCK_WAIT_S = 2.0


class DirectoryStore(SessionStore):
    """Sessions as files under one directory (see the module docstring)."""

    def __init__(self, path: Path, holder: Holder | None = None):
        path = Path(path)
        self._lock = None
        try:
            private_dir(path)
            self._lock = lock(path / "ellmd.lock", shared=holder is not None)
            for name in ("sessions", "notes", "leases", "lease-locks"):
                private_dir(path / name)
        except OSError as e:
            if self._lock is not None:
                os.close(self._lock)
            raise StoreError(f"cannot open the store at {path}: {e}") from None
        self.path = path
        self.holder = holder
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="store-checksum")

    def close(self) -> None:
        self._hasher.shutdown()
        os.close(self._lock)

    def _folder(self, session_id: str) -> Path:
        return self.path / "sessions" / ("_" + session_id)

    # ---- writes -----------------------------------------------------------------------------

    def snapshot(self, meta: dict, tokens, export, stored_tokens: int, bytes_per_token: int | None = None) -> dict:
        session_id = meta["session_id"]
        count, last = len(tokens), chunk_count(len(tokens))
        old = self._envelope(session_id)
        record = checked_record({**meta, "tokens": count, "chunks": last})
        first = first_changed(count, stored_tokens, unpack(old["meta"])["tokens"] if old else 0)
        written = 0

        def chunks():
            nonlocal written
            for index in range(first, last):
                start = index * CHUNK_TOKENS
                data = exported_chunk(session_id, export, start, start + chunk_tokens(count, index), bytes_per_token)
                written += len(data)
                yield index, (checksum(data), data)

        self._commit(session_id, old, record, np.asarray(tokens, "<i4").tobytes(), chunks(), "snapshot",
                     snapshot_bytes(count, first, bytes_per_token))
        return {"chunks_written": last - first, "bytes_written": written, "stored_tokens": count}

    def copy(self, source_id: str, target_id: str, target_meta: dict) -> None:
        source = self._envelope(source_id)
        if source is None:
            raise StoreError(f"session {source_id} is not in the store")
        meta = unpack(source["meta"])
        record = checked_record({**target_meta, "tokens": meta["tokens"], "chunks": meta["chunks"]})
        folder = self._folder(source_id)
        try:
            tokens = (folder / f"tokens.{source['tokens']}").read_bytes()
        except OSError as e:
            raise StoreError(f"fork of {source_id} failed: {e}") from None
        # read one at a time, as they are written
        chunks = ((i, ((folder / f"kv.{i}.{g}").read_bytes(),)) for i, g in enumerate(source["chunks"]))
        self._commit(target_id, self._envelope(target_id), record, tokens, chunks, "copy")

    def delete(self, session_id: str) -> bool:
        folder = self._folder(session_id)
        self.fence(session_id)
        if not (folder / "meta").exists():
            return False
        crash_points.before_commit("delete")
        try:
            os.unlink(folder / "meta")  # the commit: the session is gone
            _fsync_dir(folder)
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(self._notes(session_id), ignore_errors=True)
        except OSError as e:
            raise StoreError(f"delete of {session_id} failed: {e}") from None
        return True

    def _notes(self, session_id: str) -> Path:
        return self.path / "notes" / ("_" + session_id)

    def put_note(self, session_id: str, name: str, note: dict | None) -> None:
        path = self._notes(session_id) / note_key(name)
        try:
            self.fence(session_id)
            if note is None:
                _unlink(path)
            else:
                path.parent.mkdir(mode=0o700, exist_ok=True)
                _write_file(path, (pack(note),))
        except OSError as e:
            action = f"the note of session {session_id}'s point {name!r}"
            raise disk_full(action, self.path, 0 if note is None else len(pack(note)), e) or \
                StoreError(f"{action} failed: {e}") from None

    def get_note(self, session_id: str, name: str) -> dict | None:
        try:
            return unpack((self._notes(session_id) / note_key(name)).read_bytes())
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"the note of {session_id}'s point {name!r} cannot be read: {e}") from None

    def _write_imported(self, meta: dict, tokens: bytes, chunks: list[bytes]) -> dict:
        if (self._folder(meta["session_id"]) / "meta").exists():  # keep the id if it is free
            meta = {**meta, "session_id": uuid.uuid4().hex[:12]}
        self._commit(meta["session_id"], None, meta, tokens, ((i, (v,)) for i, v in enumerate(chunks)), "import")
        return meta

    def _commit(self, session_id: str, old: dict | None, record: dict, tokens: bytes, chunks, kind: str,
                needed: int = 0) -> None:
        """Write a session's new generation: the chunks given (index, parts of its value), its token
        ids, then `meta` naming them and old's files for the chunks not given; then remove the rest.
        needed: the bytes it writes, when known (a full filesystem's error names them)."""
        folder = self._folder(session_id)
        generation = old["generation"] + 1 if old else 1
        files = list(old["chunks"][:record["chunks"]]) if old else []
        files += [0] * (record["chunks"] - len(files))
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
            for index, parts in chunks:
                _write_file(folder / f"kv.{index}.{generation}", parts)
                files[index] = generation
            if 0 in files:
                raise StoreError(f"{kind} of {session_id} refused: KV chunk {files.index(0)} would be missing")
            _write_file(folder / f"tokens.{generation}", (tokens,))
            _fsync_dir(folder)
            self.fence(session_id)
            crash_points.before_commit(kind)
            envelope = {"generation": generation, "meta": pack(record), "tokens": generation, "chunks": files}
            _write_file(folder / "meta", (pack(envelope),))
            _fsync_dir(folder)
        except OSError as e:
            raise disk_full(f"{kind} of session {session_id}", self.path, needed, e) or \
                StoreError(f"{kind} of {session_id} failed: {e} (the previous snapshot is intact)") from None
        keep = {"meta", f"tokens.{generation}", *(f"kv.{i}.{g}" for i, g in enumerate(files))}
        for name in os.listdir(folder):  # older generations, and what a crash left behind
            if name not in keep:
                _unlink(folder / name)

    # ---- reads ------------------------------------------------------------------------------

    def _envelope(self, session_id: str) -> dict | None:
        """The session's committed `meta` file, unpacked (None: no such session)."""
        try:
            raw = (self._folder(session_id) / "meta").read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"session {session_id} cannot be read: {e}") from None
        try:
            envelope = unpack(raw)
            if not isinstance(envelope, dict) or not isinstance(envelope.get("meta"), bytes):
                raise ValueError("not a session's meta file")
            return envelope
        except Exception as e:  # msgpack's errors
            raise StoreError(f"session {session_id} is damaged: {str(e)[:300]}") from None

    def get_meta(self, session_id: str) -> dict | None:
        envelope = self._envelope(session_id)
        return None if envelope is None else parse_meta(session_id, envelope["meta"])

    def _ids(self) -> list[str]:
        return [name[1:] for name in os.listdir(self.path / "sessions") if name.startswith("_")]

    def count(self) -> int:
        return sum((self._folder(i) / "meta").exists() for i in self._ids())

    def raw_metas(self) -> list[tuple[str, bytes]]:
        listed = []
        for session_id in self._ids():
            try:
                envelope = self._envelope(session_id)
            except StoreError as e:
                log.error("not listed: %s", e)
                continue
            if envelope is not None:  # None: deleted meanwhile, or a crash's leftover
                listed.append((session_id, envelope["meta"]))
        return listed

    def load(self, session_id: str, write_chunk, bytes_per_token: int | None = None,
             stop: int | None = None) -> tuple[dict, list[int]]:
        """See SessionStore.load; the chunks are memory maps of their files."""
        envelope = self._envelope(session_id)
        if envelope is None:
            raise StoreError(f"session {session_id} is not in the store")
        meta = parse_meta(session_id, envelope["meta"])
        folder = self._folder(session_id)
        try:
            tokens = loaded_tokens(session_id, meta, (folder / f"tokens.{envelope['tokens']}").read_bytes())
            if len(envelope["chunks"]) != meta["chunks"]:
                raise StoreError(f"session {session_id} is damaged: its meta file names "
                                 f"{len(envelope['chunks'])} of its {meta['chunks']} chunks")
            chunks = []
            for index in range(chunk_count(len(tokens) if stop is None else min(stop, len(tokens)))):
                value = _mapped(folder / f"kv.{index}.{envelope['chunks'][index]}")
                check_chunk(session_id, index, value, len(tokens), bytes_per_token)
                chunks.append(value)
        except FileNotFoundError as e:  # its writer replaced that generation meanwhile
            raise StoreError(f"session {session_id} changed while it was read ({e.filename}): try again") from None
        except OSError as e:
            raise StoreError(f"session {session_id} cannot be read: {e}") from None
        deliver_chunks(session_id, chunks, write_chunk, self._hasher)
        return meta, tokens

    def _raw(self, session_id: str) -> tuple[dict, bytes, list[bytes]]:
        envelope = self._envelope(session_id)
        if envelope is None:
            raise StoreError(f"session {session_id} is not in the store")
        folder = self._folder(session_id)
        try:
            chunks = [(folder / f"kv.{i}.{g}").read_bytes() for i, g in enumerate(envelope["chunks"])]
            return unpack(envelope["meta"]), (folder / f"tokens.{envelope['tokens']}").read_bytes(), chunks
        except OSError as e:
            raise StoreError(f"session {session_id} cannot be read: {e}") from None

    def stats(self) -> dict:
        used = sum(f.stat().st_size for f in (self.path / "sessions").rglob("*") if f.is_file())
        return {"path": str(self.path), "backend": "directory", "bytes_used": used}

    # ---- leases -----------------------------------------------------------------------------

    def get_lease(self, session_id: str) -> Lease | None:
        try:
            return Lease.from_record(unpack((self.path / "leases" / ("_" + session_id)).read_bytes()))
        except FileNotFoundError:
            return None
        except Exception as e:  # a damaged lease file: nobody holds it
            log.error("the lease of session %s is unreadable (%s): taken as free", session_id, e)
            return None

    def _update_leases(self, session_ids: list[str], decide) -> dict:
        results = {}
        for session_id in session_ids:
            path = self.path / "leases" / ("_" + session_id)
            with LeaseLock(self.path / "lease-locks" / ("_" + session_id)):
                new, results[session_id] = decide(self.get_lease(session_id))
                if new == DROP:
                    _unlink(path)
                elif new != KEEP:  # not fsynced: a lease outlives no crash of its node anyway
                    _write_file(path, (pack(new.to_record()),), durable=False)
        return results


class LeaseLock:
    """A file created with O_EXCL while one process updates one lease (atomic on NFS too). A lock
    left by a crash is broken once its holder is known dead (same host) or it is older than
    LEASE_LOCK_STALE_S."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        deadline = time.monotonic() + LEASE_LOCK_WAIT_S
        mark = f"{socket.gethostname()} {os.getpid()}\n".encode()
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                if self._stale():
                    _unlink(self.path)
                elif time.monotonic() > deadline:
                    raise StoreError(f"the lease lock {self.path} stays held: try again") from None
                else:
                    time.sleep(0.002)
                continue
            os.write(fd, mark)
            os.close(fd)
            return self

    def _stale(self) -> bool:
        try:
            held = self.path.read_bytes().split()
            age = time.time() - self.path.stat().st_mtime
        except (FileNotFoundError, OSError):
            return False  # released meanwhile: try again
        if age > LEASE_LOCK_STALE_S:
            return True
        return len(held) == 2 and held[1].isdigit() and held[0].decode(errors="replace") == socket.gethostname() \
            and not pid_alive(int(held[1]))

    def __exit__(self, *exc):
        _unlink(self.path)


def _write_file(path: Path, parts, durable: bool = True) -> None:
    """Write a file whole or not at all: a temporary file beside it, fsynced, renamed over it."""
    temporary = path.with_name(f".tmp-{uuid.uuid4().hex}")
    fd = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink(temporary)
        raise
    os.close(fd)
    os.replace(temporary, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _mapped(path: Path):
    """A file's bytes as a read-only memory map (None: no such file)."""
    try:
        with open(path, "rb") as f:
            return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    except FileNotFoundError:
        return None
    except ValueError:  # an empty file cannot be mapped
        return memoryview(b"")
    except OSError as e:
        if e.errno == errno.ENODEV:  # a filesystem without mmap: read it
            return memoryview(path.read_bytes())
        raise
