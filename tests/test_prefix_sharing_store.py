"""Stored sessions as prefix donors, with the real daemon: a new session whose first tokens begin as
a stored session of the same owner begins (one closed, stored by an earlier run of the daemon, or
imported) reads that prefix's KV from the store instead of prefilling it, computes what a prefill
from scratch computes, and leaves the donor stored as it was; a session of another owner, or a
deleted one, donates nothing."""

from __future__ import annotations

import io

from ellmd.runtime.donors import BLOCK_TOKENS, PrefixIndex

from daemon import Daemon
from test_owners import ALICE, BOB, cached, start
from test_security import http

PARENT = list(range(1000, 1300))  # a parent agent's context: 300 tokens
OWN = list(range(3000, 3030))  # the parent's own turn after it
TASK = list(range(5000, 5040))  # a sub-agent's task, after the parent's context
GREEDY = {"max_tokens": 8, "temperature": 0, "logprobs": 5}


def share(client) -> int:
    """Tokens a new session appending PARENT + TASK shares (the session is deleted after)."""
    session = client.open_session(title="a sub-agent")
    usage = session.append(tokens=PARENT + TASK)["usage"]
    session.delete()
    assert usage["prefilled_tokens"] == len(PARENT) + len(TASK) - usage["shared_tokens"]
    return usage["shared_tokens"]


def test_the_index_finds_the_stored_session_sharing_the_most_whole_blocks_of_the_same_owner():
    index = PrefixIndex()
    index.put("short", "alice", PARENT[:100])
    index.put("long", "alice", PARENT + OWN)
    index.put("bob's", "bob", PARENT + TASK)
    assert index.find("alice", PARENT + TASK, exclude="") == ("long", 288)  # 9 whole blocks of 32
    assert index.find("alice", PARENT[:70] + TASK, exclude="") == ("long", 64)
    assert index.find("alice", PARENT + TASK, exclude="long") == ("short", 96)
    assert index.find(None, PARENT + TASK, exclude="") == (None, 0)  # the operator's: nobody's here
    assert index.find("alice", PARENT[:BLOCK_TOKENS - 1], exclude="") == (None, 0)  # no whole block
    index.put("long", "alice", PARENT[:40])  # rewound
    assert index.find("alice", PARENT + TASK, exclude="") == ("short", 96)
    index.remove("short")
    assert index.find("alice", PARENT + TASK, exclude="") == ("long", 32)
    index.remove("long")
    index.remove("bob's")
    assert len(index) == 0 and index.find("bob", PARENT + TASK, exclude="") == (None, 0)


def test_a_stored_session_donates_its_prefix_across_a_restart(tmp_path):
    first = Daemon(tmp_path, slots=2).start()
    try:
        with first.client() as client:
            # the reference, from scratch (nothing shares a token with it), then deleted
            scratch = client.open_session(title="from scratch")
            usage = scratch.append(tokens=PARENT)["usage"]
            assert usage["shared_tokens"] == 0 and usage["prefilled_tokens"] == len(PARENT)
            scratch.append(tokens=TASK)
            reference = scratch.generate(**GREEDY)
            scratch.delete()
            parent = client.open_session(title="parent")
            assert parent.append(tokens=PARENT + OWN)["usage"]["shared_tokens"] == 0  # a deleted session donates nothing
            parent.close()  # out of memory: only the store holds it
            child = client.open_session(title="child")
            usage = child.append(tokens=PARENT + TASK)["usage"]
            assert (usage["shared_tokens"], usage["prefilled_tokens"]) == (len(PARENT), len(TASK))
            child.delete()
            stored = client.session(parent.id).info()
    finally:
        assert first.stop() == 0

    second = Daemon(tmp_path, slots=2).start()  # the same store, nothing in memory
    try:
        with second.client() as client:
            before = client.stats()["counters"]
            child = client.open_session(title="child after a restart")
            usage = child.append(tokens=PARENT + TASK)["usage"]
            assert usage["shared_tokens"] == usage["reused_tokens"] == len(PARENT)
            assert usage["prefilled_tokens"] == len(TASK)  # the sub-agent prefills only its task
            result = child.generate(**GREEDY)
            assert result.token_ids == reference.token_ids
            assert [t["top"] for t in result.logprobs] == [t["top"] for t in reference.logprobs]  # bit-identical
            assert client.stats()["counters"]["shared"] - before["shared"] == len(PARENT)

            donor = client.session(parent.id)
            info = donor.info()  # stored as it was: not resumed, not changed
            assert info["resident"] is False
            assert (info["tokens"], info["turns"], info["updated"]) == (stored["tokens"], stored["turns"], stored["updated"])

            # rewound and stored again, it donates what it holds now
            child.delete()
            donor.rewind(tokens=100)
            donor.close()
            assert share(client) == 100

            # deleted, it donates nothing; imported again, it does
            blob = io.BytesIO()
            donor.export(blob)
            donor.delete()
            assert share(client) == 0
            imported = client.import_session(blob.getvalue())
            assert share(client) == 100
            assert imported.info()["resident"] is False
    finally:
        assert second.stop() == 0


def test_only_a_stored_session_of_the_same_owner_donates(tmp_path):
    question = {"messages": [{"role": "user", "content": "Summarize these notes. " + " ".join(
        f"Note {i}: the build of module {i} passed." for i in range(40))}], "max_tokens": 2, "temperature": 0}

    def ask(daemon, key, session_id):
        status, _, body = http(daemon.port, "/v1/chat/completions", {**question, "session_id": session_id}, key=key)
        assert status == 200, body
        return body

    first = start(tmp_path)
    try:
        assert cached(ask(first, ALICE, "parent")) == 0
    finally:
        assert first.stop() == 0
    second = start(tmp_path)  # Alice's session is in the store only
    try:
        assert cached(ask(second, BOB, "child")) == 0  # the same prompt: not from Alice's session
        body = ask(second, ALICE, "child")
        assert body["usage"]["prompt_tokens"] > 300
        assert cached(body) == body["usage"]["prompt_tokens"] - 1  # all but the token whose logits start the reply
    finally:
        assert second.stop() == 0
    third = start(tmp_path, extra=("--kv-dtype", "q8_0"))  # Alice's sessions hold bf16 KV: no donors of q8_0 KV
    try:
        assert cached(ask(third, ALICE, "child-q8_0")) == 0
    finally:
        assert third.stop() == 0
