"""Who may reach the API: where it listens, the Host and Origin headers, API keys.

With API keys set (`--api-key`, ELLMD_API_KEY, `api_key_file`) every endpoint but /health wants
`Authorization: Bearer <key>`, and a session is reachable only with the key that created it or was
granted it (the runtime is given a fingerprint of the key as the session's owner, see
bridge.known_as); an admin key reaches every session, as the Unix socket does, and alone reads
/metrics. Listening beyond loopback needs a key. On a loopback address the Host header must name
this machine and an Origin, if any, too, so that a web page (DNS rebinding, a cross-site form)
cannot drive the API.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from urllib.parse import urlsplit

from aiohttp import web

from ellmd.errors import EllmError
from ellmd.server.http.errors import ApiError

DEFAULT_HOST = "127.0.0.1"
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_keys: list) -> None:
    """Refuse to listen beyond this machine without an API key."""
    if not is_loopback(host) and not api_keys:
        raise EllmError(f"--http {host}: listening beyond loopback needs an API key "
                        "(--api-key, ELLMD_API_KEY or api_key_file)")


def host_name(value: str) -> str:
    """The host of a Host header ("name:port", "[::1]:port")."""
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def listen_address(value: str) -> tuple[str, int]:
    """(host, port) from "HOST:PORT", ":PORT" or "PORT" (host 127.0.0.1), checked to be free to listen on."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or DEFAULT_HOST
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise EllmError(f"--http {value!r}: expected HOST:PORT, :PORT or PORT, with a port from 1 to 65535")
    try:  # fail before loading the model, not after
        family, _, _, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp listens
            probe.bind(address)
    except OSError as e:
        raise EllmError(f"--http {host}:{port}: {e.strerror or e}") from None
    return host, int(port)


class Guard:
    """The checks every request passes before its handler: Host and Origin on a loopback address
    (a web page must not reach the API), and the API key when keys are set. A key's requests carry
    its owner (`request["owner"]`: they reach its sessions only); an admin key's carry none (they
    reach every session, as the Unix socket does) and set `request["admin"]`."""

    def __init__(self, host: str, api_keys: list, on_key=None):
        self.local = is_loopback(host)
        self.names = LOCAL_NAMES | {host}
        self.keys = [(key.secret.encode(), key) for key in api_keys]
        self.on_key = on_key  # on_key(request, key): the connection's request authenticated (CountedSite)
        self.public = {"/health"}  # paths served without a key

    @web.middleware
    async def check(self, request: web.Request, handler):
        if self.local:
            if host_name(request.headers.get("Host", "")) not in self.names:
                raise ApiError(403, "the Host header must name this machine (localhost, 127.0.0.1 or [::1])")
            origin = request.headers.get("Origin")
            if origin is not None and urlsplit(origin).hostname not in self.names:
                raise ApiError(403, f"requests from the web page at {origin} are refused")
        if self.keys and request.path not in self.public:
            key = self.key(request.headers.get("Authorization", ""), request.headers.get("x-api-key"))
            if self.on_key is not None:
                self.on_key(request, key)
            if key.admin:
                request["admin"] = True
            else:
                request["owner"] = key.owner
        return await handler(request)

    def key(self, authorization: str, api_key: str | None = None):
        """The key sent as `Authorization: Bearer KEY`, or as `x-api-key: KEY` (Anthropic's clients)."""
        scheme, _, key = authorization.partition(" ")
        given = key.strip().encode() if scheme.lower() == "bearer" else (api_key or "").strip().encode()
        for known, api_key in self.keys:
            if given and hmac.compare_digest(given, known):
                return api_key
        raise ApiError(401, "a valid API key is needed: Authorization: Bearer <key>", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
