"""Fleet replicas on one store (LMDB, then a directory): sessions handed over with session.release,
refused while another replica holds them, taken over at once from a SIGKILLed one; every
continuation checked against a lone daemon that kept the session all along."""

from __future__ import annotations

import pytest
from ellm.errors import EllmError, Leased

from daemon import Daemon

GREEDY = dict(max_tokens=8, temperature=0, logprobs=3)
TURNS = ["Hello there, who are you?", "Tell me one more thing.", "And a third?"]


def replica(tmp, name: str, store, backend: str, slots: int = 2) -> Daemon:
    """`ellmd start --replica NAME` on the shared store (its own socket and log)."""
    folder = tmp / name
    folder.mkdir(mode=0o700)
    d = Daemon(folder, slots=slots, extra=("--replica", name, "--store-backend", backend, "--lease-ttl-s", "3"))
    d.store = store
    d.args[d.args.index("--store") + 1] = str(store)
    return d.start()


@pytest.fixture(scope="module")
def lone(tmp_path_factory):
    """The reference: one daemon, its own store, never releasing anything."""
    d = Daemon(tmp_path_factory.mktemp("lone")).start()
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module", params=["lmdb", "directory"])
def fleet(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"fleet-{request.param}")
    store = tmp / "store"
    a = replica(tmp, "a", store, request.param)
    b = replica(tmp, "b", store, request.param)
    yield request.param, store, a, b
    assert b.stop() == 0
    if a.process.poll() is None:  # the last test SIGKILLs it (unless deselected)
        assert a.stop() == 0


@pytest.fixture(scope="module")
def expected(lone):
    """The generations of a lone daemon's session over TURNS."""
    with lone.client() as client:
        session = client.open_session(system="You are terse.")
        return [session.chat(turn, **GREEDY) for turn in TURNS]


def same(got, expected) -> None:
    assert got.token_ids == expected.token_ids and got.text == expected.text
    assert got.logprobs == expected.logprobs  # bit-identical KV gives bit-identical logits


def test_a_released_session_continues_on_another_replica(fleet, expected):
    backend, _, a, b = fleet
    with a.client() as on_a, b.client() as on_b:
        session = on_a.open_session(system="You are terse.")
        same(session.chat(TURNS[0], **GREEDY), expected[0])
        held = on_b.session(session.id)
        with pytest.raises(Leased, match=f"session {session.id} is held by replica a \\(host .*, pid {a.process.pid}\\)"):
            held.chat(TURNS[1], **GREEDY)
        with pytest.raises(Leased, match="held by replica a"):  # a client-chosen id, as over HTTP, is leased too
            on_b.call("completion", tokens=[1, 2, 3], session_id=session.id, max_tokens=1)
        tokens = session.info()["tokens"]
        assert session.release() == {"session_id": session.id, "tokens": tokens, "released": True}
        assert session.release()["released"] is False  # a does not hold it any more: not an error
        second = held.chat(TURNS[1], **GREEDY)
        same(second, expected[1])
        # b read the KV back: it prefilled what the lone daemon did (the new turn and a's pending tokens)
        counts = ("prompt_tokens", "prefilled_tokens", "reused_tokens", "shared_tokens", "generated_tokens")
        assert {k: second.usage[k] for k in counts} == {k: expected[1].usage[k] for k in counts}
        with pytest.raises(Leased, match=f"held by replica b \\(host .*, pid {b.process.pid}\\)"):
            session.info()
        assert held.release()["released"] is True
        third = session.chat(TURNS[2], **GREEDY)  # back on a, which must read b's turn from the store
        same(third, expected[2])
        assert [t["kind"] for t in session.info()["turns"]] == ["message"] + ["message", "generation"] * 3
        assert on_a.stats()["replica"] == "a" and on_a.stats()["store"]["backend"] == backend


def test_a_new_session_made_on_one_replica_is_found_by_the_other(fleet):
    _, _, a, b = fleet
    with a.client() as on_a, b.client() as on_b:
        on_b.call("completion", tokens=[5, 6, 7, 8], session_id="made-on-b", max_tokens=2, temperature=0)
        with pytest.raises(Leased, match="held by replica b"):
            on_a.session("made-on-b").info()
        assert "made-on-b" in [s["session_id"] for s in on_a.list_sessions()]
        on_b.session("made-on-b").release()
        assert on_a.session("made-on-b").info()["tokens"] == 4 + 2
        on_a.session("made-on-b").delete()
        with pytest.raises(EllmError, match="no session"):
            on_b.session("made-on-b").info()


def test_a_lone_daemon_is_refused_while_replicas_share_the_store(fleet, tmp_path):
    _, store, _, _ = fleet
    alone = Daemon(tmp_path)
    alone.args[alone.args.index("--store") + 1] = str(store)
    with pytest.raises(RuntimeError, match="daemon exited"):
        alone.start()
    assert f"the store at {store} is in use by fleet replicas" in alone.log.read_text()


def test_a_sigkilled_replica_s_sessions_are_taken_over_at_once(fleet, expected):
    """(Last: it kills replica a.)"""
    _, _, a, b = fleet
    with a.client() as on_a:
        session = on_a.open_session(system="You are terse.")
        acknowledged = [session.chat(turn, **GREEDY) for turn in TURNS[:2]]
        turns = session.info()["turns"]
    a.kill()  # its lease is still in the store, unexpired (TTL 3 s)
    for got, want in zip(acknowledged, expected):
        same(got, want)
    with b.client() as on_b:
        taken = on_b.session(session.id)
        assert taken.info()["turns"] == turns  # every acknowledged turn
        same(taken.chat(TURNS[2], **GREEDY), expected[2])
        taken.release()
