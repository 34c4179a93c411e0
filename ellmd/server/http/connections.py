"""The HTTP connections' bound: one more gets 503 with Retry-After and is closed (with API keys,
per key once authenticated)."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from ellmd.server.http.errors import RETRY_AFTER_S, ApiError
from ellmd.server.limits import Limits

REFUSAL_LINGER_S = 2.0  # a refused connection is answered once its request head is in, closed by then at the latest


def too_many_connections(message: str) -> ApiError:
    return ApiError(503, message, "server_error", code="too_many_connections",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


class CountedSite(web.BaseSite):
    """A TCP site that bounds its connections (a connection beyond a bound is refused: 503, see Refusal).

    Without API keys, at most `limit` connections at once. With keys, a connection counts against
    its key once a request on it authenticates (Guard calls `authenticated`): at most `limit` per
    key, so a key's idle keep-alive connections lock out that key alone. Until then it is one of at
    most `unauthenticated` connections, closed after `auth_timeout` s; one more closes the oldest
    of them (a client that sends its request at once is never the oldest for long). A connection
    counts from connection_made to connection_lost, which asyncio calls once for every transport
    however it ends (a client that vanishes too), so a place is never lost.
    """

    def __init__(self, runner: web.AppRunner, host: str, port: int, limits: Limits, keyed: bool = False):
        super().__init__(runner)
        self.runner, self.host, self.port, self.keyed = runner, host, port, keyed
        self.limit, self.auth_timeout = limits.http_max_connections, limits.http_auth_timeout_s
        self.unauthenticated = limits.http_max_unauthenticated
        self.open: dict[str | None, int] = {}  # key name (None: not authenticated yet) -> connections
        self.waiting: dict = {}  # transport -> Gate of the connections not authenticated yet, oldest first
        self.gates: dict = {}  # transport -> Gate of every counted connection

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Gate(self), self.host, self.port, reuse_address=True)

    def admit(self, gate: Gate) -> str | None:
        """Count a new connection; the reason it is refused, else None."""
        if not self.keyed:
            if self.open.get(None, 0) >= self.limit:
                return (f"the daemon already serves {self.open[None]} HTTP connections (http_max_connections); "
                        "retry later")
        elif len(self.waiting) >= self.unauthenticated:
            oldest = next(iter(self.waiting.values()))
            oldest.transport.close()  # its connection_lost uncounts it
            self.forget(oldest)
        self.count(gate, None)
        if self.keyed:
            self.waiting[gate.transport] = gate
            gate.timer = asyncio.get_running_loop().call_later(self.auth_timeout, gate.transport.close)
        return None

    def authenticated(self, transport, key: str) -> None:
        """A request on this connection came with the key named `key`: the connection counts against
        that key from now on; ApiError 503 when the key holds `limit` already (the connection stays
        unauthenticated: closed after auth_timeout)."""
        gate = self.gates.get(transport)
        if gate is None or gate.key == key:
            return
        if self.open.get(key, 0) >= self.limit:
            raise too_many_connections(f"this API key already holds {self.open[key]} HTTP connections "
                                       "(http_max_connections); close one or retry later")
        self.uncount(gate)
        self.count(gate, key)

    def count(self, gate: Gate, key: str | None) -> None:
        gate.key, gate.counted = key, True
        self.open[key] = self.open.get(key, 0) + 1
        self.gates[gate.transport] = gate

    def uncount(self, gate: Gate) -> None:
        """Stop counting a connection (it closed, or changes key)."""
        if gate.counted:
            self.open[gate.key] -= 1
            gate.counted = False
            self.gates.pop(gate.transport, None)
        self.forget(gate)

    def forget(self, gate: Gate) -> None:
        """A connection is no longer waiting to authenticate."""
        if self.waiting.pop(gate.transport, None) is not None and gate.timer is not None:
            gate.timer.cancel()


class Gate(asyncio.Protocol):
    """One accepted connection: aiohttp's handler while the site has room, else a Refusal."""

    def __init__(self, site: CountedSite):
        self.site, self.counted, self.key, self.timer = site, False, None, None
        self.inner: asyncio.Protocol | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        refused = self.site.admit(self)
        self.inner = Refusal(refused) if refused else self.site.runner.server()
        self.inner.connection_made(transport)

    def connection_lost(self, exc) -> None:
        self.site.uncount(self)
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class Refusal(asyncio.Protocol):
    """A connection beyond http_max_connections: 503 with Retry-After, once the request's head has
    arrived (a reply before it could be lost to the reset of closing with unread input), then closed."""

    def __init__(self, message: str):
        body = json.dumps(too_many_connections(message).body()).encode()
        self.reply = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\nRetry-After: {RETRY_AFTER_S}\r\nConnection: close\r\n\r\n"
                      ).encode() + body
        self.head = b""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, self.close)

    def data_received(self, data: bytes) -> None:
        if self.reply:  # after the reply, what comes is read and dropped until the client closes
            self.head += data
            if b"\r\n\r\n" in self.head or len(self.head) > 16384:
                self.answer()

    def answer(self) -> None:
        self.transport.write(self.reply)
        self.reply = b""
        if self.transport.can_write_eof():
            self.transport.write_eof()

    def close(self) -> None:
        if self.reply:
            self.answer()
        self.transport.close()

    def eof_received(self) -> None:
        self.close()

    def connection_lost(self, exc) -> None:
        self.timer.cancel()
