"""Speculative decoding from the session's history: draft rows computed as decoding computes them,
rejected rows rewound, generations identical to plain decoding (greedy, and seeded sampling draw
for draw), the acceptance routine's law, the drafts' lookup and adaptation, the per-request switch."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import numpy as np
import pytest

from ellmd.engine import Engine, SamplingParams
from ellmd.engine.engine import builtin_model_path
from ellmd.engine.sampling import Sampler, verify_draft
from ellmd.errors import CapacityError, InvariantError
from ellmd.runtime.drafts import MAX_PAUSE, PromptLookup
from ellmd.runtime.runtime import Runtime
from ellmd.runtime.store.lmdb import Store

from daemon import Daemon
from test_scheduler import held

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [list(range(5, 17)), [3, 4], list(range(20, 41))]
DRAFTS = [[7, 8, 9, 10, 11], [2], [1, 2, 3]]  # slot 0: a token and a 4-token draft; slot 1 no draft


def decode_one_by_one(engine, slot: int, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The logits of decoding `tokens` one step each after `prompt` [len(tokens), V]."""
    engine.rewind(slot, 0)
    engine.prefill(slot, prompt)
    return np.stack([engine.decode([slot], [t])[0].copy() for t in tokens])


def assert_draft_rows_as_decoding(engine) -> None:
    want = [decode_one_by_one(engine, slot, PROMPTS[slot], DRAFTS[slot]) for slot in range(3)]
    after = decode_one_by_one(engine, 0, PROMPTS[0], [*DRAFTS[0][:2], 42])[-1]  # two rows kept, then 42
    for slot in range(3):
        engine.rewind(slot, 0)
        engine.prefill(slot, PROMPTS[slot])
    logits, _ = engine.step([0, 1, 2], DRAFTS)
    assert logits.shape[0] == sum(map(len, DRAFTS))
    begin = 0
    for slot in range(3):
        got = logits[begin : begin + len(DRAFTS[slot])]
        assert np.array_equal(got, want[slot]), f"slot {slot}: a draft row differs from decoding it alone"
        begin += len(DRAFTS[slot])
        assert engine.lengths[slot] == len(PROMPTS[slot]) + len(DRAFTS[slot])
    assert np.abs(want[0]).max() > 0.1  # not trivially equal
    engine.rewind(0, len(PROMPTS[0]) + 2)  # the draft's last three rows rejected
    assert np.array_equal(engine.decode([0], [42])[0], after)


# a float and a block format per family, as tests/test_fused_decode.py compiles them
CASES = [("llama", "f32"), ("qwen3", "q8_0"), ("qwen3_moe", "q4_k"), ("qwen3_moe-dense0-tied-bf16", "bf16")]


@pytest.mark.parametrize("variant,weight_dtype", CASES)
def test_draft_rows_equal_decoding_one_by_one(alignment_dir, variant, weight_dtype):
    engine = Engine(alignment_dir / variant, weight_dtype=weight_dtype, kv_dtype="bf16", sequence_length=96,
                    batch_size=3, chunk_size=16, threads=2)
    assert_draft_rows_as_decoding(engine)


@pytest.fixture(scope="module")
def smollm():
    return Engine(builtin_model_path(), sequence_length=256, batch_size=3, chunk_size=32, threads=2)


def test_draft_rows_equal_decoding_on_the_builtin_model(smollm):
    assert_draft_rows_as_decoding(smollm)


def test_draft_rows_beside_a_riding_prefill(smollm):
    engine = smollm
    want = decode_one_by_one(engine, 0, PROMPTS[0], DRAFTS[0])
    engine.rewind(0, len(PROMPTS[0]))
    engine.rewind(1, 0)
    alone = engine.step([0], [DRAFTS[0][0]], extend=(1, PROMPTS[2]), extend_logits=True)[1]  # no draft beside
    engine.rewind(0, len(PROMPTS[0]))
    engine.rewind(1, 0)
    logits, last = engine.step([0], [DRAFTS[0]], extend=(1, PROMPTS[2]), extend_logits=True)
    assert np.array_equal(logits, want)
    assert np.array_equal(last, alone)  # the prefill's rows do not see the draft's either
    assert list(engine.lengths[:2]) == [len(PROMPTS[0]) + len(DRAFTS[0]), len(PROMPTS[2])]
    engine.rewind(2, 0)
    engine.prefill(2, [1] * 250)
    lengths = list(engine.lengths)
    with pytest.raises(InvariantError):
        engine.step([0], [[1] * (engine.step_rows + 1)])  # more rows than a step takes
    with pytest.raises(InvariantError):
        engine.step([0], [[1] * 10], extend=(1, [2] * (engine.step_rows - 9)))
    with pytest.raises(CapacityError):
        engine.step([0, 2], [[1, 2], [1] * 7])  # slot 2's draft over the sequence length
    assert list(engine.lengths) == lengths  # a refused step changes nothing


# ---- the acceptance routine ------------------------------------------------------------------


def chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square test of counts against a distribution: its p-value (Wilson-Hilferty's
    normal approximation of the chi-square law, close enough in the tail tested here)."""
    expected = expected * observed.sum() / expected.sum()
    statistic, df = float(((observed - expected) ** 2 / expected).sum()), len(observed) - 1
    z = ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.9, repetition_penalty=1.5)])
def test_the_draft_is_kept_with_its_probability_and_the_rest_follows_p_without_it(params):
    """Speculative sampling with a deterministic draft d: keep d with probability p(d), else draw
    from p with d removed, renormalised (p: the distribution after the sampler's processing)."""
    logits = np.log(np.array([0.30, 0.22, 0.15, 0.12, 0.08, 0.06, 0.04, 0.03], np.float32))
    sampler = Sampler(params, prompt_tokens=[0, 5])
    processed = sampler.process(logits.astype(np.float64))
    p = reference_distribution(processed, params)
    draws = 40_000
    for draft in (0, 2, 7):
        rng_sampler = Sampler(params, prompt_tokens=[0, 5])
        rng_sampler.rng = np.random.default_rng(1234 + draft)
        results = [verify_draft(rng_sampler, logits, draft) for _ in range(draws)]
        kept = np.array([k for _, k in results])
        tokens = np.array([t for t, _ in results])
        assert np.array_equal(kept, tokens == draft)
        # kept with probability p(d): within 4.5 standard deviations
        assert abs(kept.mean() - p[draft]) <= 4.5 * np.sqrt(p[draft] * (1 - p[draft]) / draws) + 1e-12
        rest = tokens[~kept]
        residual = p.copy()
        residual[draft] = 0
        support = residual > 0
        counts = np.bincount(rest, minlength=len(p))
        assert counts[~support].sum() == 0  # never a token outside p's support, never d itself
        if support.sum() > 1:
            assert chi_square_p(counts[support], residual[support]) > 1e-4
    assert verify_draft(Sampler(SamplingParams()), logits, 0) == (0, True)  # greedy: the argmax
    assert verify_draft(Sampler(SamplingParams()), logits, 3) == (0, False)
    assert verify_draft(Sampler(SamplingParams()), logits, None) == (0, False)


def reference_distribution(processed: np.ndarray, params: SamplingParams) -> np.ndarray:
    """p after temperature, top-k and top-p, written out for these small cases."""
    z = processed / params.temperature
    order = np.argsort(-z, kind="stable")
    probs = np.exp(z[order] - z[order[0]])
    probs /= probs.sum()
    keep = params.top_k or len(z)
    if params.top_p < 1:
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1)
    p = np.zeros(len(z))
    p[order[:keep]] = probs[:keep] / probs[:keep].sum()
    return p


# ---- the drafts ------------------------------------------------------------------------------


def test_the_draft_follows_the_most_recent_occurrence_of_the_longest_suffix():
    history = [1, 2, 3, 9, 9, 5, 2, 3, 4, 4, 6, 1, 2, 3]
    lookup = PromptLookup(history, capacity=32, max_draft=3, ngram=(1, 3))
    assert lookup.propose(8) == [9, 9, 5]  # "1 2 3" occurred at the start; "2 3" more recently, shorter
    lookup.push(9)
    assert lookup.propose(8) == [9, 5, 2]  # "3 9" then
    lookup = PromptLookup([5, 6, 7, 8], capacity=4, ngram=(2, 4))
    assert lookup.propose(8) == []  # no suffix of 2 tokens recurs
    for token in (5, 6):  # grows past its capacity
        lookup.push(token)
    assert lookup.propose(2) == [7, 8]
    assert PromptLookup([4, 1, 4], capacity=8, ngram=(2, 4)).propose(4) == []  # one token is not enough
    assert PromptLookup([4, 1, 4], capacity=8, ngram=(1, 4)).propose(5) == [1, 4, 1, 4, 1]  # the loop goes on


def test_the_draft_length_adapts_and_failing_drafts_pause():
    lookup = PromptLookup([1, 2, 3] * 10, capacity=64, max_draft=8)
    assert len(lookup.propose(32)) == 8
    lookup.record(8, 3)
    assert len(lookup.propose(32)) == 4  # one past the accepted ones
    lookup.record(4, 4)
    assert len(lookup.propose(32)) == 8  # doubled after a whole draft
    lookup.record(8, 0)
    assert len(lookup.propose(32)) == 1  # one failure: a one-token draft next
    pauses = []
    for _ in range(8):
        lookup.record(1, 0)
        steps = 0
        while not lookup.propose(32):
            steps += 1
        pauses.append(steps)
    assert pauses == [2, 4, 8, 16, 32, MAX_PAUSE, MAX_PAUSE, MAX_PAUSE][: len(pauses)]
    lookup.record(1, 1)
    assert lookup.propose(32)  # an accepted token ends the pauses


# ---- generations through the runtime ----------------------------------------------------------


def call(rt, op, **args):
    return rt.submit(op, args).future.result(timeout=300)


@pytest.fixture(scope="module")
def tiny_runtime(alignment_dir, tmp_path_factory):
    runtimes = []

    def make(variant: str) -> Runtime:
        engine = Engine(alignment_dir / variant, kv_dtype="bf16", sequence_length=160, batch_size=2, chunk_size=32,
                        threads=2)
        rt = Runtime(engine, Store(tmp_path_factory.mktemp("store")))
        thread = threading.Thread(target=rt.run, daemon=True)
        thread.start()
        runtimes.append((rt, thread))
        return rt

    yield make
    for rt, thread in runtimes:
        rt.stop(timeout=60)
        thread.join(60)
        rt.store.close()


@pytest.mark.parametrize("variant", ["llama", "qwen3", "qwen3_moe"])
def test_greedy_generations_equal_plain_decoding_on_tiny_models(tiny_runtime, variant):
    rt = tiny_runtime(variant)
    vocab = rt.engine.spec.vocab_size
    rng = np.random.default_rng(3)
    motif = rng.integers(0, vocab, 12).tolist()
    prompt = motif * 3 + rng.integers(0, vocab, 5).tolist() + motif[:4]  # a history worth copying from
    results = {}
    for mode, options in (("plain", {"speculative": False}), ("speculative", {"draft_tokens": 6})):
        session = call(rt, "session.open")["session_id"]
        call(rt, "session.append", session_id=session, tokens=prompt)
        results[mode] = call(rt, "session.generate", session_id=session, max_tokens=90, ignore_eos=True,
                             stream=False, **options)
        results[mode]["after"] = call(rt, "session.generate", session_id=session, max_tokens=6, ignore_eos=True,
                                      speculative=False, logprobs=3)
    plain, spec = results["plain"], results["speculative"]
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["after"]["token_ids"] == plain["after"]["token_ids"]  # the KV holds what plain decoding left
    assert spec["after"]["logprobs"] == plain["after"]["logprobs"]
    assert plain["usage"]["draft_tokens"] == 0
    usage = spec["usage"]
    assert usage["draft_tokens"] >= usage["accepted_tokens"] > 0
    assert usage["decode_steps"] < plain["usage"]["decode_steps"] == 89
    counters = call(rt, "stats")["counters"]
    assert (counters["drafted"], counters["accepted"]) == (usage["draft_tokens"], usage["accepted_tokens"])


def test_batched_drafting_generations_equal_batched_plain_decoding(smollm, tmp_path):
    """Three generations drafting in one step each (and the next one's prompt riding along), as
    the same three decoding plainly: the rows of one step do not see each other."""
    for slot in range(smollm.kv.slots):
        smollm.rewind(slot, 0)
    rt = Runtime(smollm, Store(tmp_path / "store"))
    thread = threading.Thread(target=rt.run, daemon=True)
    thread.start()
    code = CODE[:400]
    prompt = smollm.tokenizer.encode(f"<|im_start|>user\n```python\n{code}```\nRepeat it.<|im_end|>\n"
                                     f"<|im_start|>assistant\n```python\n{code.splitlines(keepends=True)[0]}")
    try:
        results = {}
        for speculative in (False, True):
            sessions = [call(rt, "session.open")["session_id"] for _ in range(3)]
            for session in sessions:
                call(rt, "session.append", session_id=session, tokens=prompt)
            with held(rt):  # each generation's one-token prompt job rides the others' steps, in order
                requests = [rt.submit("session.generate", {"session_id": s, "max_tokens": 40 + 10 * i,
                                                           "speculative": speculative, "stream": False})
                            for i, s in enumerate(sessions)]
            results[speculative] = [r.future.result(timeout=300) for r in requests]
            for session in sessions:
                call(rt, "session.delete", session_id=session)
        assert [r["token_ids"] for r in results[True]] == [r["token_ids"] for r in results[False]]
        assert all(r["usage"]["accepted_tokens"] > 0 for r in results[True])
    finally:
        rt.stop(timeout=60)
        thread.join(60)
        rt.store.close()


# ---- the daemon --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("daemon"), slots=3).start()
    yield d
    assert d.stop() == 0


CODE = (ROOT / "ellmd" / "runtime" / "session.py").read_text()[:1800]
# A request to copy the code, in SmolLM2's template, and the reply's opening: from there the
# 135M model copies the code (with drifts of its own), where it would otherwise describe it.
PRIMED = (f"<|im_start|>user\n```python\n{CODE}```\nRepeat this file exactly.<|im_end|>\n"
          f"<|im_start|>assistant\n```python\n{CODE.splitlines(keepends=True)[0]}")


def ask(client, speculative: bool, **sampling):
    """A session holding the primed request; a generation on it."""
    session = client.open_session(title="code")
    session.append(text=PRIMED)
    result = session.generate(speculative=speculative, **sampling)
    return session, result


def test_greedy_text_equals_plain_decoding_through_the_daemon(daemon):
    with daemon.client() as client:
        plain_session, plain = ask(client, False, max_tokens=120)
        spec_session, spec = ask(client, True, max_tokens=120)
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        assert spec.usage["draft_tokens"] >= spec.usage["accepted_tokens"] > 0
        assert spec.usage["decode_steps"] < plain.usage["decode_steps"]
        assert plain.usage["draft_tokens"] == plain.usage["accepted_tokens"] == 0
        assert spec_session.info()["tokens"] == plain_session.info()["tokens"]
        # the next turn reads the KV the drafts left: as after plain decoding
        after_plain = plain_session.chat("Thanks.", max_tokens=8, logprobs=2, speculative=False)
        after_spec = spec_session.chat("Thanks.", max_tokens=8, logprobs=2, speculative=False)
        assert after_spec.token_ids == after_plain.token_ids and after_spec.logprobs == after_plain.logprobs
        off = ask(client, True, max_tokens=40, draft_tokens=0)[1]  # draft_tokens 0 turns drafting off too
        assert off.usage["draft_tokens"] == 0 and off.token_ids == plain.token_ids[:40]


def test_stops_end_as_in_plain_decoding(daemon):
    with daemon.client() as client:
        plain = ask(client, False, max_tokens=120)[1]
        words = plain.text.split()
        stop = " ".join(words[len(words) // 2 : len(words) // 2 + 2])
        stop_token = plain.token_ids[57]
        for sampling in ({"stop": [stop]}, {"stop_token_ids": [stop_token]}, {"max_tokens": 33}):
            sampling = {"max_tokens": 120, **sampling}
            want_session, want = ask(client, False, **sampling)
            got_session, got = ask(client, True, **sampling)
            assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
            assert got.usage["accepted_tokens"] > 0
            assert got_session.info()["tokens"] == want_session.info()["tokens"]
            next_want = want_session.chat("Go on.", max_tokens=4, logprobs=2, speculative=False)
            next_got = got_session.chat("Go on.", max_tokens=4, logprobs=2, speculative=False)
            assert next_got.logprobs == next_want.logprobs
        assert want.finish_reason == "length" and len(want.token_ids) == 33


def test_seeded_sampling_gives_the_tokens_of_plain_decoding(daemon):
    # Cool enough that the reply copies the prompt on every kernel path (so drafts are accepted),
    # and still sampled: each token is drawn with the seed, not taken as the argmax.
    sampling = {"max_tokens": 80, "temperature": 0.2, "top_p": 0.95, "seed": 7, "repetition_penalty": 1.05}
    with daemon.client() as client:
        plain = ask(client, False, **sampling)[1]
        spec = ask(client, True, **sampling)[1]
    assert spec.token_ids == plain.token_ids
    assert spec.usage["accepted_tokens"] > 0


# A record the reply is asked to repeat: under its schema the reply copies the prompt, so drafts
# exist, and they run across the keys and punctuation where the grammar's mask changes token by token.
RECORD = {"title": "The Old Man and the Sea", "year": 1952,
          "quote": "A man can be destroyed but not defeated, and the sea does not care about him at all."}
RECORD_SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "quote": {"type": "string"},
                                                  "year": {"type": "integer"}},
                 "required": ["title", "quote", "year"], "additionalProperties": False}


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 5}], ids=["greedy", "seeded"])
def test_constrained_generations_draft_and_equal_plain_decoding(daemon, sampling):
    """Each draft row is masked for the grammar's state after the row before: a mask of an earlier
    state would sample tokens the grammar refuses, or others than plain decoding's."""
    prompt = f"Here is a record:\n{json.dumps(RECORD)}\nRepeat the record exactly, as JSON."
    results = {}
    with daemon.client() as client:
        for speculative in (False, True):
            session = client.open_session()
            session.append(message={"role": "user", "content": prompt})
            results[speculative] = session.generate(max_tokens=100, json_schema=RECORD_SCHEMA,
                                                    speculative=speculative, **sampling)
    plain, spec = results[False], results[True]
    assert (spec.token_ids, spec.text, spec.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
    assert json.loads(spec.text).keys() == RECORD.keys()
    assert plain.usage["draft_tokens"] == 0
    assert spec.usage["draft_tokens"] >= spec.usage["accepted_tokens"] >= 10
    assert spec.usage["decode_steps"] < plain.usage["decode_steps"]
    if not sampling:
        assert json.loads(spec.text) == RECORD  # greedy, the model copies it whole


def test_bad_draft_options_are_refused(daemon):
    from ellm.errors import BadRequest

    with daemon.client() as client:
        session = client.open_session()
        session.append(message={"role": "user", "content": "Hi."})
        for bad in ({"draft_tokens": -1}, {"draft_tokens": 1000}, {"speculative": "yes"}):
            with pytest.raises(BadRequest):
                session.generate(max_tokens=2, **bad)
        assert session.generate(max_tokens=2).usage["generated_tokens"] == 2


def test_metrics_count_drafted_and_accepted_tokens():
    from ellmd.server.metrics import Metrics

    class Runtime_:
        observers: list = []

    counters = {"prefilled": 5, "reused": 0, "shared": 0, "generated": 9, "drafted": 12, "accepted": 7}
    gauges = dict.fromkeys(("sessions_resident", "sessions_stored", "generating", "kv_bytes_used", "kv_bytes"), 0)
    text = Metrics(Runtime_()).render({"counters": counters, **gauges}).decode()
    assert "ellm_draft_tokens_total 12.0" in text and "ellm_draft_tokens_accepted_total 7.0" in text
