"""The servers' resource limits (settings in config/ellmd.toml) and the engine queue's admission.

Every bound a client could otherwise push without end: connections, requests in flight, queued
engine requests, upload and body sizes, how long a handshake or a half-sent frame may take, and
how much output may wait for a client that does not read.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    max_connections: int = 64  # Unix-socket connections at once
    max_in_flight: int = 64  # requests in flight on one connection
    max_queue: int = 256  # engine requests submitted and not answered yet, both transports
    max_upload_bytes: int = 4096 * MIB  # one chunked session.import
    hello_timeout_s: float = 10.0  # from connecting to hello
    frame_timeout_s: float = 30.0  # from a frame's first byte to its last
    max_write_buffer: int = 32 * MIB  # output waiting for a client; beyond it the connection is dropped
    write_timeout_s: float = 60.0  # an export waits this long for a client to read each piece
    http_max_connections: int = 64  # HTTP connections at once (idle keep-alive ones too); with API keys, per key
    http_max_unauthenticated: int = 16  # with API keys: connections whose first request has not authenticated yet
    http_auth_timeout_s: float = 10.0  # with API keys: from connecting to a request with a valid key
    http_max_body: int = 16 * MIB
    http_read_timeout_s: float = 60.0  # headers and body of one HTTP request

    @classmethod
    def from_settings(cls, settings, kv_bytes_per_token: int) -> Limits:
        """The limits of a daemon; an upload limit of 0 means the blob of the largest session it can hold."""
        upload = settings.max_upload_mb * MIB
        if upload == 0:  # a full slot's KV, plus room for its tokens and metadata
            upload = kv_bytes_per_token * settings.sequence_length + 64 * MIB
        return cls(
            max_connections=settings.max_connections, max_in_flight=settings.max_in_flight,
            max_queue=settings.max_queue, max_upload_bytes=upload,
            hello_timeout_s=settings.hello_timeout_s, frame_timeout_s=settings.frame_timeout_s,
            max_write_buffer=settings.max_write_buffer_mb * MIB, write_timeout_s=settings.write_timeout_s,
            http_max_connections=settings.http_max_connections, http_max_body=settings.http_max_body_mb * MIB,
            http_read_timeout_s=settings.http_read_timeout_s, http_max_unauthenticated=settings.http_max_unauthenticated,
            http_auth_timeout_s=settings.http_auth_timeout_s,
        )


class QueueFull(Exception):
    """The engine has max_queue requests waiting: the caller answers `busy` (429 over HTTP)."""


class Admission:
    """Counts the engine requests both servers submitted and that are not answered yet.

    The count goes down when a request's future resolves (on the engine thread), so it bounds the
    engine queue, the requests waiting for a slot and the generations running, together.
    """

    def __init__(self, runtime, max_queue: int):
        self.runtime, self.max_queue = runtime, max_queue
        self.outstanding = 0
        self._lock = threading.Lock()

    def submit(self, op: str, args: dict, emit=None):
        """runtime.submit, or QueueFull when max_queue requests are outstanding."""
        with self._lock:
            if self.outstanding >= self.max_queue:
                raise QueueFull(f"the daemon has {self.outstanding} requests queued (max_queue); retry later")
            self.outstanding += 1
        try:
            request = self.runtime.submit(op, args, emit)
        except BaseException:
            self._done(None)
            raise
        request.future.add_done_callback(self._done)
        return request

    def _done(self, _future) -> None:
        with self._lock:
            self.outstanding -= 1
