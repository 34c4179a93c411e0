"""Transport: a Unix stream socket to the daemon (asyncio). Bytes in, bytes out."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ellm.errors import ConnectionLost, DaemonNotRunning, EllmError, RequestTimeout


def connect_error(path: str, exc: OSError) -> EllmError:
    """The error for a failed connect: no socket file, or a stale one, means no daemon."""
    if isinstance(exc, (FileNotFoundError, ConnectionRefusedError)):
        return DaemonNotRunning(path)
    return EllmError(f"cannot connect to {path}: {exc.strerror or exc}")


class AsyncSocketTransport:
    """A connected asyncio Unix socket (timeouts are applied by the rpc layer)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader = reader
        self._writer = writer

    @classmethod
    async def connect(cls, path: str | Path, timeout: float | None = None) -> AsyncSocketTransport:
        path = str(path)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), timeout)
        except TimeoutError:
            raise RequestTimeout(f"no answer from {path} within {timeout} s") from None
        except OSError as exc:
            raise connect_error(path, exc) from None
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        """Send all of `data`; any failure means the connection is lost."""
        try:
            self._writer.write(data)
            await self._writer.drain()
        except OSError as exc:
            raise ConnectionLost(f"cannot send to the daemon: {exc.strerror or exc}") from None

    async def recv(self, size: int) -> bytes:
        """Up to `size` bytes; `b""` when the daemon closed the connection."""
        try:
            return await self._reader.read(size)
        except OSError as exc:
            raise ConnectionLost(f"connection to the daemon failed: {exc.strerror or exc}") from None

    def close(self) -> None:
        self._writer.close()
