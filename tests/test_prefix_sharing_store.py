"""Stored sessions as prefix donors, with the real daemon: a new session whose first tokens begin as
a stored session of the same owner begins (one closed, stored by an earlier run of the daemon, or
imported) reads that prefix's KV from the store instead of prefilling it, computes what a prefill
from scratch computes, and leaves the donor stored as it was; a session of another owner, or a
deleted one, donates nothing."""

from __future__ import annotations

import io

from daemon import Daemon
from test_owners import ALICE, BOB, cached, start
from test_security import http

PARENT = list(range(1000, 1300))  # a parent agent's context: 300 tokens
OWN = list(range(3000, 3030))  # the parent's own turn after it
TASK = list(range(5000, 5040))  # a sub-agent's task, after the parent's context
GREEDY = {"max_tokens": 8, "temperature": 0, "logprobs": 5}


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

            # deleted, it donates nothing; imported again, it does
            blob = io.BytesIO()
            donor.export(blob)
            donor.delete()
            child.delete()
            other = client.open_session(title="after the delete")
            usage = other.append(tokens=PARENT + TASK)["usage"]
            assert (usage["shared_tokens"], usage["prefilled_tokens"]) == (0, len(PARENT) + len(TASK))
            other.delete()
            imported = client.import_session(blob.getvalue())
            usage = client.open_session(title="after the import").append(tokens=PARENT + TASK)["usage"]
            assert (usage["shared_tokens"], usage["prefilled_tokens"]) == (len(PARENT), len(TASK))
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
