"""The example agents (examples/agents/) against the real daemon and the built-in model.

A 135M model's answers are not the point; the mechanics are: skills appended once and on demand,
files and passages injected with their sources, an incremental re-index, every turn reusing the
KV of all that came before it, and a session resumed after the daemon restarted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Container
from pathlib import Path

import ellm
import pytest
from daemon import ROOT, Daemon

AGENTS = ROOT / "examples" / "agents"
DOCS = {p.name for p in (AGENTS / "docs").glob("*.md")}


def doc(source: str) -> str:
    """The file of a passage source such as "install.md:1-9"."""
    return source.rsplit(":", 1)[0]


def start(tmp: Path) -> Daemon:
    return Daemon(tmp, slots=2, extra=["--skills-dir", str(AGENTS / "skills"), "--rag-dir", str(tmp / "rag")]).start()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start(tmp_path_factory.mktemp("agents"))
    yield d
    assert d.stop() == 0


def run(agent: str, daemon: Daemon, *args) -> dict:
    """Run an example agent with --json and return its summary."""
    done = subprocess.run([sys.executable, str(AGENTS / agent), "--socket", str(daemon.socket), "--json",
                           "--max-tokens", "16", *map(str, args)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def assert_reuses_history(turns: list[dict], after_reply: Container[int] = ()) -> None:
    """Each turn reuses the KV of everything before it and prefills only its own tokens. After an
    append (skill, documents) that is the whole session; right after a reply (turn indexes in
    `after_reply`) the daemon still holds back the reply's last token and its end, which it
    prefills with the next turn."""
    for i, t in enumerate(turns):
        previous = turns[i - 1]
        held = previous["prompt_tokens"] + previous["generated_tokens"] - 1 if i in after_reply else t["tokens_before"]
        assert t["reused_tokens"] == held
        assert t["prefilled_tokens"] + t["reused_tokens"] == t["prompt_tokens"]
        assert t["prefilled_tokens"] < 40  # its message and the generation prompt, nothing of the history


def test_help_of_every_agent():
    for agent in ("computer_use.py", "code_copilot.py", "rag_qa.py", "deep_research.py"):
        done = subprocess.run([sys.executable, str(AGENTS / agent), "--help"], capture_output=True, text=True)
        assert done.returncode == 0 and "--socket" in done.stdout and "--json" in done.stdout


def test_computer_use_loads_skills_on_demand(daemon):
    summary = run("computer_use.py", daemon)
    steps = summary["steps"]
    assert [s["skill"] for s in steps] == ["browser", "spreadsheet", "spreadsheet", "files"]
    assert summary["skills_loaded"] == ["browser", "spreadsheet", "spreadsheet/formulas.md", "files"]  # each once
    assert {"browser", "email", "files", "spreadsheet"} <= set(summary["skills_available"])  # email: never needed
    appended = [[(load["skill"], load["file"], load["tokens_appended"] > 0) for load in s["loads"]] for s in steps]
    assert appended == [
        [("browser", None, True)],
        [("spreadsheet", None, True)],
        [("spreadsheet", None, False), ("spreadsheet", "formulas.md", True)],  # loaded again: a no-op
        [("files", None, True)],
    ]
    assert steps[2]["loads"][0]["tokens_appended"] == 0
    assert_reuses_history(steps)
    assert summary["tokens"] > steps[-1]["prompt_tokens"]


def test_code_copilot_injects_files_once(daemon):
    summary = run("code_copilot.py", daemon)  # the default repository: the ellm client package
    package = Path(ellm.__file__).parent
    assert len(summary["files"]) == 3 and all((package / f).is_file() for f in summary["files"])
    assert "client.py" in summary["files"]  # the file about sessions and chats ranks among the first
    assert summary["tokens_appended"] > 500
    first, second = summary["turns"]
    assert first["tokens_before"] > summary["tokens_appended"]  # the system prompt, then the files
    assert second["tokens_before"] > first["prompt_tokens"]
    assert_reuses_history(summary["turns"], after_reply={1})
    assert second["reused_tokens"] > summary["tokens_appended"]  # the files were not prefilled again


def test_rag_qa_retrieves_passages_and_reindexes_incrementally(daemon):
    first = run("rag_qa.py", daemon, "--index", "quillbox")
    assert first["index"]["files_indexed"] == len(DOCS) and first["index"]["files_unchanged"] == 0
    sources = [{doc(source) for source in q["sources"]} for q in first["questions"]]
    assert all(0 < len(s) <= 3 and s <= DOCS for s in sources)
    assert "install.md" in sources[0] and "sync.md" in sources[1] and "pricing.md" in sources[2]
    assert all(q["tokens_appended"] > 0 for q in first["questions"])
    assert_reuses_history(first["questions"])

    again = run("rag_qa.py", daemon, "--index", "quillbox", "-q", "Which port does Quillbox use?")
    assert again["index"]["files_indexed"] == 0 and again["index"]["files_unchanged"] == len(DOCS)
    assert "overview.md" in {doc(source) for source in again["questions"][0]["sources"]}


def test_deep_research_resumes_after_a_restart(tmp_path):
    state = tmp_path / "state.json"
    daemon = start(tmp_path)
    try:
        first = run("deep_research.py", daemon, "--state", state, "--steps", 2)
    finally:
        assert daemon.stop() == 0
    assert first["run"] == 1 and first["resumed"] is None and [s["step"] for s in first["steps"]] == [1, 2]
    assert_reuses_history(first["steps"])
    assert json.loads(state.read_text())["session_id"] == first["session_id"]

    daemon = start(tmp_path)  # a new process on the same store: the session's KV comes from disk
    try:
        second = run("deep_research.py", daemon, "--state", state, "--steps", 1)
    finally:
        assert daemon.stop() == 0
    assert second["run"] == 2 and second["session_id"] == first["session_id"]
    assert second["resumed"]["tokens"] == first["tokens"] and second["resumed"]["ms"] >= 0
    last = first["steps"][-1]
    assert_reuses_history([last, second["recap"]], after_reply={1})  # nothing of run 1 is prefilled again
    assert [s["step"] for s in second["steps"]] == [3]
    assert second["tokens"] > first["tokens"]
