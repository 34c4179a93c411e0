"""`ellm`: the client command line: sessions, chat, skills and RAG over the daemon's Unix socket.

Tables for people, `--json` for scripts (the daemon's result as it came). When the daemon is not
running: one line saying how to start it, exit code 2. An error from the daemon:
`ellm: error: <code>: <message>`, exit code 1.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

from ellm.api import Generation, present
from ellm.client import Client, Session
from ellm.errors import DaemonNotRunning, EllmError

app = typer.Typer(
    help="Talk to the ellm daemon (ellmd): sessions, chat, skills, RAG.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help strings are plain text: "[default: ...]" must not be read as markup
)
session_app = typer.Typer(help="List, show, resume, fork, rewind, delete, export and import sessions.", no_args_is_help=True, rich_markup_mode=None)
skill_app = typer.Typer(help="List skills and load them into sessions.", no_args_is_help=True, rich_markup_mode=None)
rag_app = typer.Typer(help="Index folders; inject documents or retrieved passages into sessions.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(session_app, name="session")
app.add_typer(skill_app, name="skill")
app.add_typer(rag_app, name="rag")

TURN_COLUMNS = 66  # characters the turn table of `session show` takes beside its text
JsonOutput = typer.Option(False, "--json", help="Print JSON for scripts instead of text for people")


@app.callback()
def main(
    ctx: typer.Context,
    socket: Optional[Path] = typer.Option(
        None, "--socket", envvar="ELLM_SOCKET", help="The daemon's Unix socket (default: $XDG_RUNTIME_DIR/ellm/ellmd.sock)"
    ),
):
    """Talk to the ellm daemon (ellmd): sessions, chat, skills, RAG."""
    ctx.obj = socket  # subcommand contexts inherit it


def fail(message: str, code: int = 1):
    typer.echo(f"ellm: {message}", err=True)
    raise typer.Exit(code)


def error_line(exc: EllmError) -> str:
    return f"error: {exc.code}: {exc.message}" if exc.code else f"error: {exc.message}"


@contextmanager
def connect(ctx: typer.Context) -> Iterator[Client]:
    """A connected client; errors end the command with one line on stderr and an exit code."""
    try:
        with Client(ctx.obj) as client:
            yield client
    except DaemonNotRunning as exc:
        fail(exc.message, 2)
    except EllmError as exc:
        fail(error_line(exc))


def stdout() -> Console:
    return Console(highlight=False)  # made per command, so that whatever stdout is now gets the output


def stderr() -> Console:
    return Console(stderr=True, highlight=False)


def print_json(value) -> None:
    typer.echo(json.dumps(value, indent=2, ensure_ascii=False))


def when(t) -> str:
    """A Unix time as local date and time."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else str(t or "")


def cell(value) -> Text:
    """A table cell; Text, so that brackets in titles are not read as rich markup."""
    if value is None:
        return Text("")
    if isinstance(value, bool):
        return Text("yes" if value else "no")
    if isinstance(value, list):
        return Text(", ".join(map(str, value)))
    if isinstance(value, dict):
        return Text(json.dumps(value, ensure_ascii=False))
    return Text(str(value))


def fields_table(rows: dict) -> Table:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows.items():
        table.add_row(key, cell(value))
    return table


def flatten(value: dict, prefix: str = "") -> dict:
    """Nested maps as one level of dotted keys, for a two-column table."""
    rows = {}
    for key, item in value.items():
        if isinstance(item, dict) and item:
            rows.update(flatten(item, f"{prefix}{key}."))
        else:
            rows[f"{prefix}{key}"] = item
    return rows


@app.command()
def status(ctx: typer.Context, json_output: bool = JsonOutput):
    """Show the daemon: its model, protocol, capacity, sessions and uptime."""
    with connect(ctx) as client:
        report = {"socket": client.socket_path, "server": client.server, "stats": client.stats()}
    if json_output:
        print_json(report)
    else:
        stdout().print(fields_table({"socket": report["socket"], **flatten(report["server"]), **flatten(report["stats"])}))


@session_app.command("list")
def session_list(ctx: typer.Context, json_output: bool = JsonOutput):
    """List the sessions, resident or stored."""
    with connect(ctx) as client:
        result = client.call("session.list")
    if json_output:
        print_json(result)
        return
    table = Table("session", "title", "tags", "tokens", "resident", "updated")
    for info in result.get("sessions", []):
        table.add_row(*map(cell, (info.get("session_id"), info.get("title"), info.get("tags"), info.get("tokens"),
                                  info.get("resident"), when(info.get("updated")))))
    stdout().print(table if table.row_count else Text("no sessions"))


@session_app.command("show")
def session_show(ctx: typer.Context, session_id: str = typer.Argument(..., metavar="ID"), json_output: bool = JsonOutput):
    """Show a session: metadata, skills, fingerprint and turn log."""
    with connect(ctx) as client:
        info = client.session(session_id).info()
        texts = [] if json_output else client.call("session.turns", session_id=session_id)["turns"]
    if json_output:
        print_json(info)
        return
    console = stdout()
    rows = {key: info.get(key) for key in ("session_id", "title", "tags", "tokens", "resident", "skills")}
    rows.update(created=when(info.get("created")), updated=when(info.get("updated")))
    rows.update(flatten(info.get("fingerprint") or {}, "fingerprint."))
    console.print(fields_table(rows))
    turns = Table(*(Column(name, no_wrap=True) for name in ("turn", "kind", "tokens", "span", "time")),
                  Column("text", no_wrap=True))
    width = max(16, console.width - TURN_COLUMNS)  # what the other columns leave of the terminal
    for turn in texts:
        start, end = turn.get("start", 0), turn.get("end", 0)
        kind = "/".join(filter(None, (turn.get("kind"), turn.get("role"))))
        clock = time.strftime("%H:%M:%S", time.localtime(turn["time"])) if turn.get("time") else ""
        turns.add_row(*map(cell, (turn.get("index"), kind, end - start, f"[{start}, {end})", clock,
                                  text_start(turn.get("text"), width))))
    if turns.row_count:
        console.print(turns)


def text_start(text: str | None, width: int) -> str:
    """The start of a turn's text on one line (newlines shown as ⏎)."""
    line = (text or "").replace("\n", "⏎")
    return line if len(line) <= width else line[:width - 1] + "…"


@app.command()
def top(
    ctx: typer.Context,
    once: bool = typer.Option(False, "--once", help="Print one frame and exit"),
    interval: float = typer.Option(1.0, min=0.1, help="Seconds between refreshes"),
):
    """The daemon live: one line per KV slot (idle, prefilling, generating at tok/s), memory, requests (s: sort, q: quit)."""
    from ellm import top as live_view

    with connect(ctx) as client:
        if once:
            stdout().print(live_view.frame(live_view.sample(client), None, "slot"))
            return
        try:
            live_view.run(client, stdout(), interval)
        except KeyboardInterrupt:
            pass


@session_app.command("resume")
def session_resume(ctx: typer.Context, session_id: str = typer.Argument(..., metavar="ID"), json_output: bool = JsonOutput):
    """Load a stored session into a slot (from its KV snapshot: nothing is recomputed)."""
    with connect(ctx) as client:
        result = client.session(session_id).resume()
    if json_output:
        print_json(result)
    else:
        typer.echo(f"resumed {session_id}: {result.get('tokens')} tokens in {result.get('ms', 0):.0f} ms")


@session_app.command("fork")
def session_fork(
    ctx: typer.Context,
    session_id: str = typer.Argument(..., metavar="ID"),
    title: Optional[str] = typer.Option(None, help="Title of the new session"),
    json_output: bool = JsonOutput,
):
    """Fork a session: a new session sharing its tokens and KV so far."""
    with connect(ctx) as client:
        info = client.session(session_id).fork(title=title).info()
    if json_output:
        print_json(info)
    else:
        typer.echo(f"forked {session_id} into {info.get('session_id')} ({info.get('tokens')} tokens)")


@session_app.command("rewind")
def session_rewind(
    ctx: typer.Context,
    session_id: str = typer.Argument(..., metavar="ID"),
    turn: Optional[int] = typer.Option(None, help="Keep the turns before this one"),
    tokens: Optional[int] = typer.Option(None, help="Keep this many tokens"),
    json_output: bool = JsonOutput,
):
    """Rewind a session to a turn or a token count (its KV is kept up to there)."""
    if (turn is None) == (tokens is None):
        raise typer.BadParameter("give exactly one of --turn and --tokens", param_hint="--turn / --tokens")
    with connect(ctx) as client:
        info = client.session(session_id).rewind(turn=turn, tokens=tokens)
    if json_output:
        print_json(info)
    else:
        typer.echo(f"rewound {session_id} to {info.get('tokens')} tokens, {len(info.get('turns', []))} turns")


@session_app.command("delete")
def session_delete(ctx: typer.Context, session_id: str = typer.Argument(..., metavar="ID"), json_output: bool = JsonOutput):
    """Delete a session from memory and from the store."""
    with connect(ctx) as client:
        result = client.session(session_id).delete()
    if json_output:
        print_json(result)
    else:
        typer.echo(f"deleted {session_id}")


@session_app.command("grant")
def session_grant(
    ctx: typer.Context,
    session_id: str = typer.Argument(..., metavar="ID"),
    key: Optional[str] = typer.Argument(None, metavar="KEYNAME", help="A key's name in the daemon's api_key_file"),
    revoke: bool = typer.Option(False, "--revoke", help="Take the session back from the key that holds it"),
    json_output: bool = JsonOutput,
):
    """Give a session to an HTTP API key (sessions made here, or before keys were set, are no key's)."""
    if (key is None) != revoke:
        raise typer.BadParameter("give KEYNAME, or --revoke")
    with connect(ctx) as client:
        result = client.session(session_id).grant(key)
    if json_output:
        print_json(result)
    else:
        typer.echo(f"{session_id} now belongs to key {key}" if key else f"{session_id} now belongs to no key")


@session_app.command("export")
def session_export(
    ctx: typer.Context,
    session_id: str = typer.Argument(..., metavar="ID"),
    file: Path = typer.Argument(..., dir_okay=False, help="The file to write (replaced only once the export is whole)"),
    json_output: bool = JsonOutput,
):
    """Export a session to a file: metadata, tokens and KV, importable by `ellm session import`."""
    with connect(ctx) as client:
        # A temporary file beside the target, renamed at the end: a failed export leaves no half file.
        try:
            fd, tmp = tempfile.mkstemp(dir=file.resolve().parent, prefix=f".{file.name}.")
        except OSError as exc:
            fail(f"error: cannot write {file}: {exc.strerror}")
        try:
            with os.fdopen(fd, "wb") as out:
                result = client.session(session_id).export(out)
            os.replace(tmp, file)
        except BaseException:
            os.unlink(tmp)
            raise
    if json_output:
        print_json({**result, "file": str(file)})
    else:
        typer.echo(f"exported {session_id} to {file}: {result.get('tokens')} tokens, {result.get('bytes', 0) / 2**20:.1f} MiB")


@session_app.command("import")
def session_import(
    ctx: typer.Context,
    file: Path = typer.Argument(..., exists=True, dir_okay=False, readable=True, help="A file written by `ellm session export`"),
    json_output: bool = JsonOutput,
):
    """Import a session from an exported file (the daemon's model must be the one that made it)."""
    with connect(ctx) as client:
        with file.open("rb") as source:
            info = client.import_session(source).info()
    if json_output:
        print_json(info)
    else:
        typer.echo(f"imported {file} as {info.get('session_id')} ({info.get('tokens')} tokens)")


@skill_app.command("list")
def skill_list(ctx: typer.Context, json_output: bool = JsonOutput):
    """List the skills the daemon can load (from its skill roots)."""
    with connect(ctx) as client:
        skills = client.skills()
    if json_output:
        print_json(skills)
        return
    table = Table("skill", "description", "files", "path")
    for skill in skills:
        description = Text(f"broken: {skill['error']}", style="red") if skill.get("error") else cell(skill.get("description"))
        table.add_row(cell(skill.get("name")), description, cell(skill.get("files")), cell(skill.get("path")))
    stdout().print(table if table.row_count else Text("no skills (start ellmd with --skills-dir DIR)"))


@skill_app.command("inject")
def skill_inject(
    ctx: typer.Context,
    session_id: str = typer.Argument(..., metavar="SESSION"),
    name: str = typer.Argument(..., help="The skill's name (see: ellm skill list)"),
    file: Optional[str] = typer.Option(None, "--file", help="Load this file of the skill instead of its instructions"),
    role: Optional[str] = typer.Option(None, help="The message's role [default: the daemon's context_role]"),
    force: bool = typer.Option(False, help="Load it again even if the session has it"),
    json_output: bool = JsonOutput,
):
    """Append a skill to a session: only its tokens are prefilled."""
    with connect(ctx) as client:
        result = client.session(session_id).load_skill(name, force=force, role=role, file=file)
    if json_output:
        print_json(result)
    elif not result.get("loaded", True):
        typer.echo(f"skill {result.get('skill', name)} is already loaded in {session_id} (--force to load it again)")
    else:
        what = result.get("skill", name) + (f" file {file}" if file else "")
        typer.echo(f"loaded skill {what} into {session_id}: +{result.get('tokens_appended')} tokens")


@rag_app.command("index")
def rag_index(
    ctx: typer.Context,
    path: Path = typer.Argument(..., exists=True, file_okay=False, help="The folder to index (text, markdown, code)"),
    name: str = typer.Option("default", "--name", "-n", help="The index's name"),
    retriever: Optional[str] = typer.Option(None, help="bm25 (built in) or an installed retriever plugin"),
    json_output: bool = JsonOutput,
):
    """Index a folder for retrieval, or bring its index up to date (only changed files are read)."""
    from rich.progress import Progress

    with connect(ctx) as client, Progress(console=stderr(), transient=True, disable=json_output) as bar:
        task = bar.add_task(f"indexing {path}", total=None)

        def progress(data):
            bar.update(task, completed=data.get("files_done"), total=data.get("files_total"))

        result = client.rag_index(path, name=name, retriever=retriever, progress=progress)
    if json_output:
        print_json(result)
        return
    typer.echo(f"index {result.get('name')} ({result.get('retriever')}) of {result.get('path')}: "
               f"{result.get('files')} files, {result.get('chunks')} chunks; {result.get('files_indexed')} indexed, "
               f"{result.get('files_unchanged')} unchanged, {result.get('files_removed')} removed "
               f"in {result.get('seconds')} s")


@rag_app.command("list")
def rag_list(ctx: typer.Context, json_output: bool = JsonOutput):
    """List the retrieval indexes."""
    with connect(ctx) as client:
        indexes = client.rag_indexes()
    if json_output:
        print_json(indexes)
        return
    table = Table("index", "retriever", "files", "chunks", "updated", "path")
    for index in indexes:
        table.add_row(*map(cell, (index.get("name"), index.get("retriever"), index.get("files"), index.get("chunks"),
                                  when(index.get("updated")), index.get("path"))))
    stdout().print(table if table.row_count else Text("no indexes (make one with: ellm rag index PATH)"))


@rag_app.command("remove")
def rag_remove(ctx: typer.Context, name: str = typer.Argument(..., help="The index's name"),
               json_output: bool = JsonOutput):
    """Delete a retrieval index (the indexed folder is not touched)."""
    with connect(ctx) as client:
        result = client.rag_remove(name)
    if json_output:
        print_json(result)
    else:
        typer.echo(f"removed index {name}")


@rag_app.command("inject")
def rag_inject(
    ctx: typer.Context,
    session_id: str = typer.Argument(..., metavar="SESSION"),
    query: Optional[str] = typer.Argument(None, help="Retrieve passages for this query"),
    files: Optional[list[Path]] = typer.Option(
        None, "--file", "-f", exists=True, dir_okay=False, readable=True, help="Inject this UTF-8 text file (repeatable)"
    ),
    k: Optional[int] = typer.Option(None, "-k", help="Passages to retrieve [default: the daemon's rag_k]"),
    index: Optional[str] = typer.Option(None, "--index", help="The index to search [default: default]"),
    role: Optional[str] = typer.Option(None, help="The message's role [default: the daemon's context_role]"),
    json_output: bool = JsonOutput,
):
    """Append documents (--file) or the passages retrieved for QUERY to a session, as one message."""
    if bool(files) == (query is not None):
        raise typer.BadParameter("give either QUERY or --file", param_hint="QUERY / --file")
    documents = None
    if files:
        try:
            documents = [{"text": path.read_text(encoding="utf-8"), "source": str(path)} for path in files]
        except UnicodeDecodeError as exc:
            fail(f"error: a --file is not UTF-8 text ({exc.reason})")
    with connect(ctx) as client:
        result = client.session(session_id).inject(query=query, documents=documents, k=k, index=index, role=role)
    if json_output:
        print_json(result)
        return
    passages = result.get("passages", [])
    typer.echo(f"injected {len(passages)} passages into {session_id}: +{result.get('tokens_appended')} tokens")
    table = Table("source", "score", "text")
    for passage in passages:
        text = " ".join(passage.get("text", "").split())
        score = passage.get("score")
        table.add_row(*map(cell, (passage.get("source"), round(score, 3) if isinstance(score, float) else score,
                                  text[:60] + "…" * (len(text) > 60))))
    if table.row_count:
        stdout().print(table)


def usage_line(session_id: str, generation: Generation) -> str:
    """One line of figures after a reply: tokens, prefill reuse, speed."""
    usage = generation.usage
    parts = [f"session {session_id}", f"{usage.get('generated_tokens', len(generation.token_ids))} tokens"]
    if "prefilled_tokens" in usage:
        parts.append(f"prefilled {usage['prefilled_tokens']}, reused {usage.get('reused_tokens', 0)}")
    if "ttft_ms" in usage:
        parts.append(f"first token {usage['ttft_ms']:.0f} ms")
    if "decode_tok_s" in usage:
        parts.append(f"{usage['decode_tok_s']:.1f} tok/s")
    if generation.finish_reason not in (None, "stop"):
        parts.append(generation.finish_reason)
    return " · ".join(parts)


def stream_reply(session: Session, content: str, sampling: dict) -> Generation | None:
    """Print the reply as it streams; Ctrl-C stops it (the session keeps what was generated)."""
    reply = session.chat(content, stream=True, **sampling)
    try:
        for delta in reply:
            typer.echo(delta, nl=False)
    except KeyboardInterrupt:
        reply.close()
    typer.echo()
    if reply.result is not None:
        console = stderr()
        for call in reply.result.tool_calls:
            console.print(Text(f"tool call: {json.dumps(call, ensure_ascii=False)}"))
        console.print(Text(usage_line(session.id, reply.result)), style="dim")
    return reply.result


def repl(session: Session, sampling: dict) -> None:
    """Read messages until /exit, Ctrl-D or Ctrl-C at the prompt; errors of one turn do not end it."""
    import readline  # noqa: F401  (line editing and history for input())

    tokens = session.info().get("tokens", 0)  # also stops at once on a wrong --session
    stderr().print(f"session {session.id} ({tokens} tokens) · /exit or Ctrl-D to quit · Ctrl-C stops a reply", style="dim")
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            typer.echo()
            return
        if line in ("/exit", "/quit"):
            return
        if line:
            try:
                stream_reply(session, line, sampling)
            except DaemonNotRunning:
                raise
            except EllmError as exc:
                typer.echo(f"ellm: {error_line(exc)}", err=True)


def constraint_options(json_schema: Path | None, regex: str | None, grammar: Path | None) -> dict:
    """The sampling options of chat's --json-schema, --regex and --grammar (at most one)."""
    if sum(x is not None for x in (json_schema, regex, grammar)) > 1:
        raise typer.BadParameter("take one of them", param_hint="--json-schema / --regex / --grammar")
    if json_schema is not None:
        try:
            return {"json_schema": json.loads(json_schema.read_text(encoding="utf-8"))}
        except ValueError as e:
            raise typer.BadParameter(f"{json_schema}: not JSON: {e}", param_hint="--json-schema") from None
    if grammar is not None:
        return {"grammar": grammar.read_text(encoding="utf-8")}
    return present(regex=regex)


@app.command()
def chat(
    ctx: typer.Context,
    session_id: Optional[str] = typer.Option(None, "--session", "-s", help="Continue this session (default: open a new one)"),
    message: Optional[str] = typer.Option(None, "--message", "-m", help="Send this one message, print the reply and exit"),
    system: Optional[str] = typer.Option(None, help="System prompt of the new session"),
    title: Optional[str] = typer.Option(None, help="Title of the new session"),
    max_tokens: Optional[int] = typer.Option(None, help="Most tokens per reply (daemon default: 256)"),
    temperature: Optional[float] = typer.Option(None, help="Sampling temperature, 0 for greedy (daemon default: 0)"),
    top_p: Optional[float] = typer.Option(None, help="Nucleus sampling mass"),
    top_k: Optional[int] = typer.Option(None, help="Sample from the k most likely tokens"),
    seed: Optional[int] = typer.Option(None, help="Seed, for reproducible sampling"),
    json_output: bool = typer.Option(False, "--json", help="With -m: print one JSON object (session_id, text, usage, ...)"),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="Replies are JSON valid for this JSON Schema file",
                                               exists=True, dir_okay=False),
    regex: Optional[str] = typer.Option(None, help="Replies match this regular expression"),
    grammar: Optional[Path] = typer.Option(None, help="Replies follow this grammar file (Lark or GBNF)",
                                           exists=True, dir_okay=False),
):
    """Chat with the model: an interactive session with streamed replies, or one message with -m.

    --json-schema, --regex or --grammar constrain every reply (the daemon masks what would break it)."""
    if session_id is not None and (system is not None or title is not None):
        raise typer.BadParameter("only for a new session, not with --session", param_hint="--system / --title")
    if json_output and message is None:
        raise typer.BadParameter("needs -m", param_hint="--json")
    sampling = present(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                       **constraint_options(json_schema, regex, grammar))
    with connect(ctx) as client:
        session = client.session(session_id) if session_id else client.open_session(title=title, system=system)
        if message is None:
            repl(session, sampling)
        elif json_output:
            generation = session.chat(message, **sampling)
            print_json({"session_id": session.id, "text": generation.text, "finish_reason": generation.finish_reason,
                        "tool_calls": generation.tool_calls, "usage": generation.usage})
        else:
            generation = stream_reply(session, message, sampling)
            if generation is None or generation.finish_reason == "cancelled":
                raise typer.Exit(130)
