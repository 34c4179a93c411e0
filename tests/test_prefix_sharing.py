"""Prefix sharing with the real daemon: a new session whose first tokens another session holds
copies that KV (between slots, or from the store) instead of prefilling it, and computes exactly
what a session prefilled from scratch computes."""

from __future__ import annotations

import pytest

from daemon import Daemon

SHARED = list(range(1000, 1300))  # a 300-token prefix: a system prompt, a tool list
TAIL = list(range(5000, 5040))  # the turn after it
GREEDY = {"max_tokens": 8, "temperature": 0, "logprobs": 5}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("prefix"), slots=2).start()
    yield d
    assert d.stop() == 0


def counters(client) -> dict:
    return client.stats()["counters"]


def test_a_copied_prefix_computes_what_a_prefill_from_scratch_does(daemon):
    with daemon.client() as client:
        # From scratch (the first session of the daemon: nobody to share with): the prefix, a turn.
        scratch = client.open_session(title="from scratch")
        first = scratch.append(tokens=SHARED)["usage"]
        assert first["prefilled_tokens"] == len(SHARED) and first["shared_tokens"] == 0
        scratch.append(tokens=TAIL)
        reference = scratch.generate(**GREEDY)

        # The same turns in a new session: the prefix is copied from the resident one, not run.
        before = counters(client)
        copied = client.open_session(title="copied")
        usage = copied.append(tokens=SHARED)["usage"]
        assert usage["prefilled_tokens"] == 0
        assert usage["shared_tokens"] == usage["reused_tokens"] == len(SHARED)
        assert copied.append(tokens=TAIL)["usage"]["prefilled_tokens"] == len(TAIL)
        result = copied.generate(**GREEDY)
        assert result.token_ids == reference.token_ids
        assert [t["top"] for t in result.logprobs] == [t["top"] for t in reference.logprobs]  # bit-identical
        after = counters(client)
        # only the tail ran through the model (and its last token again, for the generation's logits)
        assert after["prefilled"] - before["prefilled"] == len(TAIL) + 1
        assert after["shared"] - before["shared"] == len(SHARED)

        # A longer prompt shares the longest prefix any session holds, and prefills the rest.
        other_tail = list(range(7000, 7025))
        partial = client.open_session(title="partial").append(tokens=SHARED + TAIL[:10] + other_tail)["usage"]
        assert partial["shared_tokens"] == len(SHARED) + 10
        assert partial["prefilled_tokens"] == len(other_tail)
        assert partial["prompt_tokens"] == len(SHARED) + 10 + len(other_tail)


def test_a_prefix_is_read_back_from_the_store_once_its_session_was_evicted(daemon):
    with daemon.client() as client:
        for info in client.list_sessions():  # start over: free every slot
            client.session(info["session_id"]).delete()
        donor = client.open_session(title="donor")
        donor.append(tokens=SHARED)
        donor.append(tokens=TAIL)
        reference = donor.generate(**GREEDY)
        for i in range(2):  # two unrelated sessions take both slots: the donor leaves for the store
            client.open_session(title=f"filler {i}").append(tokens=list(range(9000 + 100 * i, 9050 + 100 * i)))
        assert not donor.info()["resident"]
        copied = client.open_session(title="from the store")
        usage = copied.append(tokens=SHARED)["usage"]
        assert usage["prefilled_tokens"] == 0 and usage["shared_tokens"] == len(SHARED)
        copied.append(tokens=TAIL)
        result = copied.generate(**GREEDY)
        assert result.token_ids == reference.token_ids
        assert [t["top"] for t in result.logprobs] == [t["top"] for t in reference.logprobs]


def test_sessions_opened_with_the_same_system_prompt_share_it(daemon):
    system = "You are a careful assistant. " * 30 + "Answer in one word."
    with daemon.client() as client:
        first = client.open_session(title="agent 1", system=system)
        prompt = first.info()["tokens"]
        before = counters(client)
        second = client.open_session(title="agent 2", system=system)
        after = counters(client)
        assert second.info()["tokens"] == prompt > 150
        assert after["prefilled"] == before["prefilled"] and after["shared"] - before["shared"] == prompt
        one, two = first.chat("Name a color.", max_tokens=6), second.chat("Name a color.", max_tokens=6)
        assert one.token_ids == two.token_ids
        assert two.usage["prefilled_tokens"] < 20 < two.usage["reused_tokens"]
