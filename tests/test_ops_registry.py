"""The op registry (ellmd/runtime/ops/) against PROTOCOL.md and the client, so that none drifts:
every op's name, arguments, reply fields (and its errors, see test_errors.py) as the document
writes them, the ops and arguments the client sends, and the replies the real daemon gives."""

from __future__ import annotations

import ast
import fnmatch
import io
import re
import socket
from pathlib import Path

import msgpack
import msgspec
import pytest

from ellm import Client
from ellmd.runtime import schemas
from ellmd.runtime.ops import OPS
from ellmd.runtime.ops.base import UPLOAD_FIELDS
from ellmd.server.unix import MAX_FRAME

from daemon import Daemon

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = (ROOT / "PROTOCOL.md").read_text()
CLIENT = ROOT / "client" / "ellm"
NOT_IN_CLIENT = {"completion", "session.continue", "session.point"}  # the HTTP APIs' ops: call() reaches them


def section(title: str) -> str:
    """The text of PROTOCOL.md's `## title` section."""
    return re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", PROTOCOL, re.S | re.M).group(1)


def op_table() -> dict[str, tuple[str, str]]:
    """op -> (args cell, result cell) of the Ops table."""
    rows = {}
    for line in section("Ops").splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def spans(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def documented_args(cell: str) -> dict[str, bool]:
    """name -> optional, of an args cell (`name?` is optional); "sampling arguments" stands for them."""
    found = {}
    for span in spans(cell):
        name = span.split(":")[0].strip()
        if re.fullmatch(r"[a-z_]+\??", name):
            found[name.rstrip("?")] = name.endswith("?")
    if "sampling arguments" in cell:
        found.update({f: True for f in fields(schemas.Sampling)})
    return found


def fields(schema) -> set[str]:
    return {f.name for f in msgspec.structs.fields(schema)} - {"owner"}


def top_level_keys(shape: str) -> set[str]:
    """The keys of a `{a, b: [...], c?}` shape, at its top level."""
    depth, key, keys = 0, "", []
    for char in shape.strip()[1:-1] + ",":
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == "," and depth == 0:
            keys.append(key.split(":")[0].strip())
            key = ""
            continue
        key += char
    return {k for k in keys if k}


def named_shapes() -> dict[str, set[str]]:
    info = re.search(r"`session\.info` returns:\s*`(\{.*?\})`", section("Sessions"), re.S).group(1)
    generation = re.search(r"A generation result is `(\{.*?\})`", section("Ops"), re.S).group(1)
    return {"session info": top_level_keys(info), "info of the new session": top_level_keys(info),
            "generation result": top_level_keys(generation)}


def documented_reply(cell: str) -> set[str]:
    for name, keys in named_shapes().items():
        if cell.startswith(name):
            return keys
    return top_level_keys(next(s for s in spans(cell) if s.startswith("{")))


def test_the_op_table_names_every_op():
    assert set(op_table()) == set(OPS)


@pytest.mark.parametrize("name", sorted(OPS))
def test_the_op_table_gives_the_declared_arguments(name):
    op = OPS[name]
    documented = documented_args(op_table()[name][0])
    expected = fields(op.schema) | (set(UPLOAD_FIELDS) if op.upload else set())
    assert set(documented) == expected
    required = {f.name for f in msgspec.structs.fields(op.schema) if f.required}
    assert {n for n, optional in documented.items() if not optional} >= required
    assert not {n for n, optional in documented.items() if optional} & required


@pytest.mark.parametrize("name", sorted(OPS))
def test_the_op_table_gives_the_declared_reply(name):
    op = OPS[name]
    cell = op_table()[name][1]
    assert documented_reply(cell) == set(op.reply)
    if op.upload:  # the reply to a piece of an upload
        assert "`{upload, received}`" in cell


def errors_by_op() -> dict[str, set[str]]:
    table = re.search(r"^### Errors by op\n(.*?)(?=^#|\Z)", section("Ops"), re.S | re.M).group(1)
    return {m[0]: set(re.findall(r"`([a-z_]+)`", m[1])) for m in re.findall(r"^\| `([a-z_.]+)` \| (.*) \|$", table, re.M)}


def test_errors_by_op_are_the_declared_ones():
    documented = errors_by_op()
    assert set(documented) == set(OPS)
    for name, op in OPS.items():
        assert documented[name] == set(op.errors), name
        assert ("busy" in op.errors) == op.idle, name  # busy: its session runs another request


def test_sampling_and_owner_arguments_are_documented():
    sampling = set(spans(section("Sampling arguments")))
    assert fields(schemas.Sampling) <= sampling
    owner = re.search(r"\*\*Owner\.\*\*.*?\((.*?)\)", section("Arguments"), re.S).group(1)
    patterns = spans(owner)
    owned = {n for n, op in OPS.items() if any(fnmatch.fnmatch(n, p) for p in patterns)}
    assert owned == {n for n, op in OPS.items() if issubclass(op.schema, schemas.Owned)}


def client_ops() -> set[str]:
    """The ops the client's methods send (the first argument of its call, stream... helpers)."""
    sent = set()
    for path in CLIENT.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("call", "_call", "stream", "_stream", "_generate") and node.args \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                sent.add(node.args[0].value)
    return sent


def test_the_client_sends_declared_ops_and_offers_every_op():
    """Its arguments are held to the schemas by test_client.py's fake daemon (FakeDaemon.check)."""
    assert client_ops() <= set(OPS)
    assert set(OPS) - client_ops() == NOT_IN_CLIENT


# ---- the real daemon's replies --------------------------------------------------------------


def assert_reply(op: str, result: dict) -> None:
    declared = OPS[op].reply
    required = {f for f in declared if not f.endswith("?")}
    assert required <= set(result) <= required | {f.rstrip("?") for f in declared}, op


def raw_hello(path: Path, args: dict) -> dict:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(60)
        sock.connect(str(path))
        sock.sendall(msgpack.packb({"id": 0, "op": "hello", "args": args}))
        unpacker = msgpack.Unpacker(raw=False)
        while True:
            unpacker.feed(sock.recv(65536))
            for message in unpacker:
                return message


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("registry")
    skills, docs = tmp / "skills", tmp / "docs"
    (skills / "git").mkdir(parents=True)
    (skills / "git" / "SKILL.md").write_text("---\nname: git\ndescription: Use git.\n---\nCommit often.\n")
    docs.mkdir()
    (docs / "a.md").write_text("Invoices are paid on Mondays.\n")
    d = Daemon(tmp, slots=2, extra=["--skills-dir", str(skills), "--rag-dir", str(tmp / "rag")]).start()
    d.docs = docs
    yield d
    if d.process.poll() is None:
        d.stop()


def test_hello_checks_its_arguments(daemon):
    assert raw_hello(daemon.socket, {"protocol": 1, "client": "test"})["ok"]
    for args, code, words in [({"protocol": 1, "cilent": "x"}, "bad_request", "cilent"),
                              ({"client": "x"}, "bad_request", "protocol"),
                              ({"protocol": "1"}, "bad_request", "protocol"),
                              ({"protocol": 2}, "protocol_version", "protocol 1")]:
        error = raw_hello(daemon.socket, args)["error"]
        assert error["code"] == code and words in error["message"], args


def test_every_reply_has_the_declared_fields(daemon):
    seen = {}
    with Client(daemon.socket, timeout=300) as client:
        def call(op, /, **args):
            seen[op] = result = client.call(op, **args)
            assert_reply(op, result)
            return result

        assert_reply("hello", client.server)
        seen["hello"] = client.server
        sid = call("session.open", title="registry", system="Be brief.")["session_id"]
        call("session.append", session_id=sid, text="Hello there.")
        call("skill.list")
        call("skill.load", session_id=sid, name="git")
        call("rag.index", path=str(daemon.docs), name="docs")
        call("rag.list")
        call("rag.inject", session_id=sid, query="invoices", index="docs", k=1)
        call("rag.remove", name="docs")
        call("session.generate", session_id=sid, max_tokens=2, stream=False)
        call("session.chat", session_id=sid, content="Hi", max_tokens=2, stream=False)
        messages = [{"role": "user", "content": "Hi"}]
        tokens = client.call("session.info", session_id=sid)["tokens"]
        done = call("completion", tokens=[1, 2, 3], messages=messages, name="p1", max_tokens=2, stream=False)
        call("session.continue", session_id=done["session_id"], after="p1",
             messages=[{"role": "user", "content": "More"}], max_tokens=2, stream=False)
        call("session.point", session_id=done["session_id"], name="p1")
        call("session.info", session_id=sid)
        call("session.turns", session_id=sid)
        call("session.list")
        call("session.snapshot", session_id=sid)
        call("session.resume", session_id=sid)
        fork = call("session.fork", session_id=sid)["session_id"]
        call("session.rewind", session_id=fork, tokens=tokens)
        call("session.grant", session_id=fork, key=None)
        out = io.BytesIO()
        seen["session.export"] = exported = client.session(sid).export(out)
        assert_reply("session.export", exported)
        call("session.release", session_id=fork)
        call("session.close", session_id=sid)
        call("session.delete", session_id=sid)
        import_in_pieces(client, out.getvalue(), call)
        call("stats")
        call("live")
        call("cancel", request_id=12345)
        call("shutdown")
    assert set(seen) == set(OPS)


def import_in_pieces(client: Client, blob: bytes, call) -> None:
    """session.import as two pieces at least: each piece's reply, then the session's."""
    size = max(1, min(len(blob) // 2, MAX_FRAME // 2))
    pieces = [blob[i:i + size] for i in range(0, len(blob), size)]
    upload = None
    for piece in pieces[:-1]:
        got = client.call("session.import", data=piece, more=True, **({"upload": upload} if upload else {}))
        assert set(got) == {"upload", "received"}
        upload = got["upload"]
    call("session.import", data=pieces[-1], upload=upload)
