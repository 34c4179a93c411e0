"""Requests a hostile or careless client sends, against the real daemon: constraints deep enough to
overflow a thread's stack, text the store cannot encode, and fuzzed structured-output, Responses and
Anthropic bodies. Each gets a reply (a 400 naming the limit or the field) and the daemon serves on.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ellm.errors import BadRequest, Busy, CapacityError
from ellmd.text.constraints import LIMITS

from test_http import post, start_daemon

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    daemon, port = start_daemon(tmp_path_factory.mktemp("hostile"), slots=2)
    yield daemon, port
    assert daemon.stop() == 0


def serving(smol) -> bool:
    daemon, port = smol
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as reply:
        healthy = json.load(reply) == {"status": "ok"}
    return healthy and daemon.process.poll() is None


def ref_chain(links: int) -> dict:
    """A schema of `links` chained `$ref`s, nested 4 levels deep at most (the depth check passes)."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(links)}
    defs[f"d{links}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def rule_chain(rules: int) -> str:
    """A Lark grammar of `rules` chained rules."""
    return "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(rules - 1)) + f'r{rules - 1}: "b"\n'


# Each entry point of a JSON Schema: (path, body) over HTTP.
SCHEMA_BODIES = {
    "chat response_format": lambda schema: ("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
    "chat guided_json": lambda schema: ("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "guided_json": schema}),
    "anthropic output_config": lambda schema: ("/v1/messages", {"model": "m", "messages": HI, "max_tokens": 2,
                                                                "output_config": {"format": {"type": "json_schema",
                                                                                             "schema": schema}}}),
    "responses text.format": lambda schema: ("/v1/responses", {"input": "Hi", "max_output_tokens": 2, "text": {
        "format": {"type": "json_schema", "name": "x", "schema": schema}}}),
}


@pytest.mark.parametrize("entry", SCHEMA_BODIES)
def test_a_ref_chain_compiles_within_the_limit_and_is_refused_beyond(smol, entry):
    # 1,200 links overflowed the 8 MiB stack of the thread that compiled them: SIGSEGV
    status, body = post(smol[1], *encoded(SCHEMA_BODIES[entry](ref_chain(1_200))))
    assert status == 200, body
    status, body = post(smol[1], *encoded(SCHEMA_BODIES[entry](ref_chain(LIMITS["refs"] + 1))))
    assert status == 400 and f"refs is beyond the limit of {LIMITS['refs']}" in json.dumps(body)
    assert serving(smol)


def test_a_rule_chain_compiles_within_the_limit_and_is_refused_beyond(smol):
    chat = {"messages": HI, "max_tokens": 2}
    status, body = post(smol[1], *encoded(("/v1/chat/completions", {**chat, "guided_grammar": rule_chain(3_000)})))
    assert status == 200, body
    too_many = rule_chain(LIMITS["rules"] + 1)
    status, body = post(smol[1], *encoded(("/v1/chat/completions", {**chat, "guided_grammar": too_many})))
    assert status == 400 and body["error"]["message"].endswith(f"rules is beyond the limit of {LIMITS['rules']}")
    assert serving(smol)


def test_socket_constraints_are_bounded_too(smol):
    with smol[0].client() as unix:
        session = unix.open_session()
        reply = session.chat("Hi", json_schema=ref_chain(1_200), max_tokens=2)
        assert reply.usage["generated_tokens"] == 2
        with pytest.raises(BadRequest, match=f"refs is beyond the limit of {LIMITS['refs']}"):
            session.chat("Hi", json_schema=ref_chain(LIMITS["refs"] + 1), max_tokens=2)
        with pytest.raises(BadRequest, match=f"rules is beyond the limit of {LIMITS['rules']}"):
            session.chat("Hi", grammar=rule_chain(LIMITS["rules"] + 1), max_tokens=2)
        enum = {"enum": [f"v{i}" for i in range(LIMITS["enum_values"] + 1)]}
        with pytest.raises(BadRequest, match="enum values is beyond the limit"):
            session.chat("Hi", json_schema=enum, max_tokens=2)
        assert len(session.info()["turns"]) == 2  # the refused requests appended nothing
    assert serving(smol)


def test_requests_on_a_session_keep_their_order_while_a_constraint_compiles(smol):
    with smol[0].client() as unix:
        session = unix.open_session()
        first = unix.stream("session.chat", session_id=session.id, content="One",
                            json_schema=ref_chain(1_999), max_tokens=2)  # not cached: compiles for a while
        try:  # pipelined: it waits behind the chat (and finds it generating), it does not pass it
            unix.call("session.append", session_id=session.id, message={"role": "user", "content": "Two"})
        except Busy:
            pass
        for _ in first:
            pass
        kinds = [turn["kind"] for turn in session.info()["turns"]]
        assert kinds[:2] == ["message", "generation"]  # the chat's turns first, the append's (if any) after


def encoded(request: tuple[str, dict]) -> tuple[str, bytes]:
    path, body = request
    return path, json.dumps(body).encode()


# ---- text the store cannot hold -------------------------------------------------------------

SURROGATE = "\ud800"
# (path, body, the field named) for every kind of field a session or a stored response keeps
UNSTORABLE = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" + SURROGATE}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a", "name": SURROGATE}]}, "messages[0].name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a", "x": {SURROGATE: 1}}]},
     "messages[0].x (a key)"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {
        "name": "f", "description": SURROGATE, "parameters": {"type": "object"}}}]}, "tools[0].function.description"),
    ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
    ("/v1/responses", {"input": "Hi", "metadata": {"note": SURROGATE}}, "metadata.note"),
    ("/v1/responses", {"input": "Hi", "instructions": SURROGATE}, "instructions"),
    ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": HI, "system": SURROGATE}, "system"),
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": SURROGATE}]},
     "messages[0].content"),
]


@pytest.mark.parametrize("path, body, where", UNSTORABLE, ids=[where for *_, where in UNSTORABLE])
def test_a_lone_surrogate_is_a_400_naming_the_field(smol, path, body, where):
    status, reply = post(smol[1], path, json.dumps({**body, "max_tokens": 2, "session_id": "sur-1"}).encode())
    assert status == 400, reply
    assert f"{where}: text with a lone surrogate" in json.dumps(reply)


def test_unstorable_chats_pin_no_slot(smol):
    # Two sessions the store could not snapshot held both slots of this 2-slot daemon for good.
    for i in range(2):
        body = {"messages": [{"role": "user", "content": "Hi", "x": SURROGATE}], "max_tokens": 2,
                "session_id": f"pinned-{i}"}
        assert post(smol[1], "/v1/chat/completions", json.dumps(body).encode())[0] == 400
    for i in range(3):
        body = {"messages": HI, "max_tokens": 2, "session_id": f"after-{i}"}
        status, reply = post(smol[1], "/v1/chat/completions", json.dumps(body).encode())
        assert status == 200, reply


# ---- accepted requests round-trip through the store -------------------------------------------

text = st.text(st.characters(codec="utf-8"), max_size=40)  # any character UTF-8 holds (no surrogates)


def json_of(strings):
    return st.recursive(st.none() | st.booleans() | st.integers(-1000, 1000) | strings,
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(strings, inner, max_size=3),
                        max_leaves=8)


json_values = json_of(text)
message = st.fixed_dictionaries({"role": st.just("user"), "content": text},
                                optional={"name": text.filter(str.strip), "extra": json_values})


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(messages=st.lists(message, min_size=1, max_size=3), title=text, metadata=st.dictionaries(
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=16), text, max_size=3))
def test_accepted_requests_round_trip_through_snapshot_and_resume(smol, messages, title, metadata):
    counter = next(ROUND_TRIPS)
    chat = {"messages": messages, "max_tokens": 2, "temperature": 0, "session_id": f"rt-{counter}"}
    status, reply = post(smol[1], "/v1/chat/completions", json.dumps(chat).encode())
    if status != 200:  # refused (a template that will not render it): refused cleanly
        assert status == 400, reply
        return
    response = {"input": [{"role": "user", "content": m["content"]} for m in messages], "max_output_tokens": 2,
                "metadata": metadata, "instructions": title}
    status, stored = post(smol[1], "/v1/responses", json.dumps(response).encode())
    assert status == 200, stored
    with smol[0].client() as unix:
        for session_id in (reply["session_id"], stored["session_id"] if "session_id" in stored else None):
            if session_id is None:
                continue
            session = unix.session(session_id)
            before = session.info()
            assert session.close()["snapshotted"] or before["stored_tokens"] == before["tokens"]
            after = session.info()  # from the store
            assert (after["tokens"], len(after["turns"])) == (before["tokens"], len(before["turns"]))
            assert session.resume()["tokens"] == before["tokens"]


ROUND_TRIPS = iter(range(1_000_000))


# ---- fuzzed bodies of the structured-output, Responses and Anthropic endpoints ----------------

# the fuzzer's strings: any, lone surrogates included (a 400, never a 500)
wild = st.one_of(st.text(max_size=40), st.sampled_from([SURROGATE, "x\udfff"]))
wild_values = json_of(wild)
schemas = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "strin"])})
    | st.fixed_dictionaries({"enum": st.lists(wild_values, max_size=4)})
    | st.fixed_dictionaries({"$ref": st.sampled_from(["#", "#/$defs/a", "#/nowhere"])}),
    lambda inner: st.fixed_dictionaries({"type": st.just("object"),
                                         "properties": st.dictionaries(wild, inner, max_size=3)},
                                        optional={"required": st.lists(wild, max_size=2),
                                                  "$defs": st.fixed_dictionaries({"a": inner})})
    | st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=3)})
    | st.fixed_dictionaries({"type": st.just("array"), "items": inner}, optional={"maxItems": st.integers(-1, 3)}),
    max_leaves=10)
anything = wild_values | schemas
response_format = st.fixed_dictionaries(
    {"type": st.sampled_from(["json_schema", "json_object", "text", "xml"])},
    optional={"json_schema": st.fixed_dictionaries({"name": wild}, optional={"schema": anything})})
chat_bodies = st.fixed_dictionaries({"messages": st.just(HI), "max_tokens": st.integers(1, 3)}, optional={
    "response_format": anything | response_format, "guided_json": anything,
    "guided_regex": anything | st.sampled_from(["a|b", "(", "[0-9]{2}", "a*"]),
    "guided_grammar": anything | st.sampled_from(['start: "a"', "start: x", 'root ::= "y"', "start: start"]),
    "guided_choice": anything, "session_id": st.sampled_from(["fz-1", "fz-2", "bad id"])})
format_spec = anything | st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "json_object", "text"])},
                                               optional={"schema": anything, "name": wild})
responses_bodies = st.fixed_dictionaries(
    {"input": wild | st.just(HI) | anything, "max_output_tokens": st.sampled_from([-1, 1, 2, 3])},
    optional={"text": st.fixed_dictionaries({"format": format_spec}), "metadata": anything, "instructions": anything,
              "store": st.booleans(), "previous_response_id": wild | st.just("resp_x")})
anthropic_bodies = st.fixed_dictionaries(
    {"model": st.just("m"), "messages": st.just(HI) | anything, "max_tokens": st.sampled_from([-1, 1, 2, 3])},
    optional={"system": anything, "output_config": st.fixed_dictionaries({"format": format_spec}),
              "stop_sequences": anything})
requests = st.one_of(st.tuples(st.just("/v1/chat/completions"), chat_bodies),
                     st.tuples(st.just("/v1/responses"), responses_bodies),
                     st.tuples(st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]), anthropic_bodies))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(request=requests)
def test_fuzzed_structured_responses_and_anthropic_bodies_get_a_reply_never_a_500(smol, request):
    path, body = request
    status, reply = post(smol[1], path, json.dumps(body).encode())
    assert status in (200, 400, 404, 422), (status, reply)
    assert serving(smol)


def test_the_daemon_logged_no_traceback(smol):
    assert "Traceback" not in smol[0].log.read_text()


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized(smol):
    """Megabytes of text over the socket: tokenizing them held the engine thread (so every
    client's generation) for seconds before the capacity error; now the error comes first."""
    with smol[0].client() as unix:
        session = unix.open_session()
        for send in (lambda big: session.chat(big, max_tokens=2), lambda big: session.append(text=big)):
            with pytest.raises(CapacityError, match=r"has room for \d+ tokens; a text of 4000\d\d\d characters"):
                send("word " * 800_000)  # 4 MB: under the render limit (max_render_kb)
        assert len(session.info()["turns"]) == 0 and session.chat("Hi", max_tokens=2).text is not None
    assert serving(smol)
