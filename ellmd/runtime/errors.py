"""The runtime's errors and the one table from exceptions to PROTOCOL.md's error codes."""

from __future__ import annotations

from ellmd.errors import BadRequest, CapacityError, EllmError, ModelError
from ellmd.runtime.context.retrieval import RetrievalError
from ellmd.runtime.context.skills import SkillError
from ellmd.runtime.store.lmdb import StoreError
from ellmd.text import TemplateError


class RuntimeError_(EllmError):
    """An error with a protocol error code (PROTOCOL.md)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class SlotsBusy(Exception):
    """Every slot holds a busy session: the request waits for one to finish."""


# Exception class -> PROTOCOL.md code; None: the exception carries its own `code` (the class'
# default shown in the comment). Looked up along the exception's MRO; anything else is `internal`.
ERROR_CODES: dict[type, str | None] = {
    RuntimeError_: None,  # any code, set where it is raised
    BadRequest: "bad_request",
    TemplateError: "bad_request",  # a message the chat template cannot render
    CapacityError: "capacity",
    StoreError: "store",
    RetrievalError: None,  # not_found (an unknown index or retriever) or bad_request
    SkillError: None,  # not_found (an unknown skill or file) or bad_request
    ModelError: "internal",  # the model is the daemon's, never the request's
    EllmError: None,  # internal, unless a subclass says otherwise; the message is the user's as is
}


def protocol_error(e: Exception) -> RuntimeError_:
    """The error a request that raised `e` is answered with (see ERROR_CODES)."""
    if isinstance(e, RuntimeError_):
        return e
    for cls in type(e).__mro__:
        if cls in ERROR_CODES:
            code = ERROR_CODES[cls] or e.code
            return RuntimeError_(code, str(e))
    return RuntimeError_("internal", f"{type(e).__name__}: {e}")


def not_found(session_id) -> RuntimeError_:
    return RuntimeError_("not_found", f"no session {session_id!r}")


def busy(session_id) -> RuntimeError_:
    return RuntimeError_("busy", f"session {session_id} is busy with another request (generating or prefilling)")


def cancelled(why: str) -> RuntimeError_:
    return RuntimeError_("cancelled", why)
