"""The HTTP server, served beside the Unix socket by `ellmd start --http`: its route table, its
middlewares (errors in each API's shape, then the guard), and its listening site.

`GET /health`, `GET /metrics` (Prometheus text, see ellmd.server.metrics, for an admin key) are the
site's own; the APIs' routes come from openai, responses and anthropic. Bodies are JSON with a
JSON content type. Limits: connections (see connections), body size, read timeout, and the engine
queue (see bridge).
"""

from __future__ import annotations

import logging

from aiohttp import web

from ellmd.errors import EllmError
from ellmd.server.http import anthropic, console, openai, responses
from ellmd.server.http.bridge import Bridge
from ellmd.server.http.connections import CountedSite
from ellmd.server.http.errors import ApiError
from ellmd.server.http.guard import Guard
from ellmd.server.limits import Admission, Limits
from ellmd.server.metrics import Metrics
from ellmd.text import TemplateError

log = logging.getLogger("ellmd.http")

# path prefix -> the shape of its error bodies; elsewhere OpenAI's (ApiError.body)
ERROR_SHAPES = (("/v1/messages", anthropic.error_body),)


@web.middleware
async def api_errors(request: web.Request, handler):
    """Every failure as an error body in its API's shape; user errors never log a traceback."""
    try:
        return await handler(request)
    except ApiError as e:
        error = e
    except TemplateError as e:  # the template refused the conversation (say, roles out of order)
        error = ApiError(400, str(e))
    except web.HTTPException as e:  # no such route, wrong method, body too large
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        error = ApiError(e.status, f"{request.method} {request.path}: {e.reason}", kind)
    except Exception as e:
        log.exception("%s %s failed", request.method, request.path)
        error = ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")
    shape = next((shape for prefix, shape in ERROR_SHAPES if request.path.startswith(prefix)), None)
    return error.response(shape)


class HttpServer:
    """The HTTP APIs of a Runtime, on host:port."""

    def __init__(self, runtime, host: str, port: int, limits: Limits = Limits(), admission: Admission | None = None,
                 api_keys=()):
        self.host, self.port, self.limits = host, port, limits
        self.bridge = Bridge(runtime, limits, admission or Admission(runtime, limits.max_queue))
        self.metrics = Metrics(runtime)
        self.site: CountedSite | None = None
        self.keyed = bool(api_keys)
        self.api_keys = list(api_keys)
        guard = Guard(host, self.api_keys, on_key=self.authenticated)
        guard.public |= console.PUBLIC_PATHS
        app = web.Application(middlewares=[api_errors, guard.check], client_max_size=limits.http_max_body)
        app.add_routes(self.routes())
        # A client that disconnects cancels its handler, which cancels its generation.
        # keepalive_timeout also closes a connection that never completes its request headers.
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=10,
                                    keepalive_timeout=limits.http_read_timeout_s)

    def routes(self) -> list[web.RouteDef]:
        """The route table: every endpoint the server answers is registered here."""
        chat = openai.OpenAiApi(self.bridge)
        replies = responses.ResponsesApi(self.bridge)
        messages = anthropic.MessagesApi(self.bridge)
        return [
            web.get("/health", self.health),
            web.get("/metrics", self.metrics_text),
            web.get("/v1/models", chat.models),
            web.post("/v1/chat/completions", chat.chat_completions),
            web.post("/v1/completions", chat.completions),
            web.post("/v1/responses", replies.create),
            web.get("/v1/responses/{response_id}", replies.retrieve),
            web.delete("/v1/responses/{response_id}", replies.delete),
            web.post("/v1/messages", messages.messages),
            web.post("/v1/messages/count_tokens", messages.count_tokens),
            *console.routes(self.bridge, self.api_keys),
        ]

    async def start(self) -> None:
        await self.runner.setup()
        try:
            self.site = CountedSite(self.runner, self.host, self.port, self.limits, self.keyed)
            await self.site.start()
        except OSError as e:
            await self.runner.cleanup()
            raise EllmError(f"--http {self.host}:{self.port}: {e.strerror or e}") from None

    def authenticated(self, request: web.Request, key) -> None:
        """A request came with a valid key: its connection counts against that key (CountedSite)."""
        if self.site is not None and request.transport is not None:
            self.site.authenticated(request.transport, key.name)

    async def close(self) -> None:
        """Stop listening; requests in flight finish (the runtime ends their generations on shutdown)."""
        self.bridge.closing = True
        await self.runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics_text(self, request: web.Request) -> web.Response:
        if "owner" in request:  # the counters of every tenant: for the operator
            raise ApiError(403, "/metrics needs an admin key (NAME KEY admin in api_key_file)", "permission_error")
        stats = await self.bridge.call("stats", {})
        return web.Response(body=self.metrics.render(stats), headers={"Content-Type": self.metrics.content_type})
