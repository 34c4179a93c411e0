"""The blocking typed API: `Client` (one connection to the daemon) and `Session`."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import BinaryIO

from ellm.api import (UPLOAD_PIECE, Generation, chat_args, chunk_bytes, index_args, inject_args, present, progress_data,
                      token_text, upload_pieces)
from ellm.paths import default_socket_path
from ellm.rpc import RpcConnection, Stream


class Client:
    """A connection to the ellm daemon over its Unix socket.

    Connects and says `hello` at once, so a daemon that is not running raises `DaemonNotRunning`
    here. `timeout` (seconds, `None` for none) bounds the connect and each wait for a reply or an
    event. After a lost connection, the next request reconnects (the failed request is not
    retried); sessions live in the daemon, so `Session` objects stay valid. Threads may share a
    client: each request waits for its own reply.
    """

    def __init__(self, socket_path: str | Path | None = None, timeout: float | None = None):
        self.socket_path = str(socket_path or default_socket_path())
        self.timeout = timeout
        self._lock = threading.Lock()
        self._conn: RpcConnection | None = None
        self._connection()

    def _connection(self) -> RpcConnection:
        with self._lock:
            if self._conn is None or self._conn.closed:
                self._conn = RpcConnection.connect(self.socket_path, self.timeout)
            return self._conn

    @property
    def server(self) -> dict:
        """The daemon's `hello` result: protocol, server, model, max_frame."""
        return self._connection().server

    def call(self, op: str, /, **args) -> dict:
        """Send request `op` with `args` and return its result; an error reply raises its
        `EllmError` subclass."""
        return self._connection().call(op, args)

    def stream(self, op: str, /, **args) -> Stream[dict, dict]:
        """Send request `op` and return an iterator over the data of its events; after the
        iteration, the iterator's `.result` is the reply's result."""
        return self._stream(op, args)

    def _stream(self, op, args, item=None, final=None) -> Stream:
        conn = self._connection()
        rid = conn.send(op, args)
        return Stream(conn, rid, **present(item=item, final=final))

    def open_session(self, title: str | None = None, tags: list[str] | None = None,
                     system: str | None = None, tools: list[dict] | None = None) -> Session:
        """Open a new session (`system` is its system prompt, `tools` the tool schemas its
        template renders)."""
        info = self.call("session.open", **present(title=title, tags=tags, system=system, tools=tools))
        return Session(self, info["session_id"])

    def session(self, session_id: str) -> Session:
        """The session with this id (not checked here: a missing one raises `NotFound` on use)."""
        return Session(self, session_id)

    def list_sessions(self) -> list[dict]:
        """Every stored or resident session's info (without turns)."""
        return self.call("session.list")["sessions"]

    def skills(self) -> list[dict]:
        """The skills the daemon can load: `{name, description, path, files}` each."""
        return self.call("skill.list")["skills"]

    def rag_index(self, path, name: str | None = None, retriever: str | None = None, progress=None) -> dict:
        """(Re)index folder `path` (read by the daemon) as index `name` ("default"); only changed files
        are read again. `progress(data)` gets `{files_done, files_total, path}` now and then.
        Returns `{name, path, retriever, files, files_indexed, files_unchanged, files_removed, chunks, seconds}`."""
        stream = self._stream("rag.index", index_args(path, name, retriever), progress_data)
        for data in stream:
            if progress is not None:
                progress(data)
        return stream.result

    def rag_indexes(self) -> list[dict]:
        """The daemon's retrieval indexes: `{name, path, retriever, files, chunks, updated}` each."""
        return self.call("rag.list")["indexes"]

    def rag_remove(self, name: str) -> dict:
        """Delete retrieval index `name` (the indexed folder is not touched)."""
        return self.call("rag.remove", name=name)

    def import_session(self, source: bytes | BinaryIO) -> Session:
        """Import a session blob written by `Session.export` (bytes or a binary file)."""
        conn = self._connection()  # the pieces of one upload must share a connection
        upload = None
        for piece, more in upload_pieces(source, min(UPLOAD_PIECE, conn.max_frame // 2)):
            result = conn.call("session.import", present(data=piece, more=more, upload=upload))
            upload = result.get("upload")
        return Session(self, result["session_id"])

    def stats(self) -> dict:
        """The daemon's figures: model, capacity, sessions, KV bytes, uptime."""
        return self.call("stats")

    def shutdown(self) -> dict:
        """Ask the daemon to snapshot every session and exit."""
        return self.call("shutdown")

    def close(self) -> None:
        """Close the connection (generations in flight on it are cancelled by the daemon)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Session:
    """A session of the daemon: an append-only token sequence with its KV, by id.

    Sampling arguments (`max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`,
    ... as in PROTOCOL.md) are keyword arguments of `chat` and `generate`.
    """

    def __init__(self, client: Client, session_id: str):
        self.client = client
        self.id = session_id

    def __repr__(self) -> str:
        return f"Session({self.id!r})"

    def _call(self, op: str, **args) -> dict:
        return self.client.call(op, session_id=self.id, **args)

    def chat(self, content: str | dict, stream: bool = False, **sampling) -> Generation | Stream[str, Generation]:
        """Append a user message (`content` a str) or a whole message (a map such as
        `{"role": "tool", "content": ...}`) and generate the reply.

        Returns a `Generation`, or with `stream=True` an iterator of text deltas whose `.result`
        is the `Generation` once it is exhausted.
        """
        return self._generate("session.chat", chat_args(self.id, content, stream, sampling), stream)

    def generate(self, stream: bool = False, **sampling) -> Generation | Stream[str, Generation]:
        """Generate from the session as it is (after `append`); returns like `chat`."""
        return self._generate("session.generate", {"session_id": self.id, **sampling, "stream": stream}, stream)

    def _generate(self, op: str, args: dict, stream: bool):
        if stream:
            return self.client._stream(op, args, token_text, Generation.from_result)
        return Generation.from_result(self.client.call(op, **args))

    def append(self, message: dict | None = None, text: str | None = None, tokens: list[int] | None = None) -> dict:
        """Append one of: a message (rendered by the chat template), raw text, or token ids.
        Returns `{tokens_appended, tokens, usage}`."""
        return self._call("session.append", **present(message=message, text=text, tokens=tokens))

    def load_skill(self, name: str, force: bool = False, role: str | None = None, file: str | None = None) -> dict:
        """Append skill `name` (its instructions, or with `file` one of its files) as a message in
        `role` (the daemon's context_role by default). Loading it again is a no-op unless `force`.
        Returns `{skill, file, loaded, tokens_appended, tokens, usage}`."""
        return self._call("skill.load", **present(name=name, force=force, role=role, file=file))

    def inject(self, query: str | None = None, documents: list[str | dict] | None = None, k: int | None = None,
               index: str | None = None, role: str | None = None) -> dict:
        """Append documents (str or `{text, source}`), or the `k` passages index `index` retrieves for
        `query`, as one context message. Returns `{passages, tokens_appended, tokens, usage}`."""
        return self.client.call("rag.inject", **inject_args(self.id, query, documents, k, index, role))

    def fork(self, title: str | None = None) -> Session:
        """A new session sharing this one's tokens and KV so far."""
        info = self._call("session.fork", **present(title=title))
        return Session(self.client, info["session_id"])

    def rewind(self, turn: int | None = None, tokens: int | None = None) -> dict:
        """Keep the turns before `turn`, or the first `tokens` tokens. Returns the session info."""
        return self._call("session.rewind", **present(turn=turn, tokens=tokens))

    def snapshot(self) -> dict:
        """Write the session's changed KV chunks to the store. Returns `{chunks_written, bytes_written, ms}`."""
        return self._call("session.snapshot")

    def resume(self) -> dict:
        """Load the session into a slot from the store. Returns `{session_id, tokens, ms}`."""
        return self._call("session.resume")

    def close(self) -> dict:
        """Free the session's slot; it stays stored. Returns `{session_id, snapshotted}`."""
        return self._call("session.close")

    def delete(self) -> dict:
        """Delete the session from memory and the store."""
        return self._call("session.delete")

    def info(self) -> dict:
        """The session info: title, tags, tokens, turns, skills, fingerprint, ..."""
        return self._call("session.info")

    def export(self, out: BinaryIO) -> dict:
        """Write the session as a self-contained blob (metadata, tokens, KV) to the binary file
        `out`. Returns `{session_id, tokens, bytes}`."""
        stream = self.client._stream("session.export", {"session_id": self.id}, chunk_bytes)
        for piece in stream:
            out.write(piece)
        return stream.result
