"""Snapshots off the engine thread: the Runtime over the built-in SmolLM2 engine and a real store,
whose writes for one session are held by a gate (an Event) while the rest of the daemon goes on.

Each test checks the order the writer promises (a decode never waits for another session's
snapshot; fork, delete and eviction of a session come after its pending write) and that what
lands on disk resumes bit for bit (the next token's log-probabilities equal a recompute's).
"""

from __future__ import annotations

import threading
import time

import pytest

from ellmd.errors import EllmError
from ellmd.runtime.runtime import ProtocolError, Runtime
from ellmd.runtime.store.lmdb import CHUNK_TOKENS, Store, StoreError

GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
NEXT = {"max_tokens": 1, "temperature": 0, "logprobs": 5}


def call(rt, op, **args):
    return rt.submit(op, args).future.result(timeout=120)


class Gate:
    """Stands in for Store.snapshot: holds the snapshots of one session until `release` is set."""

    def __init__(self, store, session_id: str):
        self.real, self.session_id = store.snapshot, session_id
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, meta, *args, **kwargs):
        if meta["session_id"] == self.session_id:
            self.entered.set()
            assert self.release.wait(120)
        return self.real(meta, *args, **kwargs)


def hold(rt, monkeypatch, session_id: str) -> Gate:
    """Hold the session's writes queued from now on; those queued before run first (on a busy
    machine the writer may not have reached them yet)."""
    rt.residency.writer.wait(session_id)
    gate = Gate(rt.store, session_id)
    monkeypatch.setattr(rt.store, "snapshot", gate)
    return gate


def computed(rt, tokens: list[int]) -> list:
    """The next token's log-probabilities after `tokens`, prefilled in a new session (deleted
    after, so that no later session copies its prefix)."""
    fresh = call(rt, "session.open")["session_id"]
    call(rt, "session.append", session_id=fresh, tokens=tokens)
    logprobs = call(rt, "session.generate", session_id=fresh, **NEXT)["logprobs"]
    call(rt, "session.delete", session_id=fresh)
    return logprobs


def stored_kv(store, session_id: str) -> bytes:
    kv = bytearray()
    store.load(session_id, lambda start, data: kv.extend(data))
    return bytes(kv)


def test_a_decode_goes_on_while_another_sessions_snapshot_is_held(start, monkeypatch):
    rt = start(snapshot_ack="written")
    a = call(rt, "session.open")["session_id"]
    b = call(rt, "session.open", system="Be brief.")["session_id"]
    call(rt, "session.append", session_id=b, message={"role": "user", "content": "Count to five."})
    reference = call(rt, "session.generate", session_id=b, **GREEDY)["token_ids"]
    call(rt, "session.rewind", session_id=b, turn=2)  # back to before the generation

    gate = hold(rt, monkeypatch, a)
    appended = rt.submit("session.append", {"session_id": a, "text": "Words the writer holds."})
    assert gate.entered.wait(60)
    streamed = []
    generated = rt.submit("session.generate", {"session_id": b, **GREEDY},
                          lambda event, data: streamed.extend(data["token_ids"]) if event == "token" else None)
    deadline = time.monotonic() + 120
    while len(streamed) < GREEDY["max_tokens"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert streamed == reference  # every token decoded while a's write was held
    # Acknowledged once on disk: a's turn, and b's too, whose write is queued behind a's.
    assert not appended.future.done() and not generated.future.done()
    assert rt.store.get_meta(a)["tokens"] == 0
    gate.release.set()
    assert generated.future.result(timeout=60)["token_ids"] == reference
    tokens = appended.future.result(timeout=60)["tokens"]
    assert rt.store.get_meta(a)["tokens"] == tokens == call(rt, "session.info", session_id=a)["tokens"]
    assert len(rt.store.get_meta(b)["turns"]) == 3  # system, user, the generation


def test_fork_and_delete_come_after_the_pending_write(start, monkeypatch):
    rt = start(snapshot_ack="written")
    a = call(rt, "session.open")["session_id"]
    call(rt, "session.append", session_id=a, text="The first turn, stored.")
    gate = hold(rt, monkeypatch, a)
    appended = rt.submit("session.append", {"session_id": a, "text": " A second turn, held by the writer."})
    assert gate.entered.wait(60)
    forked = rt.submit("session.fork", {"session_id": a})
    time.sleep(0.3)
    assert not forked.future.done()  # it waits for a's write
    gate.release.set()
    tokens = appended.future.result(timeout=60)["tokens"]
    fork = forked.future.result(timeout=60)["session_id"]
    assert rt.store.get_meta(fork)["tokens"] == tokens  # the fork holds the second turn
    expected = call(rt, "session.generate", session_id=a, **NEXT)["logprobs"]
    assert call(rt, "session.generate", session_id=fork, **NEXT)["logprobs"] == expected

    gate = hold(rt, monkeypatch, fork)
    appended = rt.submit("session.append", {"session_id": fork, "text": " More."})
    assert gate.entered.wait(60)
    deleted = rt.submit("session.delete", {"session_id": fork})
    time.sleep(0.3)
    assert not deleted.future.done()
    gate.release.set()
    appended.future.result(timeout=60)
    deleted.future.result(timeout=60)
    assert rt.store.get_meta(fork) is None  # the delete ran after the snapshot, not before
    with pytest.raises(ProtocolError) as raised:
        call(rt, "session.info", session_id=fork)
    assert raised.value.code == "not_found"


def test_queued_acks_eviction_waits_and_a_restart_resumes_bit_for_bit(start, monkeypatch):
    rt = start(snapshot_ack="queued")
    prompt = [(7 * i) % 40000 + 100 for i in range(260)]  # a partial second chunk
    expected = computed(rt, prompt)  # from scratch: nobody holds these tokens yet
    a = call(rt, "session.open")["session_id"]
    b = call(rt, "session.open")["session_id"]
    call(rt, "session.append", session_id=b, tokens=list(range(2000, 2020)))
    gate = hold(rt, monkeypatch, a)
    assert call(rt, "session.append", session_id=a, tokens=prompt)["tokens"] == 260  # acknowledged, queued
    assert gate.entered.wait(60) and rt.store.get_meta(a)["tokens"] == 0
    call(rt, "session.append", session_id=b, tokens=[7, 8, 9])  # a is now the least recently used
    # A third session needs a slot: a is evicted, after its pending write (the engine waits for it).
    third = rt.submit("session.append", {"session_id": call(rt, "session.open")["session_id"], "tokens": [5, 6]})
    time.sleep(0.3)
    assert not third.future.done()
    gate.release.set()
    third.future.result(timeout=60)
    assert rt.sessions[a].slot is None and rt.store.get_meta(a)["tokens"] == 260

    # A write that fails is logged, and the next snapshot writes what it left unsaved.
    real = rt.store.snapshot

    def failing_once(meta, *args, **kwargs):
        if meta["session_id"] == b and not failed.is_set():
            failed.set()
            raise StoreError("injected: disk on fire")
        return real(meta, *args, **kwargs)

    failed = threading.Event()
    monkeypatch.setattr(rt.store, "snapshot", failing_once)
    call(rt, "session.append", session_id=b, tokens=list(range(3000, 3030)))  # acknowledged; its write fails
    assert failed.wait(60)
    tokens_b = call(rt, "session.append", session_id=b, tokens=[11, 12])["tokens"]
    slot = rt.sessions[b].slot  # the engine is idle: read b's KV as the store lays it out, chunk by chunk
    kv_b = b"".join(rt.engine.export_kv(slot, start, min(start + CHUNK_TOKENS, tokens_b)).tobytes()
                    for start in range(0, tokens_b, CHUNK_TOKENS))

    start.stop(rt)  # shutdown flushes every pending write
    rt = start(snapshot_ack="queued")
    assert rt.store.get_meta(b)["tokens"] == tokens_b and stored_kv(rt.store, b) == kv_b
    assert call(rt, "session.generate", session_id=a, **NEXT)["logprobs"] == expected


def test_an_unknown_acknowledgement_point_is_refused(engine, tmp_path):
    store = Store(tmp_path / "store")
    with pytest.raises(EllmError, match="snapshot_ack must be one of written, queued, not 'sometimes'"):
        Runtime(engine, store, snapshot_ack="sometimes")
    store.close()


def listed(rt) -> dict:
    return {s["session_id"]: s for s in call(rt, "session.list")["sessions"]}


def test_the_session_list_parses_each_stored_version_once_and_follows_every_change(start, monkeypatch):
    """session.list keeps the stored sessions' list-info between calls (parsing 200 metadata on the
    engine thread at every refresh of a console delayed the generating sessions): what changes in the
    store after a listing shows in the next one, whoever wrote it, and a restart lists the same."""
    from ellmd.runtime import residency

    rt = start(snapshot_ack="queued")
    ids = [call(rt, "session.open", title=f"s{i}", system="Be brief.")["session_id"] for i in range(3)]
    for sid in ids:
        call(rt, "session.close", session_id=sid)
    parsed = []
    real_parse = residency.parse_meta
    monkeypatch.setattr(residency, "parse_meta", lambda sid, raw: parsed.append(sid) or real_parse(sid, raw))
    first = listed(rt)
    assert {sid: (s["title"], s["resident"], s["turn_count"]) for sid, s in first.items()} == \
        {sid: (f"s{i}", False, 1) for i, sid in enumerate(ids)}
    assert sorted(parsed) == sorted(ids)
    parsed.clear()
    assert listed(rt) == first and parsed == []  # nothing changed: nothing parsed

    # A snapshot: resident, the list shows the session in memory; closed, as stored (not as cached).
    a, b, c = ids
    tokens = call(rt, "session.append", session_id=a, message={"role": "user", "content": "Hello."})["tokens"]
    call(rt, "session.snapshot", session_id=a)
    assert (listed(rt)[a]["tokens"], listed(rt)[a]["resident"]) == (tokens, True)
    call(rt, "session.close", session_id=a)
    assert (listed(rt)[a]["tokens"], listed(rt)[a]["turn_count"], listed(rt)[a]["resident"]) == (tokens, 2, False)
    assert set(parsed) == {a}  # only the one that changed

    # Another writer (a fleet replica) renames b in the store.
    meta = rt.store.get_meta(b)
    held = rt.store.load(b, lambda start, data: None, stop=0)[1]
    rt.store.snapshot({**meta, "title": "renamed"}, held, None, len(held))
    assert listed(rt)[b]["title"] == "renamed"

    # A delete queued behind a held snapshot (acknowledged at once): the list waits for both.
    gate = hold(rt, monkeypatch, c)
    call(rt, "session.append", session_id=c, text=" More.")
    assert gate.entered.wait(60)
    call(rt, "session.delete", session_id=c)
    listing = rt.submit("session.list", {})
    time.sleep(0.3)
    assert not listing.future.done()
    gate.release.set()
    assert set(s["session_id"] for s in listing.future.result(timeout=60)["sessions"]) == {a, b}

    # An import, then a restart: listed as before.
    blob = call(rt, "session.export", session_id=a)["blob"]
    call(rt, "session.delete", session_id=a)
    assert set(listed(rt)) == {b}
    imported = call(rt, "session.import", data=blob)["session_id"]
    before = listed(rt)
    assert set(before) == {b, imported} and before[imported]["tokens"] == tokens
    start.stop(rt)
    rt = start(snapshot_ack="queued")
    assert listed(rt) == before
