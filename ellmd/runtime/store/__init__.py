"""The session store: a session's metadata, token ids and KV bytes, kept across restarts.

  base.py        the interface (SessionStore) and what the backends share: chunks, checksums, checks
  lmdb.py        the LMDB backend (the default)
  directory.py   the directory backend: a directory per session, for a shared filesystem
  meta.py        a session's stored metadata (StoredMeta) and its validation
  leases.py      a fleet replica's session leases
  writer.py      the writer thread: snapshots, copies and deletes, written beside the engine loop
"""

from __future__ import annotations

from pathlib import Path

from ellmd.errors import EllmError
from ellmd.runtime.store.base import SessionStore
from ellmd.runtime.store.leases import Holder

BACKENDS = ("lmdb", "directory")


def open_store(backend: str, path: Path, map_size: int = 1 << 40, replica: str | None = None) -> SessionStore:
    """The store of that backend at path. replica: this process is that fleet replica (the store is
    shared: its lock is shared; sessions are leased, leases.py); None: the store is this process' alone."""
    holder = Holder.this_process(replica) if replica is not None else None
    if backend == "lmdb":
        from ellmd.runtime.store.lmdb import Store

        return Store(path, map_size, holder)
    if backend == "directory":
        from ellmd.runtime.store.directory import DirectoryStore

        return DirectoryStore(path, holder)
    raise EllmError(f"store_backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
