"""Every `--help` of both command lines renders its source text: no bracketed text (`[default: ...]`,
`pip install 'ellm[ray]'`) is eaten as terminal markup."""

from __future__ import annotations

import re

import click
import pytest
import typer
from typer.testing import CliRunner

import ellm.cli
import ellmd.cli

BRACKETED = re.compile(r"\[[^\[\]]*\]")


def commands(group: click.Command, path: tuple = ()):
    """(path of names, command) of a command and every command under it."""
    yield path, group
    for name, command in getattr(group, "commands", {}).items():
        yield from commands(command, (*path, name))


def flat(text: str) -> str:
    """Text with the help formatter's line wrapping undone (at spaces and after hyphens)."""
    return re.sub(r"-\s+", "-", " ".join(text.split()))


def source_texts(command: click.Command) -> list[str]:
    return [command.help or ""] + [getattr(param, "help", None) or "" for param in command.params]


def every_command():
    for app, name in ((ellmd.cli.app, "ellmd"), (ellm.cli.app, "ellm")):
        for path, command in commands(typer.main.get_command(app)):
            yield pytest.param(app, path, command, id=" ".join((name, *path)))


@pytest.mark.parametrize("app,path,command", list(every_command()))
def test_help_keeps_every_bracketed_text(app, path, command):
    result = CliRunner().invoke(app, [*path, "--help"], prog_name="ellm")
    assert result.exit_code == 0, result.output
    shown = flat(result.output)
    for text in source_texts(command):
        for bracketed in BRACKETED.findall(text):
            assert flat(bracketed) in shown, f"{bracketed!r} is missing from the help of {' '.join(path)}"


def test_fleet_help_names_the_extra():
    result = CliRunner().invoke(ellmd.cli.app, ["fleet", "--help"])
    assert "pip install 'ellm[ray]'" in flat(result.output)
