"""Exceptions: one class per error code of PROTOCOL.md, plus the client's own connection errors."""

from __future__ import annotations

from pathlib import Path

from ellm.paths import default_socket_path


class EllmError(Exception):
    """Base class of every ellm error.

    `code` is the protocol error code (`None` for errors the client raises about its connection);
    `message` is the text meant for the user.
    """

    code: str | None = None

    def __init__(self, message: str = "", code: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:  # a code this client does not know has no class of its own
            self.code = code


class BadFrame(EllmError):
    """A message was not a msgpack map or was over `max_frame`; the connection is closed."""

    code = "bad_frame"


class BadRequest(EllmError):
    """Missing or ill-typed arguments, or a request before `hello`."""

    code = "bad_request"


class UnknownOp(EllmError):
    """The daemon has no such op."""

    code = "unknown_op"


class ProtocolVersionError(EllmError):
    """The client and the daemon speak different protocol versions."""

    code = "protocol_version"


class NotFound(EllmError):
    """No such session, skill, turn or upload."""

    code = "not_found"


class CapacityError(EllmError):
    """The request does not fit: sequence length, or no slot can be freed."""

    code = "capacity"


class Busy(EllmError):
    """The session is generating for another request, or a daemon limit is reached (its request
    queue, requests in flight on this connection, connections): retry later."""

    code = "busy"


class Leased(Busy):
    """The session is held by another fleet replica (a kind of busy: retry there, or later)."""

    code = "leased"


class FingerprintError(EllmError):
    """A stored session was made by another model, tokenizer, template or KV layout."""

    code = "fingerprint"


class StoreError(EllmError):
    """The store is full or damaged; nothing already committed is lost."""

    code = "store"


class Cancelled(EllmError):
    """The request was cancelled (by `cancel`, or because the daemon is shutting down)."""

    code = "cancelled"


class InternalError(EllmError):
    """A bug in the daemon; it keeps serving."""

    code = "internal"


class DaemonNotRunning(EllmError):
    """Nothing listens on the socket: the message says how to start the daemon."""

    def __init__(self, socket_path: str | Path):
        self.socket_path = str(socket_path)
        start = "ellmd start"
        if Path(socket_path) != default_socket_path():
            start += f" --socket {socket_path}"
        super().__init__(
            f"the daemon is not running (nothing listens on {socket_path}); "
            f"start it with `{start}`, or `{start} --detach` to run it in the background"
        )


class ConnectionLost(EllmError):
    """The connection to the daemon ended; requests in flight on it fail with this error.
    The client reconnects on its next request (requests themselves are never retried)."""


class RequestTimeout(EllmError):
    """The daemon did not answer within the client's timeout; the request is abandoned."""


ERRORS: dict[str, type[EllmError]] = {
    cls.code: cls
    for cls in (BadFrame, BadRequest, UnknownOp, ProtocolVersionError, NotFound, CapacityError, Busy, Leased,
                FingerprintError, StoreError, Cancelled, InternalError)
}


def error_from_wire(error: dict) -> EllmError:
    """The exception for an `error: {code, message}` map of a reply."""
    code = error.get("code")
    message = error.get("message", "")
    cls = ERRORS.get(code)
    return cls(message) if cls else EllmError(message, code=code)
