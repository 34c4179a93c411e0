"""Transport: a Unix stream socket to the daemon, blocking or asyncio. Bytes in, bytes out."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from ellm.errors import ConnectionLost, DaemonNotRunning, EllmError, RequestTimeout


def connect_error(path: str, exc: OSError) -> EllmError:
    """The error for a failed connect: no socket file, or a stale one, means no daemon."""
    if isinstance(exc, (FileNotFoundError, ConnectionRefusedError)):
        return DaemonNotRunning(path)
    return EllmError(f"cannot connect to {path}: {exc.strerror or exc}")


class SocketTransport:
    """A connected blocking Unix socket. `timeout` (seconds, `None` for none) bounds the connect
    and each wait for data."""

    def __init__(self, path: str | Path, timeout: float | None = None):
        self.path = str(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(self.path)
        except TimeoutError:
            sock.close()
            raise RequestTimeout(f"no answer from {self.path} within {timeout} s") from None
        except OSError as exc:
            sock.close()
            raise connect_error(self.path, exc) from None
        self._sock = sock
        self._timeout = timeout

    def send(self, data: bytes) -> None:
        """Send all of `data`. A send that fails or times out leaves a partial message on the
        wire, so it always means the connection is lost."""
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise ConnectionLost(f"cannot send to the daemon: {exc.strerror or exc}") from None

    def recv(self, size: int) -> bytes:
        """Up to `size` bytes; `b""` when the daemon closed the connection."""
        try:
            return self._sock.recv(size)
        except TimeoutError:
            raise RequestTimeout(f"no answer from the daemon within {self._timeout} s") from None
        except OSError as exc:
            raise ConnectionLost(f"connection to the daemon failed: {exc.strerror or exc}") from None

    def close(self) -> None:
        self._sock.close()


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
