"""Error replies: ApiError, in OpenAI's shape unless an API gives its own (anthropic.error_body), and
the HTTP status of each runtime error code."""

from __future__ import annotations

from aiohttp import web

from ellmd.runtime.errors import RuntimeError_
from ellmd.server.limits import QueueFull

RETRY_AFTER_S = 1  # what a 429 (the engine queue is full) or a 503 (no connection free) asks the client to wait


# runtime error code -> (HTTP status, OpenAI error type, OpenAI error code); others are server errors
RUNTIME_ERRORS = {
    "bad_request": (400, "invalid_request_error", None),
    "capacity": (400, "invalid_request_error", "context_length_exceeded"),
    "not_found": (404, "not_found_error", None),
    "busy": (409, "conflict_error", "session_busy"),
    "leased": (409, "conflict_error", "session_leased"),
    "fingerprint": (409, "conflict_error", "fingerprint_mismatch"),
    "cancelled": (503, "server_error", "cancelled"),
}

class ApiError(Exception):
    """An error reply in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None, code=None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code
        self.headers = headers or {}

    @classmethod
    def from_runtime(cls, error: RuntimeError_) -> ApiError:
        status, kind, code = RUNTIME_ERRORS.get(error.code, (500, "server_error", error.code))
        return cls(status, str(error), kind, code=code)

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

    def response(self, shape=None) -> web.Response:
        """The reply, its body in OpenAI's shape or in `shape(error)`."""
        body = self.body() if shape is None else shape(self)
        return web.json_response(body, status=self.status, headers=self.headers)


def queue_full(error: QueueFull) -> ApiError:
    return ApiError(429, str(error), "rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(RETRY_AFTER_S)})
