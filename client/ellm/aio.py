"""The asyncio typed API: `AsyncClient` and `AsyncSession`, the same methods as `Client` and
`Session`, awaited. Any number of requests may be in flight on one connection."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import BinaryIO

from ellm.api import (UPLOAD_PIECE, Generation, chat_args, chunk_bytes, index_args, inject_args, present, progress_data,
                      token_text, upload_pieces)
from ellm.paths import default_socket_path
from ellm.rpc import AsyncRpcConnection, AsyncStream


class AsyncClient:
    """An asyncio connection to the ellm daemon.

    Use `async with AsyncClient() as client:`, or `await client.connect()`; a request on an
    unconnected client connects first. `timeout` bounds the connect and each wait for a reply or
    an event. After a lost connection, the next request reconnects (the failed request is not
    retried).
    """

    def __init__(self, socket_path: str | Path | None = None, timeout: float | None = None):
        self.socket_path = str(socket_path or default_socket_path())
        self.timeout = timeout
        self._lock = asyncio.Lock()
        self._conn: AsyncRpcConnection | None = None

    async def _connection(self) -> AsyncRpcConnection:
        async with self._lock:  # one connect at a time, however many tasks ask
            if self._conn is None or self._conn.closed:
                self._conn = await AsyncRpcConnection.connect(self.socket_path, self.timeout)
            return self._conn

    async def connect(self) -> AsyncClient:
        """Connect and say `hello` (raises `DaemonNotRunning` when nothing listens)."""
        await self._connection()
        return self

    @property
    def server(self) -> dict:
        """The daemon's `hello` result ({} before connecting)."""
        return self._conn.server if self._conn else {}

    async def call(self, op: str, /, **args) -> dict:
        """Send request `op` with `args` and return its result; an error reply raises its
        `EllmError` subclass."""
        return await (await self._connection()).call(op, args)

    async def stream(self, op: str, /, **args) -> AsyncStream[dict, dict]:
        """Send request `op` and return an async iterator over the data of its events; after
        the iteration, its `.result` is the reply's result."""
        return await self._stream(op, args)

    async def _stream(self, op, args, item=None, final=None) -> AsyncStream:
        conn = await self._connection()
        rid = await conn.send(op, args)
        return AsyncStream(conn, rid, **present(item=item, final=final))

    async def open_session(self, title: str | None = None, tags: list[str] | None = None,
                           system: str | None = None, tools: list[dict] | None = None) -> AsyncSession:
        """Open a new session (see `Client.open_session`)."""
        info = await self.call("session.open", **present(title=title, tags=tags, system=system, tools=tools))
        return AsyncSession(self, info["session_id"])

    def session(self, session_id: str) -> AsyncSession:
        """The session with this id (not checked here)."""
        return AsyncSession(self, session_id)

    async def list_sessions(self) -> list[dict]:
        """Every stored or resident session's info (without turns)."""
        return (await self.call("session.list"))["sessions"]

    async def skills(self) -> list[dict]:
        """The skills the daemon can load: `{name, description, path, files}` each."""
        return (await self.call("skill.list"))["skills"]

    async def rag_index(self, path, name: str | None = None, retriever: str | None = None, progress=None) -> dict:
        """(Re)index folder `path` (read by the daemon) as index `name` ("default"); only changed files
        are read again. `progress(data)` gets `{files_done, files_total, path}` now and then.
        Returns `{name, path, retriever, files, files_indexed, files_unchanged, files_removed, chunks, seconds}`."""
        stream = await self._stream("rag.index", index_args(path, name, retriever), progress_data)
        async for data in stream:
            if progress is not None:
                progress(data)
        return stream.result

    async def rag_indexes(self) -> list[dict]:
        """The daemon's retrieval indexes: `{name, path, retriever, files, chunks, updated}` each."""
        return (await self.call("rag.list"))["indexes"]

    async def rag_remove(self, name: str) -> dict:
        """Delete retrieval index `name` (the indexed folder is not touched)."""
        return await self.call("rag.remove", name=name)

    async def import_session(self, source: bytes | BinaryIO) -> AsyncSession:
        """Import a session blob written by `export` (bytes or a binary file)."""
        conn = await self._connection()
        upload = None
        for piece, more in upload_pieces(source, min(UPLOAD_PIECE, conn.max_frame // 2)):
            result = await conn.call("session.import", present(data=piece, more=more, upload=upload))
            upload = result.get("upload")
        return AsyncSession(self, result["session_id"])

    async def stats(self) -> dict:
        """The daemon's figures: model, capacity, sessions, KV bytes, uptime."""
        return await self.call("stats")

    async def shutdown(self) -> dict:
        """Ask the daemon to snapshot every session and exit."""
        return await self.call("shutdown")

    async def close(self) -> None:
        """Close the connection (generations in flight on it are cancelled by the daemon)."""
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()


class AsyncSession:
    """A session of the daemon, by id, over an `AsyncClient` (see `Session`)."""

    def __init__(self, client: AsyncClient, session_id: str):
        self.client = client
        self.id = session_id

    def __repr__(self) -> str:
        return f"AsyncSession({self.id!r})"

    async def _call(self, op: str, **args) -> dict:
        return await self.client.call(op, session_id=self.id, **args)

    async def chat(self, content: str | dict, stream: bool = False, **sampling) -> Generation | AsyncStream[str, Generation]:
        """Append a user message (str) or a whole message (map) and generate the reply: a
        `Generation`, or with `stream=True` an async iterator of text deltas whose `.result` is
        the `Generation` once it is exhausted."""
        return await self._generate("session.chat", chat_args(self.id, content, stream, sampling), stream)

    async def generate(self, stream: bool = False, **sampling) -> Generation | AsyncStream[str, Generation]:
        """Generate from the session as it is; returns like `chat`."""
        return await self._generate("session.generate", {"session_id": self.id, **sampling, "stream": stream}, stream)

    async def _generate(self, op: str, args: dict, stream: bool):
        if stream:
            return await self.client._stream(op, args, token_text, Generation.from_result)
        return Generation.from_result(await self.client.call(op, **args))

    async def append(self, message: dict | None = None, text: str | None = None, tokens: list[int] | None = None) -> dict:
        """Append a message, raw text or token ids. Returns `{tokens_appended, tokens, usage}`."""
        return await self._call("session.append", **present(message=message, text=text, tokens=tokens))

    async def load_skill(self, name: str, force: bool = False, role: str | None = None, file: str | None = None) -> dict:
        """Append skill `name` (its instructions, or with `file` one of its files) as a message in
        `role` (the daemon's context_role by default). Loading it again is a no-op unless `force`.
        Returns `{skill, file, loaded, tokens_appended, tokens, usage}`."""
        return await self._call("skill.load", **present(name=name, force=force, role=role, file=file))

    async def inject(self, query: str | None = None, documents: list[str | dict] | None = None, k: int | None = None,
               index: str | None = None, role: str | None = None) -> dict:
        """Append documents (str or `{text, source}`), or the `k` passages index `index` retrieves for
        `query`, as one context message. Returns `{passages, tokens_appended, tokens, usage}`."""
        return await self.client.call("rag.inject", **inject_args(self.id, query, documents, k, index, role))

    async def fork(self, title: str | None = None) -> AsyncSession:
        """A new session sharing this one's tokens and KV so far."""
        info = await self._call("session.fork", **present(title=title))
        return AsyncSession(self.client, info["session_id"])

    async def rewind(self, turn: int | None = None, tokens: int | None = None) -> dict:
        """Keep the turns before `turn`, or the first `tokens` tokens. Returns the session info."""
        return await self._call("session.rewind", **present(turn=turn, tokens=tokens))

    async def snapshot(self) -> dict:
        """Write the session's changed KV chunks to the store."""
        return await self._call("session.snapshot")

    async def resume(self) -> dict:
        """Load the session into a slot from the store."""
        return await self._call("session.resume")

    async def close(self) -> dict:
        """Free the session's slot; it stays stored."""
        return await self._call("session.close")

    async def release(self) -> dict:
        """Hand the session back to the store: snapshotted, its slot freed, dropped from the daemon's
        memory and, on a fleet replica, its lease given back. {session_id, tokens, released}."""
        return await self._call("session.release")

    async def grant(self, key: str | None) -> dict:
        """Give the session to the HTTP API key named `key` (a name in the daemon's api_key_file),
        which then reaches it by this id; None takes it back (the socket's user's alone).
        Returns `{session_id, key}`."""
        return await self._call("session.grant", key=key)

    async def delete(self) -> dict:
        """Delete the session from memory and the store."""
        return await self._call("session.delete")

    async def info(self) -> dict:
        """The session info."""
        return await self._call("session.info")

    async def export(self, out: BinaryIO) -> dict:
        """Write the session as a self-contained blob to the binary file `out`. Returns
        `{session_id, tokens, bytes}`."""
        stream = await self.client._stream("session.export", {"session_id": self.id}, chunk_bytes)
        async for piece in stream:
            out.write(piece)
        return stream.result
