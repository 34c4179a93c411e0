"""Errors that reach users as one clear line (no traceback)."""


class EllmError(Exception):
    """Base class: the message is meant for the user as is."""


class ModelError(EllmError):
    """A model file or directory cannot be used: missing, unsupported, corrupt or inconsistent."""


class CapacityError(EllmError):
    """A request does not fit: sequence length, slots, or memory."""
