"""Error replies: ApiError, in OpenAI's shape unless an API gives its own (anthropic.error_body), and
the HTTP answer of each runtime error code (read from ellmd.errors.CODES)."""

from __future__ import annotations

from aiohttp import web

from ellmd.errors import CODES
from ellmd.runtime.errors import ProtocolError
from ellmd.server.limits import QueueFull

RETRY_AFTER_S = 1  # what a 429 (the engine queue is full) or a 503 (no connection free) asks the client to wait


class ApiError(Exception):
    """An error reply in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None, code=None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code
        self.headers = headers or {}

    @classmethod
    def from_runtime(cls, error: ProtocolError) -> ApiError:
        answer = CODES[error.code]  # the one table of error codes, with their HTTP status
        return cls(answer.status, str(error), answer.type, code=answer.api_code)

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

    def response(self, shape=None) -> web.Response:
        """The reply, its body in OpenAI's shape or in `shape(error)`."""
        body = self.body() if shape is None else shape(self)
        return web.json_response(body, status=self.status, headers=self.headers)


def queue_full(error: QueueFull) -> ApiError:
    return ApiError(429, str(error), "rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(RETRY_AFTER_S)})
