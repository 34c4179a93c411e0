"""Errors that reach users as one clear line (no traceback).

Each class carries the PROTOCOL.md error code a request that raised it is answered with.
"""


class EllmError(Exception):
    """Base class: the message is meant for the user as is."""

    code = "internal"


class ModelError(EllmError):
    """A model file or directory cannot be used: missing, unsupported, corrupt or inconsistent."""


class CapacityError(EllmError):
    """A request does not fit: sequence length, slots, or memory."""

    code = "capacity"


class BadRequest(EllmError):
    """A request's arguments (or an imported session) are not what the protocol allows; nothing changed."""

    code = "bad_request"
