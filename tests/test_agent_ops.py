"""Skills, retrieval and whole-prompt completions on the real daemon (built-in SmolLM2, greedy)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from daemon import ROOT, Daemon
from ellm.errors import BadRequest, NotFound

SKILL = """---
name: spreadsheet
description: >
  Edit spreadsheets: open a sheet,
  sum a column.
---
To sum a column, select its header and press Alt+=.
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent-ops")
    skills = tmp / "skills"
    (skills / "sheets").mkdir(parents=True)
    (skills / "sheets" / "SKILL.md").write_text(SKILL)
    (skills / "sheets" / "shortcuts.md").write_text("Ctrl+Shift+L toggles filters.\n")
    (skills / "shell").mkdir()
    (skills / "shell" / "SKILL.md").write_text("Use ls -la to list files.\n")  # no front matter
    (skills / "broken").mkdir()
    (skills / "broken" / "SKILL.md").write_text("---\nname: broken\ndescription: a: b\n---\nHi\n")
    (tmp / "secret.txt").write_text("not a skill file\n")
    docs = tmp / "docs"
    docs.mkdir()
    (docs / "billing.md").write_text("# Billing\nInvoices are sent on the first Monday of each month.\n")
    (docs / "tides.md").write_text("# Tides\nThe moon's gravity raises the ocean twice a day.\n")
    d = Daemon(tmp, slots=2, extra=["--skills-dir", str(skills), "--rag-dir", str(tmp / "rag")]).start()
    d.docs = docs
    yield d
    assert d.stop() == 0


def ellm(daemon, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ellm", "--socket", str(daemon.socket), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_skills_listed_loaded_once_and_confined(daemon):
    with daemon.client() as client:
        skills = {s["name"]: s for s in client.skills()}
        assert skills["spreadsheet"]["description"] == "Edit spreadsheets: open a sheet, sum a column."
        assert skills["spreadsheet"]["files"] == ["shortcuts.md"]
        assert skills["shell"]["description"] == ""  # the directory's name when there is no front matter
        assert "front matter is not valid YAML" in skills["broken"]["error"]  # listed, saying why
        session = client.open_session(system="You are a desktop agent.")
        before = session.info()["tokens"]
        loaded = session.load_skill("spreadsheet")
        assert loaded["loaded"] and loaded["tokens_appended"] > 10
        assert loaded["tokens"] == before + loaded["tokens_appended"]
        # Only the skill's tokens were run through the model: everything before was reused.
        assert loaded["usage"]["prefilled_tokens"] == loaded["tokens_appended"]
        assert loaded["usage"]["reused_tokens"] == before
        again = session.load_skill("spreadsheet")
        assert not again["loaded"] and again["tokens_appended"] == 0 and again["tokens"] == loaded["tokens"]
        forced = session.load_skill("spreadsheet", force=True)
        assert forced["loaded"] and forced["tokens_appended"] == loaded["tokens_appended"]
        extra = session.load_skill("spreadsheet", file="shortcuts.md", role="system")
        assert extra["tokens_appended"] > 0
        info = session.info()
        assert info["skills"] == ["spreadsheet", "spreadsheet", "spreadsheet/shortcuts.md"]
        assert [t["role"] for t in info["turns"] if t["kind"] == "skill"] == ["user", "user", "system"]
        with pytest.raises(NotFound, match="no skill 'nope'"):
            session.load_skill("nope")
        with pytest.raises(BadRequest, match="broken/SKILL.md: the front matter is not valid YAML"):
            session.load_skill("broken")
        with pytest.raises(BadRequest, match="not a plain name"):
            session.load_skill("../secret.txt")
        with pytest.raises(BadRequest, match="escapes the directory"):
            session.load_skill("spreadsheet", file="../../secret.txt")
        with pytest.raises(NotFound, match="has no file"):
            session.load_skill("spreadsheet", file="missing.md")
        assert session.info()["tokens"] == info["tokens"]  # the errors appended nothing
        reply = session.chat("Which shortcut sums a column?", max_tokens=4)
        assert reply.usage["reused_tokens"] == info["tokens"]


def test_skill_cli(daemon):
    listed = ellm(daemon, "skill", "list")
    assert listed.returncode == 0 and "spreadsheet" in listed.stdout and "shortcuts.md" in listed.stdout
    assert "broken: " in listed.stdout
    with daemon.client() as client:
        session_id = client.open_session().id
    first = ellm(daemon, "skill", "inject", session_id, "shell")
    assert first.returncode == 0 and first.stdout.startswith(f"loaded skill shell into {session_id}: +")
    second = ellm(daemon, "skill", "inject", session_id, "shell")
    assert second.returncode == 0 and "already loaded" in second.stdout
    missing = ellm(daemon, "skill", "inject", session_id, "nope")
    assert missing.returncode == 1 and missing.stderr.startswith("ellm: error: not_found: no skill 'nope'")


def test_rag_index_and_inject_by_query(daemon):
    with daemon.client() as client:
        events = []
        stats = client.rag_index(daemon.docs, name="docs", progress=events.append)
        assert stats["files"] == 2 and stats["files_indexed"] == 2 and stats["chunks"] >= 2
        assert events and events[-1]["files_done"] == events[-1]["files_total"] == 2
        assert client.rag_index(daemon.docs, name="docs")["files_indexed"] == 0  # nothing changed
        assert [i["name"] for i in client.rag_indexes()] == ["docs"]
        session = client.open_session()
        before = session.info()["tokens"]
        result = session.inject(query="when are invoices sent", k=1, index="docs")
        [passage] = result["passages"]
        assert passage["source"].startswith("billing.md:") and "first Monday" in passage["text"]
        # the session's first turn: the part of it another session holds is copied, the rest prefilled
        usage = result["usage"]
        assert usage["prefilled_tokens"] + usage["shared_tokens"] == result["tokens_appended"] > usage["shared_tokens"]
        assert result["tokens"] == before + result["tokens_appended"]
        assert session.info()["turns"][-1]["kind"] == "rag"
        with pytest.raises(NotFound, match="nope"):
            session.inject(query="tides", index="nope")
        (daemon.docs / "tides.md").write_text("# Tides\nNeap tides follow the quarter moons.\n")
        assert client.rag_index(daemon.docs, name="docs")["files_indexed"] == 1
        assert "Neap" in session.inject(query="neap tides", k=1, index="docs")["passages"][0]["text"]
    cli = ellm(daemon, "rag", "inject", session.id, "invoices monday", "--index", "docs", "-k", "1", "--json")
    assert cli.returncode == 0 and json.loads(cli.stdout)["passages"][0]["source"].startswith("billing.md:")
    listed = ellm(daemon, "rag", "list")
    assert listed.returncode == 0 and "docs" in listed.stdout
    with daemon.client() as client:
        client.rag_index(daemon.docs, name="scratch")
    removed = ellm(daemon, "rag", "remove", "scratch")
    assert removed.returncode == 0 and removed.stdout == "removed index scratch\n"
    with daemon.client() as client:
        assert [i["name"] for i in client.rag_indexes()] == ["docs"]


def test_completion_reuses_the_longest_prefix(daemon):
    with daemon.client() as client:
        for info in client.list_sessions():  # free every slot: forking needs a free one
            if info["resident"]:
                client.session(info["session_id"]).close()
        tokenized = client.open_session()
        prompt = tokenized.append(text="The capital of France is")["tokens"]
        tokenized.delete()
        base = list(range(1000, 1000 + prompt))  # any ids: only prefix sharing matters here
        first = client.call("completion", tokens=base, max_tokens=4, stream=False)
        assert first["usage"]["reused_tokens"] == 0 and first["usage"]["prefilled_tokens"] == len(base)
        # The conversation extends the first: its prompt, the reply, and more.
        extended = base + first["token_ids"] + [2000, 2001]
        second = client.call("completion", tokens=extended, max_tokens=4, stream=False)
        assert second["session_id"] == first["session_id"]
        # The reply's last token was never run through the model, so it is prefilled with the rest.
        assert second["usage"]["reused_tokens"] == len(base) + len(first["token_ids"]) - 1
        # A prompt sharing only `base` forks the anonymous session into a free slot: same prefix reused.
        branch = client.call("completion", tokens=base + [3000], max_tokens=2, stream=False)
        assert branch["session_id"] != first["session_id"]
        assert branch["usage"]["reused_tokens"] == len(base)
        # Bound sessions are made on first use and rewound to the shared prefix after.
        bound = client.call("completion", tokens=base, session_id="agent-7", max_tokens=2, stream=False)
        rebound = client.call("completion", tokens=base[:-1] + [4000], session_id="agent-7", max_tokens=2, stream=False)
        assert bound["session_id"] == rebound["session_id"] == "agent-7"
        assert rebound["usage"]["reused_tokens"] == len(base) - 1
        with pytest.raises(BadRequest, match="session_id must match"):
            client.call("completion", tokens=base, session_id="a/b")
        with pytest.raises(BadRequest, match="tokens: Expected `array` of length >= 1"):
            client.call("completion", tokens=[])
