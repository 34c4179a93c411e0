"""Session leases: in a fleet, each session is owned by one replica at a time.

A lease is a record in the store beside the session (base.SessionStore keeps it): which
replica holds the session (name, host, pid) and until when (wall-clock seconds: replicas on
several nodes compare them, so their clocks must agree to well within the TTL). A replica takes
the lease before it reads a stored session or creates one under a client-chosen id, renews it
for every session it holds (`Leases`, a heartbeat thread beside the engine thread), and releases
it when the session leaves it. Another replica may take a lease over once it has expired, or at
once when its holder ran on the same host and its process is gone (a SIGKILLed replica's
sessions fail over without waiting for the TTL). A store write of a leased session by anyone
but its holder is refused by the store (a fence against a replica that lost its lease).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import asdict, dataclass

log = logging.getLogger("ellmd.leases")


@dataclass(frozen=True)
class Holder:
    """A replica process: its fleet name, host and pid."""

    replica: str
    host: str
    pid: int

    @classmethod
    def this_process(cls, replica: str) -> "Holder":
        return cls(replica, socket.gethostname(), os.getpid())

    def describe(self) -> str:
        return f"replica {self.replica} (host {self.host}, pid {self.pid})"


@dataclass(frozen=True)
class Lease:
    """A session's lease record as the store keeps it."""

    holder: Holder
    expires: float  # time.time() seconds

    def to_record(self) -> dict:
        return {**asdict(self.holder), "expires": self.expires}

    @classmethod
    def from_record(cls, record: dict) -> "Lease":
        return cls(Holder(str(record["replica"]), str(record["host"]), int(record["pid"])), float(record["expires"]))


def pid_alive(pid: int) -> bool:
    """Is a process of that pid running on this host? (a zombie, killed but not reaped, is not)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc: trust kill(0)


def may_take(lease: Lease | None, holder: Holder, now: float) -> bool:
    """May `holder` take (or renew) a session whose lease is `lease`?"""
    if lease is None or lease.holder == holder or lease.expires <= now:
        return True
    return lease.holder.host == holder.host and not pid_alive(lease.holder.pid)


class Leases:
    """The leases this replica holds, and the heartbeat that renews them.

    take() runs on the engine thread (one short store transaction, never a wait for another
    replica); the heartbeat renews every held lease each third of the TTL. A lease found taken
    by another replica (this one stalled past its TTL) is dropped and its id kept in `lost`, so
    that the runtime forgets its stale copy of the session rather than serve it.
    """

    def __init__(self, store, ttl: float):
        self.store = store  # opened for a replica: store.holder is this process
        self.holder = store.holder
        self.ttl = ttl
        self.held: set[str] = set()
        self.lost: set[str] = set()
        self._lock = threading.Lock()  # guards held and lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="lease-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def take(self, session_id: str) -> Lease | None:
        """Take or renew the lease of a session; returns None, or the live lease of the replica
        that holds it (nothing was taken)."""
        refused = self.store.take_lease(session_id, self.holder, self.ttl)
        if refused is None:
            with self._lock:
                self.held.add(session_id)
                self.lost.discard(session_id)
        return refused

    def holds(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self.held

    def was_lost(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self.lost

    def release(self, session_id: str) -> bool:
        """Give a session's lease back (on the writer thread, after the session's last write)."""
        with self._lock:
            self.held.discard(session_id)
        return self.store.release_lease(session_id, self.holder)

    def release_all(self) -> None:
        with self._lock:
            held, self.held = sorted(self.held), set()
        for session_id in held:
            self.store.release_lease(session_id, self.holder)

    def renew(self) -> None:
        """Renew every held lease once (the heartbeat's beat)."""
        with self._lock:
            held = sorted(self.held)
        lost = self.store.renew_leases(held, self.holder, self.ttl) if held else []
        with self._lock:
            lost = [i for i in lost if i in self.held]  # not those released meanwhile
            self.held.difference_update(lost)
            self.lost.update(lost)
        if lost:
            log.error("lost the lease of %s: another replica took them over", ", ".join(lost))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.renew()
            except Exception:  # a store hiccup: the next beat tries again, well within the TTL
                log.exception("renewing leases failed")
