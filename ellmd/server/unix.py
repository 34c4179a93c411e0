"""The Unix-socket server: PROTOCOL.md framing and rpc over asyncio, in front of the Runtime.

Handlers never touch arrays: each request goes to the engine thread through Runtime.submit;
token events come back through the event loop in the order the engine thread emitted them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path

import msgpack

from ellmd import __version__
from ellmd.runtime.runtime import RuntimeError_

log = logging.getLogger("ellmd.server")

PROTOCOL_VERSION = 1
MAX_FRAME = 16 * 1024 * 1024


class DaemonRunning(Exception):
    """Another daemon already answers on the socket."""


def socket_in_use(path: Path) -> bool:
    """True when something accepts connections at path (a live daemon, not a stale file)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except (ConnectionRefusedError, FileNotFoundError, OSError):
        return False
    finally:
        probe.close()


class UnixServer:
    def __init__(self, runtime, path: Path, on_shutdown, info: dict):
        self.runtime = runtime
        self.path = Path(path)
        self.on_shutdown = on_shutdown
        self.info = info
        self.server: asyncio.AbstractServer | None = None
        self.clients = 0

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.path.exists():
            if socket_in_use(self.path):
                raise DaemonRunning(f"another ellmd is already serving on {self.path} (stop it with: ellmd stop)")
            log.info("removing stale socket %s", self.path)
            self.path.unlink()
        self.server = await asyncio.start_unix_server(self.serve, path=str(self.path), limit=MAX_FRAME)
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        if self.path.exists():
            self.path.unlink()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: read frames, dispatch requests, cancel what is in flight when it goes."""
        self.clients += 1
        connection = Connection(self, writer)
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_FRAME, strict_map_key=False)
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                try:
                    unpacker.feed(data)
                    for message in unpacker:
                        connection.receive(message)
                except msgpack.BufferFull:
                    connection.send_error(None, "bad_frame", f"frame larger than {MAX_FRAME} bytes")
                    break
                except BadFrame as e:
                    connection.send_error(None, "bad_frame", str(e))
                    break
                except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as e:
                    connection.send_error(None, "bad_frame", f"not a msgpack stream: {e}")
                    break
                await writer.drain()
        except (ConnectionResetError, BrokenPipeError):
            pass
        finally:
            connection.cancel_all()
            self.clients -= 1
            try:
                await writer.drain()
                writer.close()
            except (ConnectionResetError, BrokenPipeError):
                pass


class BadFrame(Exception):
    pass


class Connection:
    """Request bookkeeping of one client connection."""

    def __init__(self, server: UnixServer, writer: asyncio.StreamWriter):
        self.server = server
        self.writer = writer
        self.greeted = False
        self.in_flight: dict = {}
        self.uploads: dict[str, bytearray] = {}
        self.loop = asyncio.get_running_loop()

    def send(self, message: dict) -> None:
        if not self.writer.is_closing():
            self.writer.write(msgpack.packb(message, use_bin_type=True))

    def send_error(self, request_id, code: str, message: str) -> None:
        self.send({"id": request_id, "ok": False, "error": {"code": code, "message": message}})

    def receive(self, message) -> None:
        if not isinstance(message, dict):
            raise BadFrame(f"a message must be a map, not {type(message).__name__}")
        request_id, op, args = message.get("id"), message.get("op"), message.get("args", {})
        if not isinstance(request_id, int) or isinstance(request_id, bool):
            self.send_error(None, "bad_request", "id must be an integer")
            return
        if not isinstance(op, str) or not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
            self.send_error(request_id, "bad_request", "a request needs op (string) and args (map with string keys)")
            return
        if op == "hello":
            self.hello(request_id, args)
        elif not self.greeted:
            self.send_error(request_id, "bad_request", "the first request must be hello")
        elif request_id in self.in_flight:
            self.send_error(request_id, "bad_request", f"id {request_id} is already in flight")
        elif op == "shutdown":
            self.send({"id": request_id, "ok": True, "result": {}})
            self.loop.call_soon(self.server.on_shutdown)
        elif op == "cancel":
            self.cancel(request_id, args.get("request_id"))
        elif op == "session.import" and ("more" in args or "upload" in args):
            self.upload(request_id, args)
        else:
            self.in_flight[request_id] = None
            self.loop.create_task(self.dispatch(request_id, op, args))

    def hello(self, request_id, args) -> None:
        version = args.get("protocol")
        if version != PROTOCOL_VERSION:
            self.send_error(request_id, "protocol_version",
                            f"this daemon speaks protocol {PROTOCOL_VERSION}, the client {version!r}")
            return
        self.greeted = True
        self.send({"id": request_id, "ok": True, "result": {
            "protocol": PROTOCOL_VERSION, "server": f"ellmd/{__version__}", "max_frame": MAX_FRAME, **self.server.info}})

    def cancel(self, request_id, target) -> None:
        request = self.in_flight.get(target) if isinstance(target, int) else None
        if request is not None:
            request.cancelled.set()
        self.send({"id": request_id, "ok": True, "result": {"cancelled": request is not None}})

    def upload(self, request_id, args) -> None:
        """Collect the pieces of a session.import; the last piece imports the whole blob."""
        data, upload = args.get("data"), args.get("upload")
        if not isinstance(data, bytes) or not isinstance(upload, (str, type(None))):
            self.send_error(request_id, "bad_request", "data must be binary, upload a string")
            return
        if upload is None:
            upload = f"u{request_id}"
            self.uploads[upload] = bytearray()
        elif upload not in self.uploads:
            self.send_error(request_id, "not_found", f"no upload {upload!r} on this connection")
            return
        self.uploads[upload] += data
        if args.get("more"):
            self.send({"id": request_id, "ok": True, "result": {"upload": upload, "received": len(self.uploads[upload])}})
            return
        blob = bytes(self.uploads.pop(upload))
        self.in_flight[request_id] = None
        self.loop.create_task(self.dispatch(request_id, "session.import", {"data": blob}))

    async def dispatch(self, request_id: int, op: str, args: dict) -> None:
        def emit(event, data):  # called on the engine thread
            self.loop.call_soon_threadsafe(self.send, {"id": request_id, "event": event, "data": data})

        request = self.server.runtime.submit(op, args, emit)
        self.in_flight[request_id] = request
        try:
            result = await asyncio.wrap_future(request.future)
            if op == "session.export":
                result = self.send_blob(request_id, result)
            self.send({"id": request_id, "ok": True, "result": result})
        except RuntimeError_ as e:
            self.send_error(request_id, e.code, str(e))
        finally:
            self.in_flight.pop(request_id, None)
        try:
            await self.writer.drain()
        except (ConnectionResetError, BrokenPipeError):
            pass

    def send_blob(self, request_id, result: dict) -> dict:
        """Stream an exported session as chunk events, each well under max_frame."""
        blob, piece = result.pop("blob"), MAX_FRAME // 2
        for start in range(0, len(blob), piece):
            self.send({"id": request_id, "event": "chunk", "data": {"data": blob[start:start + piece]}})
        return {**result, "bytes": len(blob)}

    def cancel_all(self) -> None:
        """The client went away: its generations stop at the next token."""
        for request in self.in_flight.values():
            if request is not None:
                request.cancelled.set()
