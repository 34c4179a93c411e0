"""RPC: requests with ids, their events and their one reply, over one connection.

A connection sends `hello` first, gives every request a fresh id, and routes each incoming
message to the request it answers, so several requests may be in flight at once (the daemon may
answer them in any order). An error reply becomes the exception of its code (`ellm.errors`).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, TypeVar

from ellm import __version__
from ellm.errors import BadRequest, Cancelled, ConnectionLost, EllmError, ProtocolVersionError, RequestTimeout, error_from_wire
from ellm.framing import MAX_FRAME, READ_SIZE, FrameDecoder, pack
from ellm.transport import AsyncSocketTransport

PROTOCOL_VERSION = 1
CLIENT_NAME = f"ellm-py/{__version__}"

T = TypeVar("T")
R = TypeVar("R")


def hello_args() -> dict:
    return {"protocol": PROTOCOL_VERSION, "client": CLIENT_NAME}


def check_hello(result: dict) -> dict:
    """The daemon's hello result, if it speaks our protocol."""
    if result.get("protocol") != PROTOCOL_VERSION:
        raise ProtocolVersionError(f"the daemon speaks protocol {result.get('protocol')}, this client {PROTOCOL_VERSION}")
    return result


def reply_result(reply: dict) -> dict:
    """The result of a reply message, or its error raised as an exception."""
    if reply.get("ok"):
        return reply.get("result") or {}
    raise error_from_wire(reply.get("error") or {})


def is_event(message: dict) -> bool:
    return "event" in message


def event_data(event: str, data: dict) -> dict:
    """The default stream item: the event's data."""
    return data


def same(result: dict) -> dict:
    return result


def take_message(stream, message: dict):
    """One message of a stream: an event's value, or None once the reply ends it."""
    if is_event(message):
        return stream._item(message["event"], message.get("data") or {})
    stream.done = True
    stream.result = stream._final(reply_result(message))
    return None


class AsyncRpcConnection:
    """An asyncio connection: a reader task routes messages to per-request queues, so any number
    of requests may be in flight. `timeout` bounds each wait for a message. (The blocking client
    runs this connection on an event loop of its own: ellm.client.)"""

    def __init__(self, transport: AsyncSocketTransport, timeout: float | None = None):
        self._transport = transport
        self._decoder = FrameDecoder()
        self._timeout = timeout
        self._reader: asyncio.Task | None = None
        self._ids = itertools.count()  # hello gets id 0
        self._inbox: dict[int, Any] = {}
        self.error: EllmError | None = None  # why the connection ended; None while it is open
        self.server: dict = {}
        self.max_frame = MAX_FRAME

    @property
    def closed(self) -> bool:
        return self.error is not None

    def _frame(self, op: str, args: dict) -> tuple[int, bytes]:
        if self.error is not None:
            raise ConnectionLost(f"the connection is closed ({self.error.message})")
        rid = next(self._ids)
        data = pack({"id": rid, "op": op, "args": args})
        if len(data) > self.max_frame:  # the daemon would answer bad_frame and hang up
            raise BadRequest(f"{op}: a request of {len(data)} bytes is over the daemon's max_frame ({self.max_frame})")
        return rid, data

    def _raise_error(self):
        # A copy per waiter: one exception object raised in several threads or tasks would mix tracebacks.
        raise copy.copy(self.error)

    def _hello(self, result: dict) -> None:
        self.server = check_hello(result)
        self.max_frame = self.server.get("max_frame", MAX_FRAME)
        if self.max_frame != MAX_FRAME:
            self._decoder = FrameDecoder(self.max_frame)  # nothing else has arrived yet: hello is the only request so far

    def forget(self, rid: int) -> None:
        """Abandon request `rid`: its later messages are dropped on arrival."""
        self._inbox.pop(rid, None)


    @classmethod
    async def connect(cls, path: str, timeout: float | None = None) -> AsyncRpcConnection:
        conn = cls(await AsyncSocketTransport.connect(path, timeout), timeout)
        conn._reader = asyncio.get_running_loop().create_task(conn._read_loop())
        try:
            conn._hello(await conn.call("hello", hello_args()))
        except BaseException:
            await conn.close()
            raise
        return conn

    async def send(self, op: str, args: dict) -> int:
        """Send a request; its id."""
        rid, data = self._frame(op, args)
        self._inbox[rid] = asyncio.Queue()
        try:
            await self._transport.send(data)
        except EllmError as exc:
            self._fail(exc)
            raise
        return rid

    async def next_message(self, rid: int) -> dict:
        """The next event or the reply of request `rid`."""
        inbox = self._inbox[rid]
        try:
            message = await asyncio.wait_for(inbox.get(), self._timeout)
        except TimeoutError:
            self.forget(rid)
            raise RequestTimeout(f"no answer from the daemon within {self._timeout} s") from None
        if isinstance(message, EllmError):  # queued by _fail
            self.forget(rid)
            self._raise_error()
        if not is_event(message):
            self.forget(rid)
        return message

    async def call(self, op: str, args: dict) -> dict:
        """Send a request and wait for its result (events, if any, are dropped)."""
        rid = await self.send(op, args)
        while is_event(message := await self.next_message(rid)):
            pass
        return reply_result(message)

    async def close(self) -> None:
        """Close the connection; requests in flight fail with ConnectionLost."""
        self._fail(ConnectionLost("the connection was closed by the client"))
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self._transport.recv(READ_SIZE)
                if not data:
                    raise ConnectionLost("the daemon closed the connection")
                for message in self._decoder.feed(data):
                    if message.get("id") is None:  # bad_frame about the whole connection
                        raise error_from_wire(message.get("error") or {})
                    if (inbox := self._inbox.get(message["id"])) is not None:
                        inbox.put_nowait(message)
        except EllmError as exc:
            self._fail(exc)

    def _fail(self, exc: EllmError) -> None:
        if self.error is None:
            self.error = exc
            self._transport.close()
            for inbox in self._inbox.values():
                inbox.put_nowait(exc)


class AsyncStream(Generic[T, R]):
    """The events of one streaming request, as they arrive: `async for` over it, then read
    `result`, the mapped reply (an error reply is raised from the iteration instead). `aclose()`
    (or leaving an `async with` block) before its end cancels the request on the daemon and drops
    the rest of its events."""

    def __init__(self, conn: AsyncRpcConnection, rid: int,
                 item: Callable[[str, dict], T | None] = event_data, final: Callable[[dict], R] = same):
        self._conn = conn
        self._item = item
        self._final = final
        self.request_id = rid
        self.result: R | None = None
        self.done = False

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        while not self.done:
            try:
                message = await self._conn.next_message(self.request_id)
            except EllmError:
                self.done = True
                raise
            value = take_message(self, message)
            if value is not None:
                return value
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Cancel the request if it is still running and wait for its reply."""
        if self.done:
            return
        try:
            if not self._conn.closed:
                await self._conn.call("cancel", {"request_id": self.request_id})
                async for _ in self:
                    pass
        except (Cancelled, ConnectionLost):
            pass
        finally:
            self.done = True
            self._conn.forget(self.request_id)

    async def __aenter__(self) -> AsyncStream[T, R]:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __del__(self):
        if not self.done:
            self._conn.forget(self.request_id)
