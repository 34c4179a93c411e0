"""The blocking typed API: `Client` and `Session`, written once, on top of the asyncio API.

Like pynvim's: a `Client` runs an `AsyncClient` on an event loop of its own (a daemon thread)
and every method waits for its coroutine there. The methods, their arguments and docstrings are
`AsyncClient`'s and `AsyncSession`'s; what they return is wrapped back (an `AsyncSession` as a
`Session`, an `AsyncStream` as a `Stream`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Generic, TypeVar

from ellm.aio import AsyncClient, AsyncSession
from ellm.rpc import AsyncStream

T = TypeVar("T")
R = TypeVar("R")


class _Loop:
    """An event loop on a daemon thread, started on first use and stopped by `close`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def run(self, coroutine):
        """Run a coroutine on the loop and wait for its result. An interrupt (Ctrl-C) cancels it,
        so that a stream interrupted while waiting for a message can still be closed."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="ellm-client", daemon=True)
                self._thread.start()
            future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()


class Stream(Generic[T, R]):
    """The events of one streaming request, as they arrive; `result` holds the mapped reply once
    iteration has ended (an error reply is raised from the iteration instead).

    Closing a stream before its end (`close()`, leaving a `with` block) cancels the request on
    the daemon and drops the rest of its events.
    """

    def __init__(self, loop: _Loop, stream: AsyncStream[T, R]):
        self._loop = loop
        self._stream = stream
        self.request_id = stream.request_id

    @property
    def result(self) -> R | None:
        return self._stream.result

    @property
    def done(self) -> bool:
        return self._stream.done

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        try:
            return self._loop.run(self._stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        """Cancel the request if it is still running and wait for its reply."""
        if not self.done:
            self._loop.run(self._stream.aclose())

    def __enter__(self) -> Stream[T, R]:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _blocking(method):
    """The blocking form of an async method of AsyncClient or AsyncSession."""
    @functools.wraps(method)
    def call(owner, /, *args, **kwargs):  # positional-only: `self` may be a request argument
        return owner._wrap(owner._loop.run(method(owner._async, *args, **kwargs)))
    return call


def _blocking_methods(source: type):
    """Give a class the blocking form of every public coroutine method of `source`."""
    def decorate(cls):
        for name, method in vars(source).items():
            if inspect.iscoroutinefunction(method) and not name.startswith("_") and name not in vars(cls):
                setattr(cls, name, _blocking(method))
        return cls
    return decorate


@_blocking_methods(AsyncClient)
class Client:
    """A connection to the ellm daemon over its Unix socket.

    Connects and says `hello` at once, so a daemon that is not running raises `DaemonNotRunning`
    here. `timeout` (seconds, `None` for none) bounds the connect and each wait for a reply or an
    event. After a lost connection, the next request reconnects (the failed request is not
    retried); sessions live in the daemon, so `Session` objects stay valid. Threads may share a
    client: each request waits for its own reply. The methods are `AsyncClient`'s, blocking.
    """

    def __init__(self, socket_path: str | Path | None = None, timeout: float | None = None):
        self._loop = _Loop()
        self._async = AsyncClient(socket_path, timeout)
        self.socket_path, self.timeout = self._async.socket_path, timeout
        try:
            self._loop.run(self._async.connect())
        except BaseException:
            self._loop.close()
            raise

    @property
    def server(self) -> dict:
        """The daemon's `hello` result: protocol, server, model, max_frame."""
        return self._async.server

    def _wrap(self, value):
        if isinstance(value, AsyncSession):
            return Session(self, value.id)
        if isinstance(value, AsyncStream):
            return Stream(self._loop, value)
        return value if value is not self._async else self

    def session(self, session_id: str) -> Session:
        """The session with this id (not checked here: a missing one raises `NotFound` on use)."""
        return Session(self, session_id)

    def close(self) -> None:
        """Close the connection (generations in flight on it are cancelled by the daemon); the
        next request connects again."""
        self._loop.run(self._async.close())
        self._loop.close()
        self._async = AsyncClient(self.socket_path, self.timeout)  # its lock belonged to the closed loop

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@_blocking_methods(AsyncSession)
class Session:
    """A session of the daemon: an append-only token sequence with its KV, by id.

    Sampling arguments (`max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`,
    ... as in PROTOCOL.md) are keyword arguments of `chat` and `generate`, which return a
    `Generation`, or with `stream=True` an iterator of text deltas whose `.result` is the
    `Generation` once it is exhausted. The methods are `AsyncSession`'s, blocking.
    """

    def __init__(self, client: Client, session_id: str):
        self.client = client
        self.id = session_id
        self._loop = client._loop

    @property
    def _async(self) -> AsyncSession:
        return AsyncSession(self.client._async, self.id)

    def __repr__(self) -> str:
        return f"Session({self.id!r})"

    def _wrap(self, value):
        return self.client._wrap(value)
