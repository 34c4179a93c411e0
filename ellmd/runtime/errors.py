"""The runtime's errors, and the error a request that raised an exception is answered with (the
codes are ellmd.errors.CODES)."""

from __future__ import annotations

from ellmd.errors import CODES, EllmError


class ProtocolError(EllmError):
    """An error with the PROTOCOL.md error code given where it is raised."""

    def __init__(self, code: str, message: str):
        if code not in CODES:
            raise ValueError(f"{code!r} is not an error code of CODES")
        super().__init__(message)
        self.code = code


class SlotsBusy(Exception):
    """Every slot holds a busy session: the request waits for one to finish."""


def protocol_error(e: Exception) -> ProtocolError:
    """The error a request that raised `e` is answered with: an EllmError's code and message, or
    `internal` naming the exception (a bug, InvariantError among them)."""
    if isinstance(e, ProtocolError):
        return e
    if isinstance(e, EllmError):
        return ProtocolError(e.code, str(e))
    return ProtocolError("internal", f"{type(e).__name__}: {e}")


def not_found(session_id) -> ProtocolError:
    return ProtocolError("not_found", f"no session {session_id!r}")


def busy(session_id) -> ProtocolError:
    return ProtocolError("busy", f"session {session_id} is busy with another request (generating or prefilling)")


def cancelled(why: str) -> ProtocolError:
    return ProtocolError("cancelled", why)
