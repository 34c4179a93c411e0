"""The web console (`/console`) and the JSON endpoints it reads (`/api/...`), which scripts may use too.

The page is three static files shipped in console_files/ beside this module (plain JS, nothing from another
origin, a strict Content-Security-Policy). It asks for the API key and keeps it in the browser's
sessionStorage only; its data comes from the endpoints below, behind the same key, limits and
Host/Origin checks as the rest of the HTTP API (docs/http-api.md, "Console endpoints"):

    GET    /api/sessions                   the sessions the key reaches (session.list)
    GET    /api/sessions/{id}[?tokens=1]   one session: info, turns with their text (and token ids): session.turns
    POST   /api/sessions/{id}/fork         {title?}: session.fork
    POST   /api/sessions/{id}/rewind       {turn} or {tokens}: session.rewind
    DELETE /api/sessions/{id}              session.delete
    GET    /api/sessions/{id}/export       the session's blob (session.export), as a download
    GET    /api/status                     the `stats` op (an admin key, as /metrics)
    GET    /api/live                       slots, requests and counters now (`live` + `stats`; admin)

The chat of the page is the OpenAI route, /v1/chat/completions, streamed, naming the session.
Every op goes through HttpServer.call, as the OpenAI routes' do.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from ellmd.runtime.session import unscoped_id
from ellmd.runtime.turns import with_text
from ellmd.server.http.errors import ApiError
from ellmd.server.http.fields import INT, STRING, field, read_json

STATIC = Path(__file__).with_name("console_files")
FILES = {"app.js": "text/javascript", "app.css": "text/css"}
PUBLIC_PATHS = frozenset({"/", "/console", *(f"/console/{name}" for name in FILES)})  # no key: the page asks for it
# Nothing but this origin: no inline script or style, no frames, no form posts elsewhere.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}


def routes(bridge, api_keys=()) -> list:
    api = ConsoleApi(bridge, api_keys)
    return [
        web.get("/", api.home), web.get("/console", api.page), web.get("/console/{name}", api.static),
        web.get("/api/sessions", api.sessions), web.get("/api/sessions/{session_id}", api.session),
        web.post("/api/sessions/{session_id}/fork", api.fork), web.post("/api/sessions/{session_id}/rewind", api.rewind),
        web.delete("/api/sessions/{session_id}", api.delete),
        web.get("/api/sessions/{session_id}/export", api.export),
        web.get("/api/status", api.status), web.get("/api/live", api.live),
    ]


class ConsoleApi:
    def __init__(self, server, api_keys):
        self.server = server
        self.key_names = {key.owner: key.name for key in api_keys}  # owner fingerprint -> key name

    # ---- the page ---------------------------------------------------------------------------

    async def home(self, request: web.Request) -> web.Response:
        raise web.HTTPFound("/console")

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(body=(STATIC / "index.html").read_bytes(), content_type="text/html", charset="utf-8",
                            headers=PAGE_HEADERS)

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in FILES:
            raise ApiError(404, f"no console file {name}", "not_found_error")
        return web.Response(body=(STATIC / name).read_bytes(), content_type=FILES[name], charset="utf-8",
                            headers=PAGE_HEADERS)

    # ---- sessions ---------------------------------------------------------------------------

    def args(self, request: web.Request, **more) -> dict:
        """An op's arguments: the session the path names, and the key's owner (its sessions only)."""
        owner = {"owner": request["owner"]} if "owner" in request else {}
        named = {"session_id": request.match_info["session_id"]} if "session_id" in request.match_info else {}
        return {**named, **owner, **more}

    def shown(self, info: dict, request: web.Request) -> dict:
        """A session's info as the console shows it: named as the key knows it, its owner by key name,
        its KV bytes."""
        owner = info.pop("owner", None)
        return {**info, "session_id": unscoped_id(info["session_id"], request.get("owner")),
                "owner": self.key_names.get(owner) if owner else None,
                "kv_bytes": info["tokens"] * self.server.runtime.engine.kv.bytes_per_token}

    async def sessions(self, request: web.Request) -> web.Response:
        result = await self.server.call("session.list", self.args(request))
        return web.json_response({"sessions": [self.shown(info, request) for info in result["sessions"]]})

    async def session(self, request: web.Request) -> web.Response:
        info = await self.server.call("session.info", self.args(request))
        held = await self.server.call("session.turns", self.args(request))
        held = await self.server.in_thread(with_text, held, self.server.tokenizer)
        if request.query.get("tokens") not in ("1", "true"):  # the ids on demand: they double the reply
            for turn in held["turns"]:
                del turn["token_ids"]
        rag = [turn["name"] or "documents" for turn in held["turns"] if turn["kind"] == "rag"]
        return web.json_response({**self.shown(info, request), "turns": held["turns"], "rag": rag,
                                  "messages": held["messages"]})

    async def fork(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        info = await self.server.call("session.fork", self.args(request, **self.present(body, title=STRING)))
        return web.json_response(self.shown(info, request))

    async def rewind(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        point = self.present(body, turn=INT, tokens=INT)
        if len(point) != 1:
            raise ApiError(400, "give exactly one of turn and tokens")
        info = await self.server.call("session.rewind", self.args(request, **point))
        return web.json_response(self.shown(info, request))

    async def delete(self, request: web.Request) -> web.Response:
        return web.json_response(await self.server.call("session.delete", self.args(request)))

    async def export(self, request: web.Request) -> web.Response:
        result = await self.server.call("session.export", self.args(request))
        name = request.match_info["session_id"]
        return web.Response(body=result["blob"], content_type="application/octet-stream", headers={
            "Content-Disposition": f'attachment; filename="{name}.ellm"', "X-Session-Tokens": str(result["tokens"])})

    async def body(self, request: web.Request) -> dict:
        """The JSON body, or {} when there is none."""
        if not request.can_read_body:
            return {}
        return await read_json(request, self.server.read_timeout)

    @staticmethod
    def present(body: dict, **kinds) -> dict:
        """The fields of `body` given (not null), each checked against its JSON type."""
        return {name: field(body, name, kind) for name, kind in kinds.items() if body.get(name) is not None}

    # ---- the daemon -------------------------------------------------------------------------

    def admin(self, request: web.Request) -> None:
        if "owner" in request:  # every tenant's load: for the operator, as /metrics
            raise ApiError(403, f"{request.path} needs an admin key (NAME KEY admin in api_key_file)",
                           "permission_error")

    async def status(self, request: web.Request) -> web.Response:
        self.admin(request)
        return web.json_response(await self.server.call("stats", {}))

    async def live(self, request: web.Request) -> web.Response:
        self.admin(request)
        live = await self.server.call("live", {})
        stats = live.pop("stats")
        admission = self.server.admission
        return web.json_response({
            **live, "in_flight": admission.outstanding, "max_queue": admission.max_queue,
            "counters": stats["counters"], "kv_bytes": stats["kv_bytes"], "kv_bytes_used": stats["kv_bytes_used"],
            "sessions_resident": stats["sessions_resident"], "sessions_stored": stats["sessions_stored"],
            "store": stats["store"], "uptime_s": stats["uptime_s"]})
