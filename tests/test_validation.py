"""The validation layer: schemas of every op, and the real daemon refusing what used to kill it."""

from __future__ import annotations

import inspect
import math

import msgspec
import pytest

from ellm.errors import BadRequest as ClientBadRequest
from ellm.errors import NotFound
from ellmd.errors import BadRequest
from ellmd.runtime import schemas
from ellmd.runtime.store.meta import check_meta
from ellmd.runtime.ops import OPS

from daemon import Daemon

VOCAB = 49152  # SmolLM2's


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_schema_field_binds_to_its_handler(op):
    """What the schema lets through is exactly what the handler takes (owner is the request's)."""
    fields = {f.name: f for f in msgspec.structs.fields(OPS[op].schema) if f.name != "owner"}
    params = inspect.signature(OPS[op].handler).parameters
    named = {n: p for n, p in params.items()
             if p.kind is p.POSITIONAL_OR_KEYWORD and n not in ("rt", "request", "link")}
    sampling = {f.name for f in msgspec.structs.fields(schemas.Sampling)} - {"owner"}
    takes_sampling = any(p.kind is p.VAR_KEYWORD for p in params.values())
    assert set(fields) - set(named) == (sampling if takes_sampling else set())
    assert set(named) <= set(fields)
    assert {n for n, p in named.items() if p.default is p.empty} == {n for n, f in fields.items() if f.required}


GENERATE = {"session_id": "s1"}
BAD = [  # (op, args, words the error must contain)
    ("session.generate", {**GENERATE, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("session.generate", {**GENERATE, "logit_bias": {5: math.inf}}, "logit_bias"),
    ("session.generate", {**GENERATE, "logit_bias": {"x": 1}}, "logit_bias"),
    ("session.generate", {**GENERATE, "stop_token_ids": [[1]]}, "stop_token_ids"),
    ("session.generate", {**GENERATE, "stop_token_ids": 5}, "stop_token_ids"),
    ("session.generate", {**GENERATE, "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ("session.generate", {**GENERATE, "stop": [1]}, "stop"),
    ("session.generate", {**GENERATE, "stop": "x"}, "stop"),
    ("session.generate", {**GENERATE, "top_k": 2.5}, "top_k"),
    ("session.generate", {**GENERATE, "top_k": -1}, "top_k"),
    ("session.generate", {**GENERATE, "presence_penalty": "x"}, "presence_penalty"),
    ("session.generate", {**GENERATE, "presence_penalty": -1e308}, "presence_penalty"),
    ("session.generate", {**GENERATE, "temperature": 1e-40}, "temperature"),
    ("session.generate", {**GENERATE, "temperature": math.nan}, "temperature"),
    ("session.generate", {**GENERATE, "temperature": -1}, "temperature"),
    ("session.generate", {**GENERATE, "seed": -3}, "seed"),
    ("session.generate", {**GENERATE, "max_tokens": True}, "max_tokens"),
    ("session.generate", {**GENERATE, "self": 1}, "self"),
    ("session.generate", {}, "session_id"),
    ("session.generate", {"session_id": 7}, "session_id"),
    ("session.info", {"session_id": "../etc"}, "session_id"),
    ("session.info", {"session_id": "x" * 65}, "session_id"),
    ("session.open", {"tools": [{"name": "f", 7: "x"}]}, r"tools\[0\] \(a key\): Expected `str`"),
    ("session.open", {"tools": [{"f": {7: "x"}}]}, r"tools\[0\].f: map keys must be strings"),
    ("session.open", {"tools": [{"a": {"b": math.nan}}]}, "finite"),
    ("session.open", {"tools": [{"a": b"bin"}]}, "not a JSON value"),
    ("session.open", {"tools": "x"}, "tools"),
    ("session.open", {"tags": [1]}, "tags"),
    ("session.open", {"title": ["x"]}, "title"),
    ("session.append", {"session_id": "s1", "text": "a", "tokens": [1]}, "exactly one"),
    ("session.append", {"session_id": "s1", "tokens": [-1]}, "tokens"),
    ("session.append", {"session_id": "s1", "message": {"content": "x"}}, "role"),
    ("session.chat", {"session_id": "s1"}, "content"),
    ("session.chat", {"session_id": "s1", "content": "hi", "colour": "blue"}, "colour"),
    ("session.rewind", {"session_id": "s1"}, "turn or tokens"),
    ("session.rewind", {"session_id": "s1", "turn": -1}, "turn"),
    ("completion", {"tokens": []}, "tokens"),
    ("completion", {"tokens": [1], "messages": [{"role": "user", "content": math.inf}]}, "finite"),
    ("rag.inject", {"session_id": "s1", "query": "q", "index": "../x"}, "index"),
    ("rag.inject", {"session_id": "s1", "query": "q", "index": "/abs"}, "index"),
    ("rag.inject", {"session_id": "s1", "documents": [{"source": "s"}]}, "text"),
    ("rag.remove", {"name": ".."}, "name"),
    ("rag.index", {"path": "/tmp/a\x00b"}, "path must match"),
    ("skill.load", {"session_id": "s1", "name": "x", "file": "a\x00"}, "file must match"),
    ("session.import", {"data": "not bytes"}, "data"),
    ("session.open", {"owner": "bad owner!"}, "owner"),
    ("stats", {"x": 1}, "x"),
]


@pytest.mark.parametrize("op,args,words", BAD, ids=[f"{op}-{i}" for i, (op, _, _) in enumerate(BAD)])
def test_bad_arguments_name_the_field_and_rule(op, args, words):
    with pytest.raises(BadRequest, match=words):
        OPS[op].arguments(args, VOCAB)


def test_good_arguments_come_back_typed():
    args = OPS["session.chat"].arguments({"session_id": "s1", "content": "hi", "temperature": 1,
                                          "logit_bias": {"5": 3, 7: -1}, "stop": ["x"], "seed": None}, VOCAB)
    assert args == {"session_id": "s1", "content": "hi", "temperature": 1.0, "logit_bias": {5: 3.0, 7: -1.0},
                    "stop": ["x"]}
    assert isinstance(args["temperature"], float)
    assert OPS["rag.inject"].arguments({"session_id": "a", "documents": ["x", {"text": "y"}]}, VOCAB)[
        "documents"] == ["x", {"text": "y", "source": None}]


def test_stored_metadata_is_checked():
    meta = {"session_id": "s1", "fingerprint": {"model": "m"}, "tokens": 3, "chunks": 1,
            "turns": [{"index": 0, "kind": "tokens", "start": 0, "end": 3, "messages": 0, "time": 1.0}]}
    assert check_meta(meta, [1, 2, 3], VOCAB)["tokens"] == 3
    for broken, words in [({"tokens": "3"}, "tokens"), ({"fingerprint": None}, "fingerprint"),
                          ({"session_id": "a/b"}, "session_id"), ({"colour": 1}, "colour"),
                          ({"turns": [{**meta["turns"][0], "end": 9}]}, "outside"),
                          ({"tools": [{1: "x"}]}, "a key"), ({"messages": [{"a": [{2: 1}]}]}, "keys must be strings")]:
        with pytest.raises(BadRequest, match=words):
            check_meta({**meta, **broken})
    with pytest.raises(BadRequest, match="missing required field `chunks`"):
        check_meta({k: v for k, v in meta.items() if k != "chunks"})
    with pytest.raises(BadRequest, match="outside the vocabulary"):
        check_meta(meta, [1, 2, VOCAB], VOCAB)


# ---- against the real daemon ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("validation"), slots=2).start()
    yield d
    assert d.stop() == 0


KILLERS = [  # each of these took the daemon down before the validation layer
    {"logit_bias": {"99999999": 1}}, {"stop_token_ids": [[1]]}, {"stop_token_ids": 5}, {"stop": [1]},
    {"top_k": 2.5}, {"presence_penalty": "x"}, {"temperature": 1e-40}, {"logit_bias": {"5": math.inf}},
    {"presence_penalty": -1e308}, {"self": 1},
]


def test_requests_that_killed_the_daemon_are_bad_requests_and_change_nothing(daemon):
    with daemon.client() as client:
        session = client.open_session(system="Be brief.")
        session.chat("Name a colour.", max_tokens=3)
        before = session.info()
        for sampling in KILLERS:
            for op, extra in (("session.generate", {}), ("session.chat", {"content": "again?"})):
                with pytest.raises(ClientBadRequest):
                    client.call(op, session_id=session.id, **extra, **sampling)
        assert session.info() == before  # chat stored no user message: a retry does not duplicate it
        with pytest.raises(ClientBadRequest, match="a key"):
            client.call("session.open", tools=[{"type": "function", 7: "x"}])
        assert any(s["session_id"] == session.id for s in client.list_sessions())
        reply = session.chat("And another?", max_tokens=3, temperature=0.7, seed=1, top_k=5,
                             logit_bias={"42": 2.5}, presence_penalty=-2)
        assert len(reply.token_ids) >= 1


def test_no_tokens_asked_is_refused_and_changes_nothing(daemon):
    """max_tokens 0 used to generate one token (finish "length"): refused, naming max_tokens."""
    with daemon.client() as client:
        session = client.open_session(system="Be brief.")
        before = session.info()
        for op, extra in (("session.generate", {}), ("session.chat", {"content": "Hi"})):
            with pytest.raises(ClientBadRequest, match="max_tokens: Expected `int` >= 1"):
                client.call(op, session_id=session.id, max_tokens=0, **extra)
        with pytest.raises(ClientBadRequest, match="max_tokens"):
            client.call("completion", tokens=[1, 2, 3], max_tokens=0)
        assert session.info() == before
        assert len(session.chat("Hi", max_tokens=1).token_ids) == 1


def test_over_long_system_prompt_leaves_no_ghost_session(daemon):
    with daemon.client() as client:
        resident = client.stats()["sessions_resident"]
        listed = len(client.list_sessions())
        with pytest.raises(Exception, match="sequence length"):
            client.open_session(system="word " * 3000)
        assert client.stats()["sessions_resident"] == resident
        assert len(client.list_sessions()) == listed


def test_owner_hides_a_session_from_other_owners(daemon):
    with daemon.client() as client:
        opened = client.call("session.open", title="mine", owner="key-a")
        sid = opened["session_id"]
        client.call("session.append", session_id=sid, text="Hello there.", owner="key-a")
        assert client.call("session.info", session_id=sid, owner="key-a")["title"] == "mine"
        for op in ("session.info", "session.snapshot", "session.export", "session.fork", "session.delete"):
            with pytest.raises(NotFound, match=f"no session '{sid}'"):
                client.call(op, session_id=sid, owner="key-b")
        with pytest.raises(NotFound):
            client.call("session.append", session_id=sid, text="x", owner="key-b")
        with pytest.raises(NotFound):  # a completion naming it does not take it over either
            client.call("completion", tokens=[1, 2, 3], session_id=sid, owner="key-b", max_tokens=1)
        listed_b = {s["session_id"] for s in client.call("session.list", owner="key-b")["sessions"]}
        assert sid not in listed_b
        assert sid in {s["session_id"] for s in client.call("session.list", owner="key-a")["sessions"]}
        assert client.session(sid).info()["tokens"] > 0  # the local user (no owner) reaches every session
        client.call("session.close", session_id=sid, owner="key-a")
        with pytest.raises(NotFound):  # also once it is only in the store
            client.call("session.info", session_id=sid, owner="key-b")
        assert client.call("session.info", session_id=sid, owner="key-a")["tokens"] > 0


def test_import_refuses_foreign_and_bad_blobs_as_bad_request(daemon):
    import msgpack

    with daemon.client() as client:
        with pytest.raises(ClientBadRequest, match="not an exported ellm session"):
            client.call("session.import", data=b"\x93\x01\x02\x03")
        session = client.open_session()
        session.append(text="Some words to export.")
        blob = client.call("session.export", session_id=session.id)  # streamed events are dropped by call
        assert blob["bytes"] > 0
        pieces = bytearray()
        for piece in client.stream("session.export", session_id=session.id):
            pieces += piece["data"]
        document = msgpack.unpackb(bytes(pieces), raw=False)
        document["tokens"] = (b"\xff\xff\xff\x7f" + document["tokens"][4:])  # a token id outside the vocabulary
        with pytest.raises(ClientBadRequest, match="outside the vocabulary"):
            client.call("session.import", data=msgpack.packb(document, use_bin_type=True))
        document = msgpack.unpackb(bytes(pieces), raw=False)
        del document["meta"]["fingerprint"]
        with pytest.raises(ClientBadRequest, match="fingerprint"):
            client.call("session.import", data=msgpack.packb(document, use_bin_type=True))
        imported = client.call("session.import", data=bytes(pieces))
        assert imported["tokens"] == session.info()["tokens"]
