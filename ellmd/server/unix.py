"""The Unix-socket server: PROTOCOL.md framing and rpc over asyncio, in front of the Runtime.

It frames and dispatches; the ops are declared in ellmd.runtime.ops. Those that run on the
connection (hello, cancel, shutdown) get it as their link; the others go to the Runtime through
Runtime.submit (handlers here never touch arrays), and their token events come back through the
event loop in the order the engine thread emitted them. An op's argument that may come in pieces
(Op.upload) is collected here, and a result's field that goes back in pieces (Op.download) is
streamed from here.

Only the daemon's user can connect: the socket's directory must be private (0700, owned by the
user), the socket is created 0600, and SO_PEERCRED turns away any other uid. Every resource a
client could grow is bounded by ellmd.server.limits.Limits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import struct
from pathlib import Path

import msgpack

from ellmd import __version__
from ellmd.errors import EllmError
from ellmd.runtime.errors import ProtocolError, protocol_error
from ellmd.runtime.ops import OPS, Op
from ellmd.runtime.ops.base import UPLOAD_FIELDS
from ellmd.server.limits import Admission, Limits, QueueFull

log = logging.getLogger("ellmd.server")

MAX_FRAME = 16 * 1024 * 1024
READ_SIZE = 1 << 16
# A refused connection is answered once its hello has arrived (or after this long): hung up on
# first, a client still sending its hello gets a broken pipe instead of the reason.
REFUSAL_WAIT_S = 2.0
# What a stream that is not msgpack maps raises while it is unpacked (TypeError: a map or an array
# used as a map key).
UNPACK_ERRORS = (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError)


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


def prepare_socket_dir(directory: Path) -> None:
    """Create the socket's directory (mode 0700), or check that an existing one is the user's own
    and private: another user who made it first could otherwise replace the socket."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, mode=0o700)
    except FileExistsError:
        pass
    info = os.stat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise EllmError(f"the socket directory {directory} is not a directory")
    if info.st_uid != os.getuid():
        raise EllmError(f"the socket directory {directory} belongs to uid {info.st_uid}, not to you "
                        f"(uid {os.getuid()}): choose another --socket, or remove it")
    if info.st_mode & 0o077:
        raise EllmError(f"the socket directory {directory} has mode {stat.S_IMODE(info.st_mode):04o}: other users "
                        f"can reach it; make it private (chmod 700 {directory}) or choose another --socket")


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED: pid, uid, gid)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class UnixServer:
    def __init__(self, runtime, path: Path, on_shutdown, info: dict, limits: Limits = Limits(),
                 admission: Admission | None = None):
        self.runtime = runtime
        self.path = Path(path)
        self.on_shutdown = on_shutdown
        self.info = info
        self.limits = limits
        self.admission = admission or Admission(runtime, limits.max_queue)
        self.server: asyncio.AbstractServer | None = None
        self.connections: set[Connection] = set()
        self.uid = os.getuid()  # the only uid served
        self.stopping = False

    @property
    def clients(self) -> int:
        return len(self.connections)

    async def start(self) -> None:
        prepare_socket_dir(self.path.parent)
        if self.path.exists():
            if socket_in_use(self.path):
                raise DaemonRunning(f"another ellmd is already serving on {self.path} (stop it with: ellmd stop)")
            log.info("removing stale socket %s", self.path)
            self.path.unlink()
        # The socket is 0600 from its creation (a chmod after bind leaves a window open to others).
        # umask is process-wide: the other threads create no files while the servers start.
        umask = os.umask(0o177)
        try:
            self.server = await asyncio.start_unix_server(self.serve, path=str(self.path), limit=MAX_FRAME)
        finally:
            os.umask(umask)

    def stop_accepting(self) -> None:
        """The daemon stops: no new connection, and new requests are answered `cancelled` at once
        (the runtime answers those it has, so every request gets a reply)."""
        self.stopping = True
        if self.server is not None:
            self.server.close()

    async def close(self, grace_s: float = 2.0) -> None:
        """Stop listening; send the replies still due, then close every connection, idle ones too.

        Python 3.12's wait_closed waits for every connection to end, so connections are closed here
        rather than waited for, and one whose client does not read is aborted after `grace_s`.
        """
        if self.server is None:
            return
        self.stop_accepting()
        deadline = asyncio.get_running_loop().time() + grace_s
        while any(c.in_flight for c in self.connections) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)  # the runtime answered them all: their replies are being sent
        for connection in list(self.connections):
            connection.writer.close()
        try:
            await asyncio.wait_for(self.server.wait_closed(), grace_s)
        except TimeoutError:
            for connection in list(self.connections):
                connection.writer.transport.abort()
            await asyncio.wait_for(self.server.wait_closed(), grace_s)
        if self.path.exists():
            self.path.unlink()

    def refusal(self, writer: asyncio.StreamWriter) -> tuple[str, str] | None:
        """(code, reason) when a new connection is not served, else None."""
        sock = writer.get_extra_info("socket")
        uid = peer_uid(sock) if sock is not None else self.uid
        if uid != self.uid:
            return "bad_request", f"this daemon serves uid {self.uid} only, not uid {uid}"
        if len(self.connections) >= self.limits.max_connections:
            return "busy", f"the daemon already serves {len(self.connections)} connections (max_connections); retry later"
        return None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: read frames, dispatch requests, cancel what is in flight when it goes."""
        connection = Connection(self, reader, writer)
        refused = self.refusal(writer)
        if refused:
            log.warning("connection refused: %s", refused[1])
            try:
                await asyncio.wait_for(reader.read(READ_SIZE), REFUSAL_WAIT_S)
            except (asyncio.TimeoutError, OSError):
                pass
            connection.send_error(None, *refused)
            await connection.close()
            return
        self.connections.add(connection)
        try:
            await connection.run()
        finally:
            self.connections.discard(connection)


class BadFrame(Exception):
    pass


class Closing(Exception):
    """The connection ends: its reason was sent as an error reply (and logged)."""


class Connection:
    """One client connection: its frames, its requests in flight and its uploads."""

    def __init__(self, server: UnixServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.server, self.limits = server, server.limits
        self.reader, self.writer = reader, writer
        self.greeted = False
        self.in_flight: dict = {}  # request id -> Request
        self.uploads: dict[str, bytearray] = {}
        self.loop = asyncio.get_running_loop()
        self.opened = self.loop.time()

    # ---- frames -----------------------------------------------------------------------------

    async def run(self) -> None:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_FRAME, strict_map_key=False)
        fed = boundary = 0  # bytes fed; the end of the last whole message
        partial_since = None  # when the frame not complete yet began
        try:
            while True:
                data = await self.read(partial_since)
                if not data:
                    break
                unpacker.feed(data)
                fed += len(data)
                for message in unpacker:
                    boundary = unpacker.tell()  # (a half-parsed frame moves tell() on: read it here)
                    partial_since = None
                    self.receive_one(message)
                if fed > boundary and partial_since is None:
                    partial_since = self.loop.time()
                await self.writer.drain()  # a client that does not read stops being read
        except msgpack.BufferFull:
            self.goodbye("bad_frame", f"frame larger than {MAX_FRAME} bytes")
        except BadFrame as e:
            self.goodbye("bad_frame", str(e))
        except UNPACK_ERRORS as e:
            self.goodbye("bad_frame", f"not a msgpack stream: {e}")
        except Closing:
            pass
        except (ConnectionResetError, BrokenPipeError):
            pass
        finally:
            self.cancel_all()
            await self.close()

    async def read(self, partial_since: float | None) -> bytes:
        """The next bytes, within the hello timeout before hello and the frame timeout mid-frame."""
        if not self.greeted:
            deadline, reason = self.opened + self.limits.hello_timeout_s, "no hello within %g s (hello_timeout_s)"
            limit = self.limits.hello_timeout_s
        elif partial_since is not None:
            deadline, reason = partial_since + self.limits.frame_timeout_s, "a frame left unfinished for %g s (frame_timeout_s)"
            limit = self.limits.frame_timeout_s
        else:
            return await self.reader.read(READ_SIZE)  # an idle connection may stay for hours
        try:
            return await asyncio.wait_for(self.reader.read(READ_SIZE), max(0.0, deadline - self.loop.time()))
        except TimeoutError:
            self.goodbye("bad_frame" if self.greeted else "bad_request", reason % limit)
            raise Closing(reason % limit) from None

    def goodbye(self, code: str, reason: str) -> None:
        """Say why the connection is about to be closed (and log it)."""
        log.info("closing a connection: %s", reason)
        self.send_error(None, code, reason)

    async def close(self) -> None:
        try:
            await self.writer.drain()
            self.writer.close()
        except (ConnectionResetError, BrokenPipeError):
            pass

    def send(self, message: dict) -> None:
        if self.writer.is_closing():
            return
        self.writer.write(msgpack.packb(message, use_bin_type=True))
        waiting = self.writer.transport.get_write_buffer_size()
        if waiting > self.limits.max_write_buffer:
            log.warning("dropping a connection that does not read: %d bytes wait for it (max_write_buffer_mb)",
                        waiting)
            self.cancel_all()
            self.writer.transport.abort()

    def send_error(self, request_id, code: str, message: str) -> None:
        self.send({"id": request_id, "ok": False, "error": {"code": code, "message": message}})

    # ---- requests ---------------------------------------------------------------------------

    def receive_one(self, message) -> None:
        """One message; a bug in handling it is an `internal` reply, not a lost connection."""
        try:
            self.receive(message)
        except (BadFrame, Closing):
            raise
        except Exception as e:
            request_id = message.get("id") if isinstance(message.get("id"), int) else None
            log.exception("request %r failed", request_id)
            self.send_error(request_id, "internal", f"{type(e).__name__}: {e}")

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
        declared = OPS.get(op)
        if not self.greeted and op != "hello":
            self.send_error(request_id, "bad_request", "the first request must be hello")
        elif request_id in self.in_flight:
            self.send_error(request_id, "bad_request", f"id {request_id} is already in flight")
        elif declared is not None and declared.runs == "connection":
            self.run_here(request_id, declared, args)
        elif declared is not None and declared.upload and any(field in args for field in UPLOAD_FIELDS):
            self.upload(request_id, declared, args)
        else:
            self.start(request_id, op, args)

    def run_here(self, request_id, declared: Op, args) -> None:
        """An op that runs on the connection (hello, cancel, shutdown), its reply sent at once."""
        try:
            # (no token ids among these ops' arguments: no vocabulary to check them against)
            result = declared.handler(self, **declared.arguments(args, vocab_size=0))
        except EllmError as e:
            error = protocol_error(e)
            self.send_error(request_id, error.code, str(error))
            return
        self.send({"id": request_id, "ok": True, "result": result})

    # ---- what the ops run on the connection use (ellmd.runtime.ops.admin.Link) ----

    def identity(self) -> dict:
        return {"server": f"ellmd/{__version__}", "max_frame": MAX_FRAME, **self.server.info}

    def stop_daemon(self) -> None:
        self.loop.call_soon(self.server.on_shutdown)  # after the reply being sent now

    # ---- pieces ----

    def upload(self, request_id, declared: Op, args) -> None:
        """Collect the pieces of an upload (session.import's data); the last piece runs the op
        with the whole of it."""
        data, upload = args.get(declared.upload), args.get("upload")
        if not isinstance(data, bytes) or not isinstance(upload, (str, type(None))):
            self.send_error(request_id, "bad_request", f"{declared.upload} must be binary, upload a string")
            return
        if upload is None:
            upload = f"u{request_id}"
            self.uploads[upload] = bytearray()
        elif upload not in self.uploads:
            self.send_error(request_id, "not_found", f"no upload {upload!r} on this connection")
            return
        total = sum(map(len, self.uploads.values())) + len(data)
        if total > self.limits.max_upload_bytes:
            del self.uploads[upload]
            self.send_error(request_id, "bad_request", f"{declared.name}: the upload is over "
                            f"{self.limits.max_upload_bytes} bytes (max_upload_mb); it was dropped")
            return
        self.uploads[upload] += data
        if args.get("more"):
            self.send({"id": request_id, "ok": True, "result": {"upload": upload, "received": len(self.uploads[upload])}})
            return
        blob = bytes(self.uploads.pop(upload))
        self.start(request_id, declared.name, {declared.upload: blob})

    def start(self, request_id: int, op: str, args: dict) -> None:
        """Submit a request to the runtime, within the connection's and the engine queue's limits."""
        if self.server.stopping:
            self.send_error(request_id, "cancelled", "the daemon is shutting down")
            return
        if len(self.in_flight) >= self.limits.max_in_flight:
            self.send_error(request_id, "busy", f"{len(self.in_flight)} requests are in flight on this "
                            "connection (max_in_flight); wait for a reply first")
            return

        def emit(event, data):  # called on the engine thread
            self.loop.call_soon_threadsafe(self.send, {"id": request_id, "event": event, "data": data})

        try:
            request = self.server.admission.submit(op, args, emit)
        except QueueFull as e:
            self.send_error(request_id, "busy", str(e))
            return
        self.in_flight[request_id] = request
        self.loop.create_task(self.finish(request_id, op, request))

    async def finish(self, request_id: int, op: str, request) -> None:
        """Send the reply of a request once the runtime has answered it."""
        try:
            result = await asyncio.wrap_future(request.future)
            download = OPS[op].download if op in OPS else None
            if download:
                result = await self.send_blob(request_id, result, download)
            finish = OPS[op].finish if op in OPS else None
            if finish:  # e.g. decoding a long session's turn texts: neither on the engine thread nor on this loop
                result = await asyncio.to_thread(finish, result, self.server.runtime.engine.tokenizer)
            self.send({"id": request_id, "ok": True, "result": result})
        except ProtocolError as e:
            self.send_error(request_id, e.code, str(e))
        except asyncio.CancelledError:
            if not request.future.cancelled():
                raise  # this task itself is cancelled
            self.send_error(request_id, "cancelled", "the daemon is shutting down")
        except (ConnectionResetError, BrokenPipeError, Closing):
            pass
        except Exception as e:  # a result that cannot be sent: a bug, reported to the client
            log.exception("replying to request %d (%s) failed", request_id, op)
            self.send_error(request_id, "internal", f"{op}: {type(e).__name__}: {e}")
        finally:
            self.in_flight.pop(request_id, None)
        try:
            await self.writer.drain()
        except (ConnectionResetError, BrokenPipeError):
            pass

    async def send_blob(self, request_id, result: dict, field: str) -> dict:
        """Stream a result's field (an exported session) as chunk events, each well under max_frame,
        at the client's pace: the next piece is written once the previous one has been read."""
        blob, piece = result.pop(field), MAX_FRAME // 2
        for start in range(0, len(blob), piece):
            self.send({"id": request_id, "event": "chunk", "data": {"data": blob[start:start + piece]}})
            try:
                await asyncio.wait_for(self.writer.drain(), self.limits.write_timeout_s)
            except TimeoutError:
                log.warning("dropping a connection that stopped reading its export (write_timeout_s)")
                self.cancel_all()
                self.writer.transport.abort()
                raise Closing("export not read") from None
        return {**result, "bytes": len(blob)}

    def cancel_all(self) -> None:
        """The client went away: its generations stop at the next token."""
        for request in self.in_flight.values():
            request.cancelled.set()
