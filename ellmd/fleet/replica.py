"""A fleet replica: one `ellmd start` process (the same daemon as a lone ellmd) behind a Ray Serve
deployment that forwards HTTP requests to it.

Serve's model multiplexing does the session affinity: the multiplexed id of a request is its
session id (or, for a conversation without one, a hash of its leading messages: see routing.py).
Serve routes an id to the replica that holds it and keeps an LRU of ids per replica; `Held` is what
the replica holds for an id, and its `__del__` (called by Serve when the LRU drops the id) has the
daemon snapshot the id's sessions and release their leases in the store, so that any replica may
take them next.

The daemon runs in a child process rather than inside the Serve actor: it keeps its own main thread
for the engine loop (numba's OpenMP pool wants the thread that warmed it up), and a child that dies
with its replica (PR_SET_PDEATHSIG) leaves its sessions' leases to a dead pid, which another replica
on the host takes over at once.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp

from ellmd.errors import EllmError
from ellmd.fleet.metrics import PUBLISH_S
from ellmd.fleet.routing import PREFIX_KEY

log = logging.getLogger("ellmd.fleet")

READY_TIMEOUT_S = 600  # a cold numba cache compiles the kernels first (minutes on 2 cores)
STOP_TIMEOUT_S = 60  # a graceful stop snapshots every resident session
HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"})
REPLICA_HEADER = "X-Ellm-Replica"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In the child before exec: SIGTERM when the replica's process dies, however it dies."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def replica_processes(name: str) -> list[int]:
    """The pids of a live replica on this host: the Ray worker and its daemon (whose command line
    has `--replica NAME`); [] if none. For operators and tests that stop one by hand."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"--replica" in argv and argv[argv.index(b"--replica") + 1].decode() == name:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                return [parent, int(entry.name)]
        except (OSError, IndexError, ValueError):
            continue
    return []


class DaemonProcess:
    """An `ellmd start` child serving a private Unix socket and HTTP on a loopback port."""

    def __init__(self, args: list[str], name: str):
        self.workdir = Path(tempfile.mkdtemp(prefix=f"ellm-replica-{name}-"))
        self.socket = self.workdir / "ellmd.sock"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.workdir / "ellmd.log"
        command = [sys.executable, "-m", "ellmd.cli", "start", "--socket", str(self.socket),
                   "--http", f"127.0.0.1:{self.port}", *args]
        with open(self.log_path, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            preexec_fn=die_with_parent)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Block until the daemon answers /health; its log's tail in the error if it exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EllmError(f"the replica's daemon exited ({self.process.returncode}): {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise EllmError(f"the replica's daemon was not ready after {timeout:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """Graceful stop (every session snapshotted, leases released), then a kill if it hangs."""
        if self.alive:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Held:
    """What a replica holds for one multiplexed id: the daemon sessions it names."""

    def __init__(self, key: str, release):
        self.key = key
        self.session_ids: set[str] = set() if key.startswith(PREFIX_KEY) else {key}
        self._release = release

    async def __del__(self):
        """Serve's LRU dropped the id: its sessions go to the store for any replica to take."""
        await self._release(self.key, sorted(self.session_ids))


class Replica:
    """The Serve deployment class of a replica; `forward` streams one HTTP exchange with its daemon."""

    def __init__(self, settings, board):
        from ray import serve

        from ellm.aio import AsyncClient

        self.name = serve.get_replica_context().replica_id.unique_id
        self.daemon = DaemonProcess(settings.daemon_args(self.name), self.name)
        self.daemon.wait_ready()
        self.client = AsyncClient(self.daemon.socket, timeout=STOP_TIMEOUT_S)
        self.http: aiohttp.ClientSession | None = None

        async def load(key: str) -> Held:
            return Held(key, self.release)

        # A function in an instance attribute (not a method), so that the LRU's size can be a setting.
        self.hold = serve.multiplexed(max_num_models_per_replica=settings.sessions_per_replica)(load)
        self.publisher = threading.Thread(target=self.publish, args=(board,), name="ellm-metrics", daemon=True)
        self.publisher.start()
        log.info("replica %s: daemon pid %d on %s", self.name, self.daemon.process.pid, self.daemon.url)

    def publish(self, board) -> None:
        """Hand the daemon's metrics to the board every few seconds, while the daemon lives."""
        while self.daemon.alive:
            try:
                with urllib.request.urlopen(self.daemon.url + "/metrics", timeout=PUBLISH_S) as response:
                    board.publish.remote(self.name, response.read().decode()).result()
            except Exception as e:  # a slow scrape or a board restarting: the next period retries
                log.warning("replica %s: publishing metrics: %s", self.name, e)
            time.sleep(PUBLISH_S)

    async def release(self, key: str, session_ids: list[str]) -> None:
        from ellm.errors import EllmError as ClientError

        for session_id in session_ids:
            try:
                await self.client.call("session.release", session_id=session_id)
            except ClientError as e:  # deleted since, or busy: it stays leased here until the next eviction
                log.warning("replica %s: releasing %s (for %s): %s", self.name, session_id, key, e)

    async def forward(self, method: str, path: str, headers: dict, body: bytes):
        """Yield the daemon's status and headers (as a dict), then its body, piece by piece."""
        from ray import serve

        key = serve.get_multiplexed_model_id()
        held = await self.hold(key) if key else None
        if self.http is None:
            self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        async with self.http.request(method, self.daemon.url + path, headers=headers, data=body) as response:
            session_id = response.headers.get("X-Session-Id")
            if held is not None and session_id:
                held.session_ids.add(session_id)  # an anonymous conversation's session, released with its key
            reply_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP}
            yield {"status": response.status, "headers": {**reply_headers, REPLICA_HEADER: self.name}}
            async for piece in response.content.iter_any():
                yield piece

    def check_health(self) -> None:
        """Serve restarts a replica whose daemon is gone."""
        if not self.daemon.alive:
            raise EllmError(f"replica {self.name}: its daemon exited ({self.daemon.process.returncode})")

    async def __del__(self):
        if self.http is not None:
            await self.http.close()
        self.daemon.stop()
