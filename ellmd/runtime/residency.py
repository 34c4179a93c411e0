"""Residency: which sessions hold a KV slot, eviction, snapshots. The only code that talks to the store.

At most `slots` sessions are resident. A session that is needed and not resident takes a free
slot, or the slot of the idle session the scheduler policy picks (snapshotted first); with every
slot busy, SlotsBusy: the request waits. Sessions known to this daemon but not resident keep
`tokens = None` until their KV loads back from the store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time

from ellmd.errors import CapacityError
from ellmd.runtime.errors import RuntimeError_, SlotsBusy, not_found
from ellmd.runtime.session import Session, common_prefix
from ellmd.runtime.store import Store, StoreError

log = logging.getLogger("ellmd.runtime")


class Residency:
    """Sessions by id, the slot each resident one holds, and their snapshots in the store."""

    def __init__(self, engine, store: Store, policy):
        self.engine = engine
        self.store = store
        self.policy = policy  # picks the idle session to evict (scheduler.Policy.victim)
        self.fingerprint = model_fingerprint(engine)
        self.sessions: dict[str, Session] = {}
        self.slots: list[Session | None] = [None] * engine.kv.slots

    # ---- finding sessions ----------------------------------------------------------------

    def session(self, session_id: str, owner: str | None = None) -> Session:
        """The session named by a request (its metadata loaded from the store if need be). A
        session stored with an owner is found only by that owner's requests, or by requests without one."""
        session = self.sessions.get(session_id)
        if session is None:
            meta = self.store.get_meta(session_id)
            if meta is None or not visible(meta.get("owner"), owner):
                raise not_found(session_id)
            self.check_fingerprint(meta)
            session = Session.from_stored(meta, [])
            session.stored_tokens = meta["tokens"]
            session.tokens = None  # loaded with the KV on resume
            self.sessions[session_id] = session
        if not visible(session.owner, owner):
            raise not_found(session_id)
        return session

    def known(self, session_id: str) -> bool:
        """Is there a session of that id, in memory or in the store?"""
        return session_id in self.sessions or self.store.get_meta(session_id) is not None

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
        slot = self.free_slot()
        engine = self.engine
        engine.rewind(slot, 0)
        if session.tokens is None or session.stored_tokens:
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

        Donors: the resident sessions (a copy between slots), else the sessions this daemon
        evicted, whose KV is on disk (read back from the store up to the prefix: a session
        evicted to make room for this one is among them). The KV of a prefix depends only on its
        tokens, so the copy is what a prefill would have computed.
        """
        slot = session.slot
        best, shared = None, 0
        for other in {id(s): s for s in [*self.resident_sessions(), *self.sessions.values()]}.values():
            if other is session or not other.tokens or other.owner != session.owner or other.tokens[0] != tokens[0]:
                continue
            held = other.tokens if other.slot is not None else other.tokens[:other.stored_tokens]
            length = min(common_prefix(held, tokens), limit)
            # at equal length, a resident donor (a copy between slots) beats a read from the store
            if length > shared or (length == shared and shared and best.slot is None and other.slot is not None):
                best, shared = other, length
        if not shared:
            return 0
        if best.slot is not None:
            self.engine.copy_slot(best.slot, slot, shared)
            return shared
        try:
            _, stored = self.store.load(best.session_id, lambda start, data: self.engine.import_kv(slot, start, data),
                                        bytes_per_token=self.engine.kv.bytes_per_token, stop=shared)
        except StoreError as e:  # the donor's snapshot is damaged: prefill instead, the error logged
            log.error("prefix sharing: %s", e)
            self.engine.rewind(slot, 0)
            return 0
        if int(self.engine.kv.lengths[slot]) < shared or common_prefix(stored, tokens) < shared:
            self.engine.rewind(slot, 0)  # the store holds another version of it: prefill instead
            return 0
        self.engine.rewind(slot, shared)
        return shared

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
        self.snapshot(victim)
        slot = victim.slot
        self.release(victim)
        log.info("evicted session %s from slot %d", victim.session_id, slot)
        return slot

    def free_slot_index(self) -> int | None:
        """A free slot without evicting anyone, or None."""
        return self.slots.index(None) if None in self.slots else None

    def release(self, session: Session) -> None:
        """Free a session's slot (its KV there is left to the next owner)."""
        if session.slot is not None:
            self.slots[session.slot], session.slot = None, None

    def forget(self, session: Session) -> None:
        """Drop a session from memory (and its slot); the store keeps what it holds."""
        self.release(session)
        self.sessions.pop(session.session_id, None)

    # ---- the store -----------------------------------------------------------------------

    def snapshot(self, session: Session, upto: int | None = None) -> dict:
        """Write a session's changed chunks and metadata. upto: while the session is busy, the
        length of its last whole turn (what a generation adds joins the next snapshot)."""
        tokens = session.tokens if upto is None or session.tokens is None else session.tokens[:upto]
        if tokens is None or (not session.dirty and session.stored_tokens == len(tokens) and upto is None):
            return {"chunks_written": 0, "bytes_written": 0, "stored_tokens": session.stored_tokens}
        meta = session.stored_meta()
        if upto is not None:  # during a generation, pending tokens are in the KV already
            meta["pending"] = []
        slot = session.slot

        def export(start, stop):
            if slot is None:
                raise CapacityError(f"session {session.session_id} is not resident")
            return self.engine.export_kv(slot, start, stop)

        began = time.perf_counter()
        result = self.store.snapshot(meta, tokens, export, session.stored_tokens, self.engine.kv.bytes_per_token)
        self.policy.observe_swap("write", result["bytes_written"] // self.engine.kv.bytes_per_token,
                                 time.perf_counter() - began)
        session.stored_tokens = result["stored_tokens"]
        session.dirty = upto is not None  # the busy turn is still to be written
        return result

    def delete(self, session: Session) -> None:
        self.forget(session)
        self.store.delete(session.session_id)

    def fork(self, source: Session, fork: Session) -> None:
        """Store a copy of source (snapshotted before) under fork's id; fork loads it on use."""
        self.store.copy(source.session_id, fork.session_id, fork.stored_meta())
        fork.tokens, fork.stored_tokens, fork.dirty = None, source.stored_tokens, False
        self.sessions[fork.session_id] = fork

    def stored_meta(self, session_id: str) -> dict | None:
        return self.store.get_meta(session_id)

    def export(self, session_id: str) -> bytes:
        return self.store.export_blob(session_id)

    def import_blob(self, data: bytes, owner: str | None) -> dict:
        kv = self.engine.kv
        return self.store.import_blob(data, check=self.check_fingerprint, vocab_size=self.engine.spec.vocab_size,
                                      bytes_per_token=kv.bytes_per_token, owner=owner)

    def list(self, owner: str | None) -> list[dict]:
        """Every session visible to `owner`: stored ones, then the newer state of those in memory."""
        listed = {}
        for meta in self.store.list_meta():
            if visible(meta.get("owner"), owner):
                info = Session.from_stored(meta, []).info(resident=False, with_turns=False)
                info["tokens"] = meta["tokens"] + len(meta.get("pending", []))
                listed[meta["session_id"]] = info
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
            "store": self.store.stats(),
        }


def visible(stored_owner: str | None, owner: str | None) -> bool:
    """May a request by `owner` name a session stored with `stored_owner`? (None: no restriction)"""
    return stored_owner is None or owner is None or stored_owner == owner


def check_fingerprint(ours: dict, meta: dict) -> None:
    """Refuse a stored session whose KV was made under another model, tokenizer, template or layout."""
    theirs = meta.get("fingerprint", {})
    for part in ("model", "tokenizer", "template", "kv"):
        if theirs.get(part) != ours[part]:
            raise RuntimeError_(
                "fingerprint",
                f"session {meta['session_id']} was made under another {part} "
                f"({theirs.get(part)} != {ours[part]}); it cannot be resumed by this daemon",
            )


def model_fingerprint(engine) -> dict:
    """What a session's KV depends on: model and weight precision, tokenizer, template, KV layout."""
    from ellmd.kernels.formats import FORMAT_NAMES

    names = {v: k for k, v in FORMAT_NAMES.items()}
    spec = engine.spec
    model = hashlib.sha256(repr((dataclasses.asdict(spec), names[engine.fmt], engine.weights_digest)).encode())
    template = engine.chat_template.source if engine.chat_template else ""
    return {
        "model": model.hexdigest()[:16],
        "tokenizer": engine.tokenizer.fingerprint()[:16] if engine.tokenizer else "none",
        "template": hashlib.sha256(template.encode()).hexdigest()[:16],
        "kv": f"{names[engine.kv.fmt]}:{spec.num_hidden_layers}x{spec.num_key_value_heads}x{spec.head_dim}",
    }
