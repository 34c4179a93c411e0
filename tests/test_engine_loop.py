"""The engine loop cannot die: the Runtime in process, over the built-in SmolLM2 engine and a real store.

Requests here are put straight on the engine queue (past the validation layer, which would refuse
them) or meet injected faults, to prove the second line of defence: one failing generation ends
alone, the loop's own failure snapshots every session, shutdown answers everyone.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from ellmd.engine.sampling import Sampler, SamplingParams
from ellmd.errors import EllmError
from ellmd.runtime.ops import Op
from ellmd.runtime.schemas import NoArgs
from ellmd.runtime.runtime import ProtocolError, Request, Runtime
from ellmd.runtime.store.lmdb import Store, StoreError


def call(rt, op, **args):
    return rt.submit(op, args).future.result(timeout=120)


def raw(rt, op, **args) -> Request:
    """A request past the validation layer, as a bug in it would let through."""
    request = Request(op, args)
    rt.queue.put(request)
    return request


def test_a_generation_that_raises_ends_alone_and_leaves_its_session_as_it_was(runtime):
    a = call(runtime, "session.open", system="Be brief.")["session_id"]
    b = call(runtime, "session.open", system="Be brief.")["session_id"]
    call(runtime, "session.chat", session_id=a, content="Hi.", max_tokens=3)
    before = call(runtime, "session.info", session_id=a)
    expected = call(runtime, "session.chat", session_id=b, content="Count to five.", max_tokens=12)
    call(runtime, "session.rewind", session_id=b, turn=1)
    # Sampler bugs of every kind the issue measured, first token and later ones; and one healthy
    # generation beside them that must not notice.
    bad = [{"logit_bias": {99999999: 1.0}}, {"stop_token_ids": 5}, {"top_k": 2.5, "temperature": 0.8},
           {"presence_penalty": "x"}]  # the last fails on its second token
    failing = [raw(runtime, "session.generate", session_id=a, max_tokens=8, **args) for args in bad]
    healthy = runtime.submit("session.chat", {"session_id": b, "content": "Count to five.", "max_tokens": 12})
    for request in failing:
        with pytest.raises(ProtocolError) as raised:
            request.future.result(timeout=120)
        assert raised.value.code in ("internal", "bad_request")
    assert healthy.future.result(timeout=120)["token_ids"] == expected["token_ids"]
    assert call(runtime, "session.info", session_id=a)["turns"] == before["turns"]
    assert call(runtime, "session.chat", session_id=a, content="Again.", max_tokens=3)["token_ids"]


def test_a_later_token_that_raises_ends_only_that_generation(runtime, monkeypatch):
    a = call(runtime, "session.open", system="Be brief.")["session_id"]
    b = call(runtime, "session.open", system="Be brief.")["session_id"]
    before = call(runtime, "session.info", session_id=a)
    real = Sampler.__call__

    def faulty(self, logits):
        if self.params.seed == 13 and len(self.counts) >= 3:
            raise FloatingPointError("injected: NaN probabilities")
        return real(self, logits)

    monkeypatch.setattr(Sampler, "__call__", faulty)
    failing = runtime.submit("session.chat", {"session_id": a, "content": "Tell a story.", "max_tokens": 40,
                                              "seed": 13, "temperature": 0.8, "ignore_eos": True})
    healthy = runtime.submit("session.chat", {"session_id": b, "content": "Tell a story.", "max_tokens": 20,
                                              "ignore_eos": True})
    with pytest.raises(ProtocolError, match="the generation failed: FloatingPointError") as raised:
        failing.future.result(timeout=120)
    assert raised.value.code == "internal"
    assert len(healthy.future.result(timeout=120)["token_ids"]) == 20
    after = call(runtime, "session.info", session_id=a)
    assert after["turns"] == before["turns"] and after["tokens"] == before["tokens"]  # the user turn went too


def test_the_loop_failing_snapshots_every_session_and_answers_everyone(engine, tmp_path, monkeypatch):
    for slot in range(engine.kv.slots):
        engine.rewind(slot, 0)
    store = Store(tmp_path / "store")
    rt = Runtime(engine, store, snapshot_every_turn=False)
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(EllmError, rt.run)), daemon=True)
    thread.start()
    sid = call(rt, "session.open")["session_id"]
    call(rt, "session.append", session_id=sid, text="Nothing of this is stored yet.")
    assert store.get_meta(sid) is None or store.get_meta(sid)["tokens"] == 0

    release, fail = threading.Event(), threading.Event()
    real_retry = rt._retry_waiting

    def retry():
        if fail.is_set():
            raise MemoryError("injected")
        real_retry()

    def stats(rt, request):
        release.wait(60)
        return {}

    monkeypatch.setattr(rt, "_retry_waiting", retry)
    monkeypatch.setitem(rt.ops, "stats", Op("stats", NoArgs, stats, "admin"))
    held = rt.submit("stats", {})  # holds the loop while two more requests queue behind it
    waiting = [rt.submit("session.info", {"session_id": sid}) for _ in range(2)]
    fail.set()
    release.set()
    thread.join(60)
    assert held.future.result(timeout=5) == {}
    assert "the engine loop failed (MemoryError: injected)" in str(errors[0].value)
    for request in waiting:
        with pytest.raises(ProtocolError, match="shutting down"):
            request.future.result(timeout=5)
    assert store.get_meta(sid)["tokens"] > 0  # snapshotted on the way out
    store.close()


def test_shutdown_snapshots_every_session_even_when_one_fails(runtime, monkeypatch):
    a = call(runtime, "session.open")["session_id"]
    b = call(runtime, "session.open")["session_id"]
    runtime.snapshot_every_turn = False
    for sid in (a, b):
        call(runtime, "session.append", session_id=sid, text="Unsaved words.")
    real = runtime.store.snapshot

    def failing(meta, *args, **kwargs):
        if meta["session_id"] == a:
            raise StoreError("injected: disk on fire")
        return real(meta, *args, **kwargs)

    monkeypatch.setattr(runtime.store, "snapshot", failing)
    runtime.stop(timeout=60)
    assert runtime.store.get_meta(b)["tokens"] > 0
    assert list(runtime.unsaved) == [a]  # what the daemon names as it exits 1
    with pytest.raises(ProtocolError, match="shutting down"):
        runtime.submit("session.info", {"session_id": b}).future.result(timeout=5)


@pytest.mark.parametrize("params", [
    {"temperature": 1e-40}, {"temperature": 1e-40, "top_p": 0.5, "min_p": 0.1}, {"temperature": 0.7, "logit_bias": {3: math.inf}},
    {"temperature": 0.7, "presence_penalty": -1e308}, {"temperature": 0.7, "repetition_penalty": 1e-300},
    {"temperature": 1.0, "logit_bias": {i: -math.inf for i in range(100)}}, {"presence_penalty": math.nan},
])
def test_the_sampler_never_hands_nan_to_the_rng(params):
    logits = np.random.default_rng(0).normal(size=100).astype(np.float32) * 5
    logits[7] = np.nan
    sampler = Sampler(SamplingParams(seed=1, **params), prompt_tokens=[1, 2, 3])
    sampler.accept(3)
    with np.errstate(invalid="raise"):  # no NaN made outside the guarded steps either
        token = sampler(logits)
    assert 0 <= token < 100 and token != 7
    if "logit_bias" in params and math.isinf(params["logit_bias"].get(3, 0)) and params["logit_bias"][3] > 0:
        assert token == 3  # an infinite bias wins outright
    if params.get("temperature") == 1e-40:
        assert token == int(np.nanargmax(logits))  # a vanishing temperature is greedy


def test_a_snapshot_during_a_generation_stores_whole_turns(runtime):
    sid = call(runtime, "session.open", system="Be brief.")["session_id"]
    call(runtime, "session.append", session_id=sid, message={"role": "user", "content": "Tell a long story."})
    before = call(runtime, "session.info", session_id=sid)
    tokens = []
    generating = threading.Event()

    def emit(event, data):
        tokens.extend(data["token_ids"])
        if len(tokens) >= 5:
            generating.set()

    generation = runtime.submit("session.generate", {"session_id": sid, "max_tokens": 60, "ignore_eos": True}, emit)
    assert generating.wait(120)
    snapshot = runtime.submit("session.snapshot", {"session_id": sid})
    exported = runtime.submit("session.export", {"session_id": sid})
    snapshot.future.result(timeout=120)
    blob = exported.future.result(timeout=120)
    assert not generation.future.done()  # both ran while it was generating
    stored = runtime.store.get_meta(sid)
    assert stored["tokens"] == before["tokens"] and len(stored["turns"]) == len(before["turns"])
    assert blob["tokens"] == before["tokens"]
    result = generation.future.result(timeout=120)
    assert len(result["token_ids"]) == 60
    stored = runtime.store.get_meta(sid)
    assert len(stored["turns"]) == len(before["turns"]) + 1  # the finished turn joined the store whole
    assert stored["tokens"] + len(stored["pending"]) == call(runtime, "session.info", session_id=sid)["tokens"]


def test_an_append_that_fails_to_store_has_not_appended(runtime, monkeypatch):
    sid = call(runtime, "session.open", system="Be brief.")["session_id"]
    before = call(runtime, "session.info", session_id=sid)
    slot_length = int(runtime.engine.kv.lengths[runtime.sessions[sid].slot])

    def full(*args, **kwargs):
        raise StoreError("injected: the store is full")

    monkeypatch.setattr(runtime.store, "snapshot", full)
    for args in ({"text": "More words."}, {"message": {"role": "user", "content": "Hi."}}, {"tokens": [1, 2, 3]}):
        with pytest.raises(ProtocolError, match="injected") as raised:
            call(runtime, "session.append", session_id=sid, **args)
        assert raised.value.code == "store"
        assert call(runtime, "session.info", session_id=sid) == before
        assert int(runtime.engine.kv.lengths[runtime.sessions[sid].slot]) == slot_length
    with pytest.raises(ProtocolError, match="injected"):  # chat: neither the user message nor a reply
        call(runtime, "session.chat", session_id=sid, content="Hello?", max_tokens=3)
    assert call(runtime, "session.info", session_id=sid) == before
    monkeypatch.undo()
    assert call(runtime, "session.chat", session_id=sid, content="Hello?", max_tokens=3)["token_ids"]


def test_a_prefill_riding_decode_steps_leaves_both_sessions_as_alone(runtime, engine, monkeypatch):
    a = call(runtime, "session.open", system="Be brief.")["session_id"]
    b = call(runtime, "session.open")["session_id"]
    document = " ".join(f"Item {i} weighs {i * 7 % 13} kilograms." for i in range(40))  # ~400 tokens
    chat = {"session_id": a, "content": "Count to twenty.", "max_tokens": 40, "ignore_eos": True}
    held = call(runtime, "session.info", session_id=a)["tokens"]
    alone_a = call(runtime, "session.chat", **chat)["token_ids"]
    call(runtime, "session.append", session_id=b, text=document)
    alone_b = call(runtime, "session.generate", session_id=b, max_tokens=8)["token_ids"]
    call(runtime, "session.rewind", session_id=a, tokens=held)
    call(runtime, "session.rewind", session_id=b, tokens=0)
    rides, real = [], engine.step

    def step(slots, tokens, extend=None, extend_logits=False):
        if extend is not None:
            rides.append(len(extend[1]))
        return real(slots, tokens, extend, extend_logits)

    monkeypatch.setattr(engine, "step", step)
    started = threading.Event()
    generation = runtime.submit("session.chat", chat, lambda event, data: started.set())
    started.wait(120)
    appended = call(runtime, "session.append", session_id=b, text=document)
    assert generation.future.result(timeout=120)["token_ids"] == alone_a
    assert len(rides) > 1 and sum(rides) <= appended["tokens"]  # B's tokens rode A's steps
    assert call(runtime, "session.generate", session_id=b, max_tokens=8)["token_ids"] == alone_b


def test_a_long_message_is_tokenized_off_the_engine_thread_while_others_decode(runtime, engine, monkeypatch):
    """B's message is held in the tokenizer (an event this test controls) while A generates: A's
    decode steps go on meanwhile (with the tokenizer on the engine thread, A would never end)."""
    a = call(runtime, "session.open")["session_id"]
    b = call(runtime, "session.open", system="Be brief.")["session_id"]
    call(runtime, "session.append", session_id=a, text="Count to ten.")
    entered, release, threads = threading.Event(), threading.Event(), []
    real = engine.tokenizer.encode
    mark = "LONG-MESSAGE"

    def encode(text, *args, **kwargs):
        if mark in text:
            threads.append(threading.current_thread().name)
            entered.set()
            release.wait(120)
        return real(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", encode)
    chat = runtime.submit("session.chat", {"session_id": b, "content": mark + " word" * 300, "max_tokens": 2})
    assert entered.wait(60)
    generated = call(runtime, "session.generate", session_id=a, max_tokens=8, ignore_eos=True)
    assert not release.is_set() and len(generated["token_ids"]) == 8  # A ran to its end: B still held
    release.set()
    result = chat.future.result(timeout=120)
    assert result["usage"]["prefilled_tokens"] > 300 and len(result["token_ids"]) <= 2
    assert threads and "engine-test" not in threads  # the loop's thread never tokenized it
    assert call(runtime, "session.info", session_id=b)["turns"][-2]["role"] == "user"


def test_a_session_the_store_cannot_hold_is_an_internal_error_that_frees_its_slot(runtime):
    """Text UTF-8 cannot encode, let past the validation layer (as by a bug): the turn is an
    `internal` error and the session leaves memory. Before, it could be neither snapshotted nor
    evicted: two such sessions pinned both slots and every later request failed."""
    unstorable = {"role": "user", "content": "Hi.", "x": "\ud800"}  # a key the template ignores
    for _ in range(runtime.engine.kv.slots):
        sid = call(runtime, "session.open")["session_id"]
        with pytest.raises(ProtocolError, match=f"session {sid} cannot be stored") as raised:
            raw(runtime, "session.chat", session_id=sid, message=unstorable, max_tokens=2).future.result(timeout=120)
        assert raised.value.code == "internal"
        assert runtime.sessions.get(sid) is None
    for _ in range(runtime.engine.kv.slots + 1):
        sid = call(runtime, "session.open")["session_id"]
        assert call(runtime, "session.chat", session_id=sid, content="Hi.", max_tokens=2)["token_ids"]
