"""The store's writer: one thread beside the engine thread that runs every write to the store.

The engine thread never waits on the store for a snapshot: it copies the KV a snapshot needs (the
chunks changed since the last one) into a buffer, hands the writer a StoreWrite and goes on with
its decode steps. Writes run one at a time, in the order they were queued, so a session's writes
(snapshots, a fork's copy, a delete) land in its order. Until a write is done its session is
marked pending (`pending`); whoever must see the store as that session left it (a resume, an
eviction, a fork) waits for those writes only. Each write is all or nothing (base.py): a failed one
leaves the previous snapshot whole, and its error is kept on the write for the engine thread to
report (Residency.settle), never dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ellmd.runtime.store.base import SessionStore, StoreError

log = logging.getLogger("ellmd.store")


@dataclass(eq=False)
class StoreWrite:
    """One write of one session, queued for the writer; `done` is set once it has run."""

    kind: str  # "snapshot", "copy" (a fork), "delete", "note" (session.point's) or "release" (a fleet replica's lease)
    session_id: str
    run: Callable[[SessionStore], dict | None] | None  # the store call, on the writer thread (dropped once run)
    stored_tokens: int = 0  # a snapshot: tokens whose KV on disk was valid before it
    result: dict | None = None
    error: Exception | None = None
    seconds: float = 0.0  # the store call's time
    done: threading.Event = field(default_factory=threading.Event)
    settled: bool = False  # the engine thread has accounted for its outcome (Residency.settle)


class StoreWriter:
    """The writer thread, its queue, and the writes each session has pending."""

    def __init__(self, store: SessionStore, done: queue.Queue | None = None):
        self.store = store
        self.done = done  # where each write goes once it has run (the engine loop's queue: it settles it)
        self.pending: dict[str, list[StoreWrite]] = {}  # session id -> its writes queued or running
        self._lock = threading.Lock()  # guards pending
        self._queue: queue.SimpleQueue[StoreWrite | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, write: StoreWrite) -> StoreWrite:
        with self._lock:
            self.pending.setdefault(write.session_id, []).append(write)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="store-writer", daemon=True)
                self._thread.start()
        self._queue.put(write)
        return write

    def pending_of(self, session_id: str) -> list[StoreWrite]:
        with self._lock:
            return list(self.pending.get(session_id, ()))

    def pending_ids(self) -> list[str]:
        with self._lock:
            return list(self.pending)

    def wait(self, session_id: str) -> list[StoreWrite]:
        """Block until every write queued so far for that session has run; returns them."""
        writes = self.pending_of(session_id)
        for write in writes:
            write.done.wait()
        return writes

    def flush(self) -> list[StoreWrite]:
        """Block until every write queued so far has run; returns them."""
        with self._lock:
            writes = [w for session in self.pending.values() for w in session]
        for write in writes:
            write.done.wait()
        return writes

    def close(self) -> None:
        """Run what is queued, then end the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _run(self) -> None:
        while (write := self._queue.get()) is not None:
            began = time.perf_counter()
            try:
                write.result = write.run(self.store)
            except StoreError as e:
                write.error = e
            except Exception as e:  # a bug in a write must not end the writer: its write fails alone
                log.exception("the %s of session %s failed", write.kind, write.session_id)
                write.error = StoreError(f"{write.kind} of {write.session_id} failed: {type(e).__name__}: {e}")
            write.seconds = time.perf_counter() - began
            write.run = None  # and the KV copy it holds with it
            with self._lock:
                writes = self.pending.get(write.session_id, [])
                if write in writes:
                    writes.remove(write)
                if not writes:
                    self.pending.pop(write.session_id, None)
            write.done.set()
            if self.done is not None:
                self.done.put(write)
