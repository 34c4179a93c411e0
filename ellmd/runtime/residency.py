"""Residency: which sessions hold a KV slot, eviction, snapshots. The only code that talks to the store.

At most `slots` sessions are resident. A session that is needed and not resident takes a free
slot, or the slot of the idle session the scheduler policy picks (snapshotted first); with every
slot busy, SlotsBusy: the request waits. Sessions known to this daemon but not resident keep
`tokens = None` until their KV loads back from the store.

Writes run on the store's writer thread (writer.py): a snapshot copies the KV it needs here, on
the engine thread, and returns its StoreWrite at once. What reads the store about a session (a
resume, a lookup by id, a prefix read back) first waits for that session's pending writes, and an
eviction waits for the victim's, so nobody sees a session as it was before a write it queued.

In a fleet (`leases` given, leases.py), every session in `sessions` is leased to this replica:
the lease is taken before a stored session is read (so its metadata is the store's latest) or a
new one is adopted, and given back, after the session's last write, when it leaves memory
(`forget`). A session another live replica holds is `busy`, naming that replica.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import queue
import shutil
import time

from ellmd.errors import EllmError, InvariantError
from ellmd.runtime.donors import PrefixIndex
from ellmd.runtime.errors import ProtocolError, SlotsBusy, not_found
from ellmd.runtime.store.leases import Leases
from ellmd.runtime.schemas import UNSTORABLE, unstorable
from ellmd.runtime.session import SCOPE, Session, common_prefix, scoped_id
from ellmd.runtime.store.base import CHUNK_TOKENS, SessionStore, StoreError, checksum, parse_meta
from ellmd.runtime.store.writer import StoreWrite, StoreWriter

log = logging.getLogger("ellmd.runtime")


class Residency:
    """Sessions by id, the slot each resident one holds, and their snapshots in the store."""

    def __init__(self, engine, store: SessionStore, policy, written: queue.Queue | None = None,
                 leases: Leases | None = None):
        self.engine = engine
        self.store = store
        self.leases = leases  # a fleet replica's leases (None: the store is this daemon's alone)
        self.writer = StoreWriter(store, written)  # each write, once run, goes on `written` (the engine loop's queue)
        self.policy = policy  # picks the idle session to evict (scheduler.Policy.victim)
        self.fingerprint = model_fingerprint(engine)
        self.sessions: dict[str, Session] = {}
        self.slots: list[Session | None] = [None] * engine.kv.slots
        self.unsaved: dict[str, StoreError] = {}  # session id -> the error of its last snapshot, until one succeeds
        self.listing = StoredListing()  # the stored sessions as `list` shows them
        self.donors = PrefixIndex()  # the stored sessions a new session may take its first tokens' KV from
        self.index_store()

    # ---- finding sessions ----------------------------------------------------------------

    def session(self, session_id: str, owner: str | None = None) -> Session:
        """The session a request names (its metadata loaded from the store if need be). A request
        with an owner (an API key) names its sessions by the ids it gave them (see resolve) and finds
        only those; one without (the operator) finds every session, by the id it is kept under."""
        named, session_id = session_id, self.resolve(session_id, owner)
        session = self.sessions.get(session_id)
        if session is not None and not session.busy and self.leases is not None and self.leases.was_lost(session_id):
            log.error("session %s was taken over by another replica: its copy here is dropped", session_id)
            self.release(session)
            self.sessions.pop(session_id)
            session = None
        if session is None:
            self.wait_for_writes(session_id)  # a session closed or deleted a moment ago
            self.lease(session_id)  # before reading: what this replica reads is then the latest
            try:
                meta = self.store.get_meta(session_id)
                if meta is None or not visible(meta.get("owner"), owner):
                    raise not_found(named)
                self.check_fingerprint(meta)
            except BaseException:
                self.disown(session_id)
                raise
            session = Session.from_stored(meta, [])
            session.stored_tokens = meta["tokens"]
            session.tokens = None  # loaded with the KV on resume
            self.sessions[session_id] = session
        if not visible(session.owner, owner):
            raise not_found(named)
        return session

    def resolve(self, session_id: str, owner: str | None) -> str:
        """The id a session named by `owner` is kept under: its scoped id (session.scoped_id), unless
        no such session is known and the id as given is a session of this owner's (granted to its
        key by the operator, or made by it before ids were per owner)."""
        if owner is None or SCOPE in session_id:
            return session_id
        scoped = scoped_id(session_id, owner)
        if not self.known(scoped) and self.owner_of(session_id) == owner:
            return session_id
        return scoped

    def owner_of(self, session_id: str) -> str | None:
        """The owner of a known session (None: the operator's, or no such session)."""
        if session_id in self.sessions:
            return self.sessions[session_id].owner
        self.wait_for_writes(session_id)
        meta = self.store.get_meta(session_id)
        return meta.get("owner") if meta is not None else None

    def lease(self, session_id: str) -> None:
        """Take (or renew) a session's lease; `leased`, naming the holder, if another live replica
        holds it. One short store transaction: the engine thread never waits for a lease."""
        if self.leases is None:
            return
        refused = self.leases.take(session_id)
        if refused is not None:
            raise ProtocolError("leased", f"session {session_id} is held by {refused.holder.describe()}: "
                                        f"send its requests there, or wait until it releases the session")

    def disown(self, session_id: str) -> None:
        """Give back the lease of a session that did not enter memory (a lookup or creation that failed)."""
        if self.leases is not None and session_id not in self.sessions and self.leases.holds(session_id):
            self.leases.release(session_id)

    def adopt(self, session: Session) -> None:
        """Keep a new session in memory (a fleet replica leases it first: `leased` if another holds it)."""
        if self.leases is not None and not self.leases.holds(session.session_id):
            self.lease(session.session_id)
        self.sessions[session.session_id] = session

    def known(self, session_id: str) -> bool:
        """Is there a session of that id, in memory or in the store?"""
        if session_id in self.sessions:
            return True
        self.wait_for_writes(session_id)
        return self.store.get_meta(session_id) is not None

    def check_fingerprint(self, meta: dict) -> None:
        check_fingerprint(self.fingerprint, meta)

    def resident_sessions(self) -> list[Session]:
        return [s for s in self.slots if s is not None]

    # ---- slots ---------------------------------------------------------------------------

    def resident(self, session: Session) -> int:
        """Make a session resident and return its slot (evicting an idle session if needed).

        A stored session whose KV does not load whole (a missing or damaged chunk, a length that is
        not its tokens') raises StoreError and takes no slot.
        """
        if session.slot is not None:
            session.last_used = time.monotonic()
            return session.slot
        try:
            slot = self.free_slot()
        except StoreError as e:  # the victim's snapshot failed: the error is about this session's request
            new = "the new " if session.session_id not in self.sessions else ""
            raise StoreError(f"no slot for {new}session {session.session_id}: an eviction failed: {e}") from None
        engine = self.engine
        engine.rewind(slot, 0)
        if session.tokens is None or session.stored_tokens:
            self.wait_for_writes(session.session_id)  # a fork's copy, say
            began = time.perf_counter()
            try:
                meta, tokens = self.store.load(session.session_id,
                                               lambda start, data: engine.import_kv(slot, start, data),
                                               bytes_per_token=engine.kv.bytes_per_token)
                if int(engine.kv.lengths[slot]) != len(tokens):
                    raise StoreError(f"session {session.session_id} is damaged: its KV covers "
                                     f"{int(engine.kv.lengths[slot])} of its {len(tokens)} tokens")
            except BaseException:  # what a damaged session loaded before failing is scratch
                engine.rewind(slot, 0)
                raise
            self.policy.observe_swap("read", len(tokens), time.perf_counter() - began)
            session.tokens = tokens
            session.stored_tokens = len(tokens)
        self.bind(session, slot)
        return slot

    def share_prefix(self, session: Session, tokens: list[int], limit: int) -> int:
        """Fill an empty resident session's slot with the KV of the longest prefix of `tokens`
        (at most `limit`) that another session of the same owner holds, copied instead of
        prefilled; returns its length (0: nothing shared).

        Donors: the sessions in memory (a resident one's KV copied between slots, an evicted
        one's read back from the store), and every stored session of this daemon's fingerprint,
        found through the index of their leading blocks (donors.py) and read from the store up to
        the prefix, left there as it is (not resumed, not leased). The KV of a prefix depends only
        on its tokens, so the copy is what a prefill would have computed.
        """
        best, shared = self.memory_donor(session, tokens, limit)
        stored, indexed = self.donors.find(session.owner, tokens[:limit], exclude=session.session_id)
        if indexed > shared:  # a stored session holds more whole blocks of it
            copied = self.read_prefix(stored, session, tokens, limit)
            if copied >= shared:
                return copied
        if not shared:
            return 0
        if best.slot is None:
            return self.read_prefix(best.session_id, session, tokens, shared)
        self.engine.copy_slot(best.slot, session.slot, shared)
        return shared

    def memory_donor(self, session: Session, tokens: list[int], limit: int) -> tuple[Session | None, int]:
        """The session in memory holding the longest prefix of `tokens` (at most `limit`), and its length."""
        best, shared = None, 0
        for other in {id(s): s for s in [*self.resident_sessions(), *self.sessions.values()]}.values():
            if other is session or not other.tokens or other.owner != session.owner or other.tokens[0] != tokens[0]:
                continue
            held = other.tokens if other.slot is not None else other.tokens[:other.stored_tokens]
            length = min(common_prefix(held, tokens), limit)
            # at equal length, a resident donor (a copy between slots) beats a read from the store
            if length > shared or (length == shared and shared and best.slot is None and other.slot is not None):
                best, shared = other, length
        return best, shared

    def read_prefix(self, donor_id: str, session: Session, tokens: list[int], limit: int) -> int:
        """Read into the session's empty slot the KV of the longest prefix of `tokens` (at most
        `limit`) that the store holds of session `donor_id` (same owner, same fingerprint): only the
        chunks covering it. Returns its length; 0 if it holds none, or is damaged (logged)."""
        slot, per_token = session.slot, self.engine.kv.bytes_per_token
        self.wait_for_writes(donor_id)
        shared = 0
        try:
            meta, held = self.store.load(donor_id, lambda start, data: None, stop=0)
            if meta.get("owner") == session.owner and fingerprint_mismatch(self.fingerprint, meta) is None:
                shared = min(common_prefix(held, tokens), limit)
            if shared:
                _, held = self.store.load(donor_id, lambda start, data: self.engine.import_kv(slot, start, data),
                                          bytes_per_token=per_token, stop=shared)
        except StoreError as e:  # the donor's snapshot is damaged: prefill instead, the error logged
            log.error("prefix sharing: %s", e)
            held, shared = [], 0
        if int(self.engine.kv.lengths[slot]) < shared or common_prefix(held, tokens) < shared:
            shared = 0  # the store holds another version of it: prefill instead
        self.engine.rewind(slot, shared)
        return shared

    def index_store(self) -> None:
        """Index every stored session made under this daemon's fingerprint as a donor (at start:
        their token ids are read, not their KV)."""
        for meta in self.store.list_meta():
            if fingerprint_mismatch(self.fingerprint, meta) is None:
                self.reindex(meta["session_id"])

    def reindex(self, session_id: str) -> None:
        """Index a session as the store holds it as a donor (donors.py): not at all if the store
        holds none, or one made under another fingerprint."""
        self.donors.remove(session_id)
        try:
            meta, tokens = self.store.load(session_id, lambda start, data: None, stop=0)
        except StoreError:  # gone, or damaged (resuming it says so): no donor
            return
        if fingerprint_mismatch(self.fingerprint, meta) is None:
            self.donors.put(session_id, meta.get("owner"), tokens)

    def bind(self, session: Session, slot: int) -> None:
        session.slot = slot
        self.slots[slot] = session
        session.last_used = time.monotonic()

    def free_slot(self) -> int:
        """A free slot, or the slot of the idle session the policy evicts (snapshotted first)."""
        if None in self.slots:
            return self.slots.index(None)
        victim = self.policy.victim([s for s in self.slots if not s.busy])
        if victim is None:
            raise SlotsBusy()
        self.evict(victim)
        slot = victim.slot
        self.release(victim)
        log.info("evicted session %s from slot %d", victim.session_id, slot)
        return slot

    def evict(self, victim: Session) -> None:
        """Have the victim whole on disk before its slot goes to another: wait for its pending writes
        (these only), then write what they left unsaved and wait for that. A failure raises
        StoreError and the victim keeps its slot."""
        self.wait_for_writes(victim.session_id)  # a failed one leaves its part unsaved: written below
        write = self.snapshot(victim)
        if write is not None:
            self.wait_for_writes(victim.session_id)
            if write.error is not None:
                raise write.error

    def free_slot_index(self) -> int | None:
        """A free slot without evicting anyone, or None."""
        return self.slots.index(None) if None in self.slots else None

    def release(self, session: Session) -> None:
        """Free a session's slot (its KV there is left to the next owner)."""
        if session.slot is not None:
            self.slots[session.slot], session.slot = None, None

    def forget(self, session: Session) -> StoreWrite | None:
        """Drop a session from memory (and its slot); the store keeps what it holds. A fleet
        replica gives its lease back once its writes queued so far have run: returns that write."""
        self.release(session)
        self.sessions.pop(session.session_id, None)
        if self.leases is None:
            return None
        session_id, leases = session.session_id, self.leases
        release = StoreWrite("release", session_id, lambda store: {"released": leases.release(session_id)})
        return self.writer.submit(release)

    # ---- the store -----------------------------------------------------------------------

    def snapshot(self, session: Session, upto: int | None = None) -> StoreWrite | None:
        """Queue a write of a session's changed chunks and metadata; returns it (None: nothing to
        write). upto: while the session is busy, the length of its last whole turn (what a
        generation adds joins the next snapshot).

        The KV of each chunk from the first that may have changed is copied here, so the writer never
        reads the slot (which may be another session's by the time it runs). Once queued, the
        session counts as stored: a write that fails puts that back (settle).
        """
        tokens = session.tokens if upto is None or session.tokens is None else session.tokens[:upto]
        if tokens is None or (not session.dirty and session.stored_tokens == len(tokens) and upto is None):
            return None
        meta = copy.deepcopy(session.stored_meta())  # the session goes on changing meanwhile
        where = unstorable(meta)
        if where is not None:  # let past the validation layer by a bug: no snapshot could ever hold it
            self.forget(session)  # never a slot pinned by a session that can be neither written nor evicted
            raise EllmError(f"session {session.session_id} cannot be stored ({where}: {UNSTORABLE}); "
                            "it was dropped from memory")
        if upto is not None:  # during a generation, pending tokens are in the KV already
            meta["pending"] = []
        tokens, stored, per_token = list(tokens), min(session.stored_tokens, len(tokens)), self.engine.kv.bytes_per_token
        chunks = {}  # start -> KV of the chunk's tokens (each chunk laid out on its own, as the store keeps it)
        if session.slot is not None:
            for start in range(stored // CHUNK_TOKENS * CHUNK_TOKENS, len(tokens), CHUNK_TOKENS):
                chunks[start] = self.engine.export_kv(session.slot, start, min(start + CHUNK_TOKENS, len(tokens)))
        session_id, resident = session.session_id, session.slot is not None

        def export(start, stop):  # on the writer thread
            if start not in chunks:
                raise InvariantError(f"session {session_id}'s KV for tokens [{start}, {stop}) was not copied for "
                                     f"this snapshot" if resident else f"session {session_id} is not resident")
            return chunks[start]

        write = StoreWrite("snapshot", session_id, lambda store: store.snapshot(meta, tokens, export, stored, per_token),
                           stored_tokens=stored)
        session.stored_tokens = len(tokens)
        session.dirty = upto is not None  # the busy turn is still to be written
        self.donors.put(session_id, meta.get("owner"), tokens)  # as the store holds it once written (settle, if not)
        return self.writer.submit(write)

    def settle(self, write: StoreWrite) -> None:
        """Account for a write that has run, on the engine thread, once. A failed one is logged (and
        reported to whoever waits for it), and its session counts as stored only as far as it did
        before: its next snapshot writes the rest again."""
        if write.settled:
            return
        write.settled = True
        if write.kind == "delete" or (write.kind == "snapshot" and write.error is None):
            self.unsaved.pop(write.session_id, None)
        indexed = write.kind == "copy" or (write.error is not None and write.kind in ("snapshot", "delete"))
        if indexed and not self.pending_writes(write.session_id):
            self.reindex(write.session_id)  # a fork's copy as stored; a failed write left the store as it was
        if write.error is None:
            if write.kind == "snapshot":
                self.policy.observe_swap("write", write.result["bytes_written"] // self.engine.kv.bytes_per_token,
                                         write.seconds)
            return
        log.error("%s", write.error)  # it names the session
        session = self.sessions.get(write.session_id)
        if session is None:
            return
        if write.kind == "snapshot":
            session.stored_tokens = min(session.stored_tokens, write.stored_tokens)
            session.dirty = True
            self.unsaved[write.session_id] = write.error
        elif write.kind == "copy" and session.tokens is None:
            self.forget(session)  # a fork whose copy failed does not exist

    def wait_for_writes(self, session_id: str) -> list[StoreWrite]:
        """Block until the writes queued for that session have run (settled here); returns them."""
        writes = self.writer.wait(session_id)
        for write in writes:
            self.settle(write)
        return writes

    def pending_writes(self, session_id: str) -> list[StoreWrite]:
        return self.writer.pending_of(session_id)

    def put_note(self, session_id: str, name: str, note: dict | None) -> StoreWrite:
        """Queue the write of a note kept with a session's point (None: its removal)."""
        return self.writer.submit(StoreWrite("note", session_id, lambda store: store.put_note(session_id, name, note)))

    def note(self, session_id: str, name: str) -> dict | None:
        self.wait_for_writes(session_id)
        return self.store.get_note(session_id, name)

    def delete(self, session: Session) -> StoreWrite:
        """Queue a session's removal from the store; the caller forgets it next (a fleet replica's
        lease then goes after the removal)."""
        session_id = session.session_id
        write = self.writer.submit(StoreWrite("delete", session_id, lambda store: store.delete(session_id)))
        self.donors.remove(session_id)
        return write

    def fork(self, source: Session, fork: Session) -> StoreWrite:
        """Queue a copy of source as stored (snapshotted before) under fork's id; fork loads it on use."""
        meta = copy.deepcopy(fork.stored_meta())
        write = StoreWrite("copy", fork.session_id, lambda store: store.copy(source.session_id, fork.session_id, meta))
        fork.tokens, fork.stored_tokens, fork.dirty = None, source.stored_tokens, False
        self.adopt(fork)
        return self.writer.submit(write)

    def close(self) -> None:
        """Run every write queued, then end the writer thread (the engine thread settles them); a
        fleet replica then gives back every lease it holds."""
        self.writer.close()
        if self.leases is not None:
            self.leases.stop()
            self.leases.release_all()

    def stored_meta(self, session_id: str) -> dict | None:
        self.wait_for_writes(session_id)
        return self.store.get_meta(session_id)

    def stored_tokens(self, session_id: str) -> list[int]:
        """A stored session's token ids, read without its KV."""
        self.wait_for_writes(session_id)
        return self.store.load(session_id, lambda start, data: None, stop=0)[1]

    def export(self, session_id: str) -> bytes:
        self.wait_for_writes(session_id)
        return self.store.export_blob(session_id)

    def import_blob(self, data: bytes, owner: str | None) -> dict:
        kv = self.engine.kv
        meta = self.store.import_blob(data, check=self.check_fingerprint, vocab_size=self.engine.spec.vocab_size,
                                      bytes_per_token=kv.bytes_per_token, owner=owner)
        self.reindex(meta["session_id"])
        return meta

    def list(self, owner: str | None) -> list[dict]:
        """Every session visible to `owner`: stored ones (as `listing` keeps them: parsed once per
        version), then the newer state of those in memory."""
        for session_id in self.writer.pending_ids():  # closed or deleted: read the store as they left it
            if session_id not in self.sessions:
                self.wait_for_writes(session_id)
        listed = {info["session_id"]: dict(info) for info in self.listing.read(self.store)
                  if visible(info["owner"], owner)}
        for session in self.sessions.values():
            if session.tokens is not None and visible(session.owner, owner):
                listed[session.session_id] = session.info(resident=session.slot is not None, with_turns=False)
        return sorted(listed.values(), key=lambda s: s["updated"], reverse=True)

    def stats(self) -> dict:
        kv = self.engine.kv
        used = int(sum(kv.lengths[s.slot] for s in self.resident_sessions()))
        return {
            "slots": kv.slots, "sequence_length": kv.sequence_length, "kv_bytes": kv.nbytes,
            "kv_bytes_per_token": kv.bytes_per_token, "kv_bytes_used": used * kv.bytes_per_token,
            "kv_bytes_free": kv.nbytes - used * kv.bytes_per_token,
            "sessions_resident": len(self.resident_sessions()), "sessions_stored": self.store.count(),
            "store": self.store.stats(), "replica": self.leases.holder.replica if self.leases else None,
            **kv_capacity(self.engine, self.store.stats().get("path")),
        }


class StoredListing:
    """The list-info of every stored session, each parsed once per version of its metadata: a
    listing costs a read of the store's raw metadata, or nothing while no write was committed
    (the store's version, which every process writing it moves)."""

    def __init__(self):
        self.version = None
        self.infos: dict[str, tuple[bytes, dict | None]] = {}  # id -> (digest of its metadata, list-info; None: damaged)

    def read(self, store: SessionStore) -> list[dict]:
        version = store.version()  # taken before reading: a write committed meanwhile is read next time
        if version is None or version != self.version:
            self.infos = {session_id: self.parsed(session_id, raw) for session_id, raw in store.raw_metas()}
            self.version = version
        return [info for _, info in self.infos.values() if info is not None]

    def parsed(self, session_id: str, raw: bytes) -> tuple[bytes, dict | None]:
        digest = checksum(raw)
        cached = self.infos.get(session_id)
        if cached is not None and cached[0] == digest:
            return cached
        try:
            meta = parse_meta(session_id, raw)
        except StoreError as e:
            log.error("not listed: %s", e)
            return digest, None
        info = Session.from_stored(meta, []).info(resident=False, with_turns=False)
        info["tokens"] = meta["tokens"] + len(meta.get("pending", []))
        return digest, info


def kv_capacity(engine, store_path: str | None) -> dict:
    """The KV format, and per format the tokens per GiB and the sessions of the configured length
    that the KV memory and the store's free disk space would hold."""
    from ellmd.engine.kvcache import capacity
    from ellmd.kernels.kv_blocks import format_name

    spec, kv = engine.spec, engine.kv
    try:
        disk = shutil.disk_usage(store_path).free if store_path else 0
    except OSError:
        disk = 0
    return {"kv_dtype": format_name(kv.fmt), "kv_capacity": capacity(
        spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim, kv.sequence_length, kv.nbytes, disk)}


def visible(stored_owner: str | None, owner: str | None) -> bool:
    """May a request by `owner` name a session stored with `stored_owner`? The operator (owner None:
    the Unix socket, an admin key, HTTP without keys) reaches every session; a key only its own, not
    the operator's (made over the socket, or before keys were set) unless granted (session.grant)."""
    return owner is None or stored_owner == owner


def check_fingerprint(ours: dict, meta: dict) -> None:
    """Refuse a stored session whose KV was made under another model, tokenizer, template or layout."""
    part = fingerprint_mismatch(ours, meta)
    if part is not None:
        raise ProtocolError(
            "fingerprint",
            f"session {meta['session_id']} was made under another {part} "
            f"({meta.get('fingerprint', {}).get(part)} != {ours[part]}); it cannot be resumed by this daemon",
        )


def fingerprint_mismatch(ours: dict, meta: dict) -> str | None:
    """The first part of a stored session's fingerprint that is not ours (None: its KV is ours to use)."""
    theirs = meta.get("fingerprint", {})
    return next((part for part in ("model", "tokenizer", "template", "kv") if theirs.get(part) != ours[part]), None)


def model_fingerprint(engine) -> dict:
    """What a session's KV depends on: model and weight precision, tokenizer, template, KV layout."""
    from ellmd.engine.calibration import digest as key_mean_digest
    from ellmd.kernels.formats import FORMAT_NAMES
    from ellmd.kernels.kv_blocks import format_name

    names = {v: k for k, v in FORMAT_NAMES.items()}
    spec = engine.spec
    model = hashlib.sha256(repr((dataclasses.asdict(spec), names[engine.fmt], engine.weights_digest)).encode())
    template = engine.chat_template.source if engine.chat_template else ""
    kv = f"{format_name(engine.kv.fmt)}:{spec.num_hidden_layers}x{spec.num_key_value_heads}x{spec.head_dim}"
    if engine.kv.key_mean.size:  # keys stored less a calibrated mean: it is part of their meaning
        kv += f":m{key_mean_digest(engine.kv.key_mean)}"
    return {
        "model": model.hexdigest()[:16],
        "tokenizer": engine.tokenizer.fingerprint()[:16] if engine.tokenizer else "none",
        "template": hashlib.sha256(template.encode()).hexdigest()[:16],
        "kv": kv,
    }
