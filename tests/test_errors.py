"""The one table of error codes (ellmd.errors.CODES): PROTOCOL.md's list, what the code raises and
the HTTP statuses all come from it; a broken invariant is `internal`, logged, and the runtime goes on."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest

from ellmd.errors import CODES, EllmError, InvariantError
from ellmd.runtime.errors import ProtocolError
from ellmd.runtime.ops import OPS
from ellmd.runtime.session import GENERATING, IDLE
from ellmd.server.http.errors import ApiError

ROOT = Path(__file__).resolve().parent.parent


def documented_codes() -> set[str]:
    table = re.search(r"^## Error codes\n(.*?)(?=^## )", (ROOT / "PROTOCOL.md").read_text(), re.S | re.M).group(1)
    return set(re.findall(r"^\| `([a-z_]+)`", table, re.M))


def test_protocol_md_lists_exactly_the_table():
    assert documented_codes() == set(CODES)


CODE_ARGUMENT = {"ProtocolError": 0, "SkillError": 1, "RetrievalError": 1, "send_error": 1, "goodbye": 0}


def named_codes(tree: ast.AST):
    """The codes a module names: class attributes `code = "..."`, and the code arguments of the
    calls that take one (CODE_ARGUMENT: the argument's position)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["code"] \
                and isinstance(node.value, ast.Constant):
            yield node.value.value
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            at = CODE_ARGUMENT.get(name)
            arguments = node.args + [k.value for k in node.keywords if k.arg == "code"]
            if at is not None and len(node.args) > at:
                arguments = [node.args[at]] + arguments[len(node.args):]
            elif at is None:
                continue
            yield from (a.value for a in arguments if isinstance(a, ast.Constant) and isinstance(a.value, str))


def test_every_code_the_daemon_names_is_in_the_table():
    named = set()
    for path in (ROOT / "ellmd").rglob("*.py"):
        named |= set(named_codes(ast.parse(path.read_text())))
    assert {"bad_frame", "busy", "capacity", "leased", "not_found", "store"} <= named <= set(CODES)


def test_a_code_outside_the_table_is_refused_where_it_is_written():
    with pytest.raises(TypeError, match="not an error code"):
        type("Typo", (EllmError,), {"code": "capacty"})
    with pytest.raises(ValueError, match="not an error code"):
        ProtocolError("no_such_code", "x")


HTTP_STATUS = {"bad_request": 400, "capacity": 400, "not_found": 404, "busy": 409, "leased": 409, "fingerprint": 409,
               "cancelled": 503, "store": 500, "internal": 500}  # what the HTTP APIs have answered (no change)


@pytest.mark.parametrize("code", sorted(CODES))
def test_http_answers_each_code_from_the_table(code):
    error = ApiError.from_runtime(ProtocolError(code, "why"))
    assert (error.status, error.type, error.code) == (CODES[code].status, CODES[code].type, CODES[code].api_code)
    assert error.status == HTTP_STATUS.get(code, 500)


# ---- a broken invariant ---------------------------------------------------------------------


def call(rt, op, **args):
    return rt.submit(op, args).future.result(timeout=120)


def test_a_broken_invariant_is_internal_logged_and_the_runtime_goes_on(runtime, engine, monkeypatch, caplog):
    sid = call(runtime, "session.open", system="Be brief.")["session_id"]
    before = call(runtime, "session.info", session_id=sid)
    real = engine._check_tokens
    # the engine's own check fails, as if a bug let a token outside the vocabulary through
    monkeypatch.setattr(engine, "_check_tokens", lambda tokens: real(tokens + engine.spec.vocab_size))
    with caplog.at_level(logging.ERROR), pytest.raises(ProtocolError) as raised:
        call(runtime, "session.append", session_id=sid, text="Hello there.")
    assert raised.value.code == "internal"
    assert str(raised.value).startswith("InvariantError: token ids must be in")
    assert any(r.exc_info and r.exc_info[0] is InvariantError for r in caplog.records)  # with its traceback
    monkeypatch.undo()
    after = call(runtime, "session.info", session_id=sid)
    assert (after["tokens"], after["turns"]) == (before["tokens"], before["turns"])  # as the op found it
    assert call(runtime, "session.append", session_id=sid, text="Hello there.")["tokens_appended"] > 0
    assert call(runtime, "session.chat", session_id=sid, content="Hi.", max_tokens=2)["token_ids"]


ON_A_SESSION = {  # op -> arguments besides session_id, for every op that names a session
    "session.append": {"text": "Hi."}, "session.fork": {}, "session.rewind": {"tokens": 0}, "session.close": {},
    "session.release": {}, "session.delete": {}, "session.grant": {}, "session.generate": {"max_tokens": 1},
    "session.chat": {"content": "Hi.", "max_tokens": 1}, "completion": {"tokens": [1, 2], "max_tokens": 1},
    "session.continue": {"after": "p", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 1},
    "skill.load": {"name": "git"}, "rag.inject": {"documents": ["A fact."]}, "session.snapshot": {},
    "session.resume": {}, "session.info": {}, "session.export": {}, "session.point": {"name": "p"},
    "session.turns": {},
}


def test_the_ops_declared_idle_and_only_those_refuse_a_busy_session(runtime):
    """Op.idle (and so `busy` in PROTOCOL.md's Errors by op) is what the handlers do."""
    assert set(ON_A_SESSION) == {n for n, op in OPS.items() if "session_id" in op.schema.__struct_fields__
                                 and n != "session.import"}
    sid = call(runtime, "session.open", system="Be brief.")["session_id"]
    session = runtime.residency.session(sid)
    for name, args in ON_A_SESSION.items():
        session.state = GENERATING  # as while another request generates on it
        try:
            call(runtime, name, session_id=sid, **args)
            refused = None
        except ProtocolError as e:
            refused = e.code
        finally:
            session.state = IDLE
        assert (refused == "busy") == OPS[name].idle, (name, refused)
