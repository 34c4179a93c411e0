"""The scheduler: its policy alone, and the engine loop over a fake engine that records every
forward, so that what runs between two decode steps is seen exactly."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from ellmd.engine.kvcache import KVCache
from ellmd.kernels import formats
from ellmd.model.spec import ModelSpec
from ellmd.runtime.ops import Op
from ellmd.runtime.schemas import NoArgs
from ellmd.runtime.runtime import ProtocolError, Request, Runtime
from ellmd.runtime.scheduler import DecodeStep, Policy, PrefillChunk
from ellmd.runtime.store.lmdb import Store

VOCAB, CHUNK = 16, 32


class FakeTokenizer:
    special_ids = frozenset()

    def token_bytes(self, token: int) -> bytes:
        return b"x"

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "x" * len(ids)

    def fingerprint(self) -> str:
        return "fake-tokenizer"


class FakeEngine:
    """The Engine's interface over a real (tiny) KV cache; forwards are recorded, not computed.

    Logits favour token 1; `on_prefill(call_index)` runs before each prefill (to cancel or fail one).
    """

    def __init__(self, slots: int = 3, sequence_length: int = 1024, step_rows: int = 24):
        self.spec = ModelSpec.from_config({"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 8,
                                           "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2})
        self.kv = KVCache(1, slots, 2, sequence_length, 4, formats.F32)
        self.fmt, self.weights_digest, self.model_path = formats.F32, "fake", "fake"
        self.chunk_size, self.chat_template, self.tokenizer = CHUNK, None, FakeTokenizer()
        self.step_rows = step_rows  # decode rows and riding prefill tokens of a step
        self.log: list[tuple] = []  # ("prefill" or "ride", slot, tokens) and ("decode", slots)
        self.on_prefill = None
        self.logits = np.zeros(VOCAB, np.float32)
        self.logits[1] = 10.0

    def prefill(self, slot, tokens, logits="last", kind="prefill"):
        if self.on_prefill:
            self.on_prefill(sum(1 for e in self.log if e[0] in ("prefill", "ride")))
        self.kv.check_room(slot, len(tokens))
        assert len(tokens) <= CHUNK, "a job asked for more than a chunk"
        self.log.append((kind, slot, len(tokens)))
        self.kv.lengths[slot] += len(tokens)
        return self.logits.copy() if logits == "last" else None

    def step(self, slots, tokens, extend=None, extend_logits=False):
        rows = [t if isinstance(t, list) else [t] for t in tokens]  # a slot's token, or its token and draft
        last = None
        if extend is not None:
            slot, piece = extend
            assert slot not in slots and sum(map(len, rows)) + len(piece) <= self.step_rows
            last = self.prefill(slot, piece, "last" if extend_logits else "none", kind="ride")
        return self.decode(slots, rows), last

    def decode(self, slots, tokens):
        rows = [t if isinstance(t, list) else [t] for t in tokens]
        self.log.append(("decode", tuple(slots)))
        for slot, row in zip(slots, rows):
            self.kv.check_room(slot, len(row))
            self.kv.lengths[slot] += len(row)
        return np.tile(self.logits, (sum(map(len, rows)), 1))

    def rewind(self, slot, length):
        self.kv.rewind(slot, length)

    def copy_slot(self, src, dst, length=None):
        self.kv.copy_slot(src, dst, length)

    def export_kv(self, slot, start, stop):
        return self.kv.export(slot, start, stop)

    def import_kv(self, slot, start, data):
        return self.kv.import_(slot, start, data)


class Measured(Policy):
    """The policy with fixed measurements: a decode step of 8 ms, 1 ms per prefill token on its
    own, 0.5 ms per token riding a decode step."""

    def __init__(self, gap_ratio=1.0):
        super().__init__(CHUNK, gap_ratio=gap_ratio, min_chunk=2)
        self.decode_s, self.token_s, self.ride_s = 0.008, 0.001, 0.0005

    def observe_decode(self, seconds, drafts=0):
        pass

    def observe_prefill(self, tokens, seconds):
        pass

    def observe_ride(self, tokens, seconds):
        pass


@pytest.fixture
def make(tmp_path):
    made = []

    def make(policy=None, **engine_args):
        engine = FakeEngine(**engine_args)
        rt = Runtime(engine, Store(tmp_path / f"store{len(made)}"), policy=policy or Measured())
        thread = threading.Thread(target=rt.run, daemon=True)
        thread.start()
        made.append((rt, thread))
        return rt, engine

    yield make
    for rt, thread in made:
        rt.stop(timeout=30)
        thread.join(30)
        rt.store.close()


class held:
    """Hold the engine loop (it runs a request that waits) while requests queue behind it, so
    that the loop finds them all queued at once."""

    def __init__(self, rt):
        self.rt, self.release = rt, threading.Event()

    def __enter__(self):
        def hold(rt, request):
            self.release.wait(30)
            return {}
        self.rt.ops = {**self.rt.ops, "hold": Op("hold", NoArgs, hold, "admin")}
        self.request = Request("hold", {})
        self.rt.queue.put(self.request)

    def __exit__(self, *exc):
        self.release.set()
        self.request.future.result(timeout=30)


def call(rt, op, **args):
    return rt.submit(op, args).future.result(timeout=30)


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(2, VOCAB, n).tolist()


# ---- the policy alone ---------------------------------------------------------------------------


def test_budget_is_a_whole_chunk_unless_someone_decodes():
    policy = Policy(512)
    assert policy.budget(decoding=0) == 512
    assert policy.budget(decoding=2) == policy.min_chunk  # not measured yet: cautious
    policy.observe_decode(0.010)
    policy.observe_prefill(100, 0.100)  # 1 ms per token
    assert policy.budget(decoding=1) == 10  # a chunk as long as a decode step (gap_ratio 1)
    policy.gap_ratio = 3.0
    assert policy.budget(decoding=1) == 30
    policy.gap_ratio = None  # whole chunks: the decoding sessions wait
    assert policy.budget(decoding=1) == 512


def test_budget_follows_the_measurements_and_stays_within_bounds():
    policy = Policy(64, min_chunk=4)
    policy.observe_decode(0.010)
    policy.observe_prefill(10, 0.001)  # 0.1 ms per token: 100 tokens fit, the chunk caps it
    assert policy.budget(decoding=1) == 64
    for _ in range(30):  # prefill got slow: the running estimate follows
        policy.observe_prefill(10, 0.100)
    assert policy.budget(decoding=1) == 4


def test_a_riding_budget_adds_gap_ratio_steps_and_fits_the_room():
    policy = Policy(512)
    assert policy.budget(decoding=1, room=20) == policy.min_chunk  # not measured yet: cautious
    policy.observe_ride(8, 0.030)  # no decode step alone measured yet: nothing to learn from it
    assert policy.ride_s is None
    policy.observe_decode(0.010)
    policy.observe_ride(8, 0.018)  # the step took 8 ms more: 1 ms a riding token
    assert policy.stats() == {"gap_ratio": 1.0, "decode_step_ms": 10.0, "prefill_token_ms": None,
                              "riding_token_ms": 1.0}
    assert policy.budget(decoding=1, room=20) == 10  # what adds one step's time (gap_ratio 1)
    assert policy.budget(decoding=1, room=6) == 6  # no more than the step's free rows
    policy.gap_ratio = 0.5
    assert policy.budget(decoding=1, room=20) == 5
    policy.observe_ride(4, 0.009)  # faster than the step alone (noise): free, within the room
    assert 5 < policy.budget(decoding=1, room=20) <= 20
    policy.gap_ratio = None  # whole chunks, on their own: more than the room
    assert policy.budget(decoding=1, room=20) == 512


def test_the_policy_hands_the_loop_a_riding_chunk_or_a_chunk_of_its_own_then_the_decode_step():
    policy, jobs = Measured(), [SimpleNamespace(left=100), SimpleNamespace(left=50)]
    # 8 ms a step, 0.5 ms a riding token: 16 tokens ride it (gap_ratio 1); alone, 1 ms a token: 8
    assert policy.next_jobs(jobs, decoding=1, room=20) == [PrefillChunk(jobs[1], 16, ride=True), DecodeStep()]
    assert policy.next_jobs(jobs, decoding=4, room=0) == [PrefillChunk(jobs[1], 8, ride=False), DecodeStep()]
    assert policy.next_jobs(jobs, decoding=0, room=0) == [PrefillChunk(jobs[1], CHUNK, ride=False)]
    assert policy.next_jobs([], decoding=2, room=10) == [DecodeStep()]


def test_next_prefill_is_the_one_with_fewest_tokens_left_in_arrival_order():
    jobs = [SimpleNamespace(left=300), SimpleNamespace(left=12), SimpleNamespace(left=12)]
    assert Policy(32).next_prefill(jobs) is jobs[1]
    assert Policy(32).next_prefill([]) is None


def idle_session(last_used, tokens=0, stored=0, busy=False):
    return SimpleNamespace(last_used=last_used, tokens=[0] * tokens, stored_tokens=stored, busy=busy)


def test_victim_is_the_least_recently_used_idle_session_and_admission_needs_one():
    a, b = idle_session(5.0), idle_session(2.0)
    policy = Policy(32)
    assert policy.victim([a, b]) is b and policy.victim([]) is None
    busy = idle_session(1.0, busy=True)
    assert not policy.admit([busy, busy]) and policy.admit([busy, b]) and policy.admit([busy, None])


def test_victim_weighs_the_seconds_a_swap_costs_against_recency():
    policy = Policy(32)
    policy.observe_swap("write", 1000, 1.0)  # 1 ms per token written, 0.1 ms read back
    policy.observe_swap("read", 1000, 0.1)
    policy.observe_swap("read", 0, 5.0)  # a metadata-only resume says nothing of the rate
    assert policy.swap_s == {"write": 0.001, "read": 0.0001}
    stored = idle_session(10.0, tokens=8000, stored=8000)  # costs 0.8 s to swap
    unsaved = idle_session(9.0, tokens=8000, stored=0)  # used 1 s before, but 8 s to write first
    assert policy.swap_cost(stored) == 0.8 and policy.swap_cost(unsaved) == 8.8
    assert policy.victim([stored, unsaved]) is stored
    small = idle_session(10.5, tokens=100, stored=100)  # more recent, but nearly free to swap
    assert policy.victim([stored, unsaved, small]) is small
    assert policy.victim([idle_session(1.0, 8000), stored]).last_used == 1.0  # long idle goes first


# ---- the loop over a fake engine ----------------------------------------------------------------


def steps_between_decodes(log: list[tuple]) -> list[list[tuple]]:
    """The forwards run between each two consecutive decode steps."""
    decodes = [i for i, entry in enumerate(log) if entry[0] == "decode"]
    return [log[i + 1:j] for i, j in zip(decodes, decodes[1:])]


def decode_beside_prefill(rt, engine, max_tokens):
    """Session A decodes max_tokens while session B appends 100 tokens: (a, b, generation, append)."""
    a = call(rt, "session.open")["session_id"]
    b = call(rt, "session.open")["session_id"]
    call(rt, "session.append", session_id=a, tokens=tokens(5))
    engine.log.clear()
    with held(rt):
        generation = rt.submit("session.generate", {"session_id": a, "max_tokens": max_tokens, "ignore_eos": True})
        appended = rt.submit("session.append", {"session_id": b, "tokens": tokens(100, 1)})
    return a, b, generation, appended


def test_a_long_prefill_rides_the_decode_steps_in_budgeted_chunks(make):
    rt, engine = make()
    a, b, generation, appended = decode_beside_prefill(rt, engine, 60)
    assert appended.future.result(timeout=30)["tokens"] == 100
    assert generation.future.result(timeout=30)["finish_reason"] == "length"
    b_slot = rt.sessions[b].slot
    log = engine.log
    rides = [i for i, e in enumerate(log) if e[0] == "ride"]
    assert [log[i][1] for i in rides] == [b_slot] * len(rides)
    assert all(log[i + 1][0] == "decode" for i in rides)  # each in a step of A's
    chunks = [log[i][2] for i in rides]
    assert sum(chunks) == 100 and max(chunks) == 16  # 8 ms decode x ratio 1 / 0.5 ms a riding token
    assert not [e for e in log if e[0] == "prefill" and e[1] == b_slot]
    assert int(engine.kv.lengths[b_slot]) == 100 and len(rt.sessions[b].tokens) == 100


def test_without_room_in_the_step_a_prefill_runs_budgeted_chunks_between_decode_steps(make):
    rt, engine = make(step_rows=1)  # A's token fills the step
    a, b, generation, appended = decode_beside_prefill(rt, engine, 60)
    assert appended.future.result(timeout=30)["tokens"] == 100
    assert generation.future.result(timeout=30)["finish_reason"] == "length"
    b_slot = rt.sessions[b].slot
    chunks = [n for kind, *rest in engine.log if kind == "prefill" and rest[0] == b_slot for n in rest[1:]]
    assert sum(chunks) == 100 and max(chunks) == 8  # 8 ms decode x ratio 1 / 1 ms a token
    for between in steps_between_decodes(engine.log):
        assert len(between) <= 1  # never more than one chunk between two of A's tokens
    assert int(engine.kv.lengths[b_slot]) == 100 and len(rt.sessions[b].tokens) == 100


def test_with_whole_chunks_decoding_waits_for_the_plan_chunk(make):
    rt, engine = make(policy=Measured(gap_ratio=None))
    a, b, generation, appended = decode_beside_prefill(rt, engine, 40)
    appended.future.result(timeout=30)
    generation.future.result(timeout=30)
    chunks = [e[2] for e in engine.log if e[0] == "prefill" and e[1] == rt.sessions[b].slot]
    assert chunks == [CHUNK, CHUNK, CHUNK, 100 - 3 * CHUNK]


def test_nobody_decoding_a_prefill_runs_whole_chunks(make):
    rt, engine = make()
    b = call(rt, "session.open")["session_id"]
    engine.log.clear()
    call(rt, "session.append", session_id=b, tokens=tokens(70))
    assert [e[2] for e in engine.log] == [CHUNK, CHUNK, 6]


def test_a_cancelled_prefill_stops_at_the_next_chunk_and_leaves_the_session_as_it_was(make):
    rt, engine = make()
    b = call(rt, "session.open")["session_id"]
    call(rt, "session.append", session_id=b, tokens=tokens(10))
    before = call(rt, "session.info", session_id=b)
    engine.log.clear()
    holder = {}

    def cancel_after_two(index):
        if index == 2:
            holder["request"].cancelled.set()  # arrives while the third chunk runs

    engine.on_prefill = cancel_after_two
    holder["request"] = rt.submit("session.append", {"session_id": b, "tokens": tokens(200, 2)})
    with pytest.raises(ProtocolError, match="cancelled during its prefill") as raised:
        holder["request"].future.result(timeout=30)
    assert raised.value.code == "cancelled"
    assert len(engine.log) == 3  # the chunk running when it was cancelled was the last
    engine.on_prefill = None
    after = call(rt, "session.info", session_id=b)
    assert after["tokens"] == before["tokens"] == 10 and after["turns"] == before["turns"]
    assert int(engine.kv.lengths[rt.sessions[b].slot]) == 10  # the partial KV was cut off
    assert call(rt, "session.append", session_id=b, tokens=[3])["tokens"] == 11  # and the session goes on


def test_a_failing_chunk_fails_its_request_alone(make):
    rt, engine = make()
    a = call(rt, "session.open")["session_id"]
    b = call(rt, "session.open")["session_id"]
    call(rt, "session.append", session_id=a, tokens=tokens(5))

    def fail_second(index):
        if index == 2:  # B's second chunk (A's prompt was the first prefill)
            raise FloatingPointError("injected")

    engine.on_prefill = fail_second
    with held(rt):
        generation = rt.submit("session.generate", {"session_id": a, "max_tokens": 30, "ignore_eos": True})
        appended = rt.submit("session.append", {"session_id": b, "tokens": tokens(100, 1)})
    with pytest.raises(ProtocolError) as raised:
        appended.future.result(timeout=30)
    assert raised.value.code == "internal" and "injected" in str(raised.value)
    assert generation.future.result(timeout=30)["token_ids"] == [1] * 30  # A never noticed
    engine.on_prefill = None
    assert call(rt, "session.info", session_id=b)["tokens"] == 0
    assert int(engine.kv.lengths[rt.sessions[b].slot]) == 0


def test_a_session_prefilling_is_busy_to_other_requests_and_shows_its_last_whole_turn(make):
    rt, engine = make()
    b = call(rt, "session.open")["session_id"]
    seen = {}

    def peek(index):
        if index == 1:  # between two chunks of B's prefill, other requests run
            seen["info"] = rt.ops["session.info"].handler(rt, request, session_id=b)
            with pytest.raises(ProtocolError, match="busy") as raised:
                next(rt.ops["session.append"].handler(rt, request, session_id=b, tokens=[2]))
            seen["busy"] = raised.value.code

    request = rt.submit("session.info", {"session_id": b})
    request.future.result(timeout=30)
    engine.on_prefill = peek
    assert call(rt, "session.append", session_id=b, tokens=tokens(70))["tokens"] == 70
    assert seen == {"info": {**seen["info"], "tokens": 0, "busy": True}, "busy": "busy"}


def test_short_prefills_pass_a_long_one(make):
    rt, engine = make()
    a, b, c = (call(rt, "session.open")["session_id"] for _ in range(3))
    call(rt, "session.append", session_id=a, tokens=tokens(5))
    order = []
    with held(rt):
        generation = rt.submit("session.generate", {"session_id": a, "max_tokens": 200, "ignore_eos": True})
        long = rt.submit("session.append", {"session_id": b, "tokens": tokens(300, 1)})
        long.future.add_done_callback(lambda f: order.append("long"))
        short = rt.submit("session.append", {"session_id": c, "tokens": tokens(6, 2)})
        short.future.add_done_callback(lambda f: order.append("short"))
    long.future.result(timeout=30)
    short.future.result(timeout=30)
    rt.submit("stats", {}).future.result(timeout=30)
    generation.cancelled.set()
    generation.future.result(timeout=30)
    assert order == ["short", "long"]


def test_shutdown_cancels_prefills_in_progress(make):
    rt, engine = make()
    b = call(rt, "session.open")["session_id"]
    started = threading.Event()
    release = threading.Event()

    def hold(index):
        started.set()
        release.wait(10)

    engine.on_prefill = hold
    appended = rt.submit("session.append", {"session_id": b, "tokens": tokens(200)})
    assert started.wait(10)
    stopping = threading.Thread(target=rt.stop, kwargs={"timeout": 30})
    stopping.start()
    release.set()
    stopping.join(30)
    with pytest.raises(ProtocolError, match="shutting down"):
        appended.future.result(timeout=30)
    assert rt.store.get_meta(b)["tokens"] == 0  # snapshotted as it was before the append


def test_requests_on_a_prefilling_session_wait_for_it_in_order(make):
    rt, engine = make()
    b = call(rt, "session.open")["session_id"]
    first = rt.submit("session.append", {"session_id": b, "tokens": tokens(70)})
    second = rt.submit("session.append", {"session_id": b, "tokens": tokens(5, 1)})
    generation = rt.submit("session.generate", {"session_id": b, "max_tokens": 3, "ignore_eos": True})
    assert first.future.result(timeout=30)["tokens"] == 70
    assert second.future.result(timeout=30)["tokens"] == 75
    assert generation.future.result(timeout=30)["token_ids"] == [1, 1, 1]
    assert [e[2] for e in engine.log if e[0] == "prefill"] == [CHUNK, CHUNK, 6, 5, 1]
    info = call(rt, "session.info", session_id=b)
    assert [t["kind"] for t in info["turns"]] == ["tokens", "tokens", "generation"]


def test_a_session_is_prefilling_then_generating_then_writing_its_turn_then_idle(make, monkeypatch):
    rt, engine = make()
    b = call(rt, "session.open")["session_id"]
    call(rt, "session.append", session_id=b, tokens=tokens(5))
    seen, decode = [], engine.decode
    engine.on_prefill = lambda index: seen.append(("prefill", rt.sessions[b].state))
    monkeypatch.setattr(engine, "decode", lambda *a: (seen.append(("decode", rt.sessions[b].state)), decode(*a))[1])
    entered, release, snapshot = threading.Event(), threading.Event(), rt.store.snapshot

    def held(*args, **kwargs):  # the turn's snapshot waits for the test
        entered.set()
        release.wait(30)
        return snapshot(*args, **kwargs)

    monkeypatch.setattr(rt.store, "snapshot", held)
    generation = rt.submit("session.generate", {"session_id": b, "max_tokens": 3, "ignore_eos": True})
    assert entered.wait(30)
    info = rt.submit("session.info", {"session_id": b})  # waits for the turn's write
    call(rt, "stats")  # the loop has run past it
    assert rt.sessions[b].state == "writing" and not generation.future.done() and not info.future.done()
    release.set()
    result = generation.future.result(timeout=30)
    assert result["token_ids"] == [1, 1, 1]
    # nothing new to prefill: the last token ran again for its logits (the usage says so)
    assert (result["usage"]["prefilled_tokens"], result["usage"]["reused_tokens"]) == (1, 4)
    assert info.future.result(timeout=30)["busy"] is False and rt.sessions[b].state == "idle"
    assert seen[0] == ("prefill", "prefilling") and {state for _, state in seen[1:]} == {"generating"}
