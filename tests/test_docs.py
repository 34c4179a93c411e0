"""The docs: the site builds with no broken link, the README stays a page, and every `ellmd` or
`ellm` command line they show names commands and options that exist."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import typer

from ellm.cli import app as client_app
from ellmd.cli import app as daemon_app

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "PROTOCOL.md"]
CLIS = {"ellmd": typer.main.get_command(daemon_app), "ellm": typer.main.get_command(client_app)}
COMMAND = re.compile(r"\s*(?:\.venv/bin/)?(ellmd?) ([^`#|\n]*)")


def test_the_site_builds_strictly(tmp_path):
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                           cwd=ROOT, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "benchmarks" / "index.html").is_file()


def test_the_readme_fits_a_screenful_or_so_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


def command_lines() -> list[tuple[Path, str, list[str]]]:
    """(file, program, words) of every command line in a shell block or a code span of the docs."""
    found = []
    for path in DOCS:
        text = path.read_text()
        fenced = re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
        spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
        lines = [line for kind, block in fenced if kind in ("", "sh", "bash") for line in block.splitlines()]
        for line in lines + spans:
            for part in line.split(" && "):
                if match := COMMAND.match(part):
                    program, rest = match.groups()
                    found.append((path, program, shlex.split(rest.split(" # ")[0].rstrip("\\ "))))
    return found


def check_words(program: str, words: list[str]) -> str | None:
    """None if the command and its options exist, else what does not."""
    command, path = CLIS[program], program
    for word in words:
        if hasattr(command, "commands") and not word.startswith("-"):
            names = word.split("|")  # `session fork|rewind|delete` names several
            if names[0].isupper() or names[0] in ("...", "…"):
                return None
            missing = [n for n in names if n not in command.commands]
            if missing:
                return f"{path}: no command {missing[0]!r}"
            command, path = command.commands[names[0]], f"{path} {names[0]}"
        elif word.startswith("--"):
            option = word.split("=")[0]
            known = {o for p in command.params for o in p.opts + p.secondary_opts} | {"--help"}
            if hasattr(command, "commands"):
                return None  # a group's options come before its command: checked there
            if option not in known:
                return f"{path}: no option {option}"
    return None


def test_every_command_line_in_the_docs_exists():
    lines = command_lines()
    assert len(lines) > 25  # the docs show the CLIs throughout
    wrong = [f"{path.name}: {program} {' '.join(words)}: {problem}" for path, program, words in lines
             if (problem := check_words(program, words))]
    assert not wrong, "\n".join(wrong)
