"""Errors, and the one table of PROTOCOL.md's error codes (CODES).

A request that raises an EllmError is answered with the code its class names (`code`, a key of
CODES) and its message as is; anything else is a bug, answered `internal` and logged with its
traceback. The HTTP APIs answer each code with the status and OpenAI error fields of its row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Code:
    """How the HTTP APIs answer an error code: the status, OpenAI's error `type` and `code`."""

    status: int
    type: str = "server_error"
    api_code: str | None = None


CODES: dict[str, Code] = {
    "bad_frame": Code(500, api_code="bad_frame"),  # (the socket's framing: never over HTTP)
    "bad_request": Code(400, "invalid_request_error"),
    "unknown_op": Code(500, api_code="unknown_op"),  # (the HTTP APIs send only ops that exist)
    "protocol_version": Code(500, api_code="protocol_version"),  # (the socket's hello: never over HTTP)
    "not_found": Code(404, "not_found_error"),
    "capacity": Code(400, "invalid_request_error", "context_length_exceeded"),
    "busy": Code(409, "conflict_error", "session_busy"),
    "leased": Code(409, "conflict_error", "session_leased"),
    "fingerprint": Code(409, "conflict_error", "fingerprint_mismatch"),
    "store": Code(500, api_code="store"),
    "cancelled": Code(503, api_code="cancelled"),
    "internal": Code(500, api_code="internal"),
}


class EllmError(Exception):
    """Base class: the message is meant for the user as is; `code` is the PROTOCOL.md error code a
    request that raised it is answered with (a class' own, or one given where it is raised)."""

    code = "internal"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.code not in CODES:
            raise TypeError(f"{cls.__name__}.code {cls.code!r} is not an error code of CODES")


class ModelError(EllmError):
    """A model file or directory cannot be used: missing, unsupported, corrupt or inconsistent."""


class CapacityError(EllmError):
    """What does not fit, and the caller can fix: a prompt or text over the room a session has
    left in the sequence length, a KV cache over the memory available."""

    code = "capacity"


class BadRequest(EllmError):
    """A request's arguments (or an imported session) are not what the protocol allows; nothing changed."""

    code = "bad_request"


class InvariantError(Exception):
    """A broken invariant of the daemon's own (a bug, never the request's): answered `internal`,
    logged with its traceback; the request fails alone and the daemon goes on."""
