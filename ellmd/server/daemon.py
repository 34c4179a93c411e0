"""Daemon lifecycle: start (foreground or detached), graceful stop on signal or request."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ellmd.errors import EllmError
from ellmd.server.config import Settings

log = logging.getLogger("ellmd")


def run(settings: Settings, progress=None) -> int:
    """Load the model, open the store, serve until stopped; returns the exit code."""
    from ellmd.engine import Engine
    from ellmd.runtime.context.retrieval import RagLibrary
    from ellmd.runtime.runtime import SNAPSHOT_ACKS, Runtime
    from ellmd.runtime.scheduler import Policy
    from ellmd.runtime.context.skills import SkillLibrary
    from ellmd.runtime.store.leases import Leases
    from ellmd.runtime.store import open_store
    from ellmd.server.limits import Limits
    from ellmd.server.unix import prepare_socket_dir, socket_in_use

    # Everything that can refuse to start does so before the model loads.
    if settings.snapshot_ack not in SNAPSHOT_ACKS:
        raise EllmError(f"snapshot_ack must be one of {', '.join(SNAPSHOT_ACKS)}, not {settings.snapshot_ack!r}")
    http_address, api_keys = None, settings.api_keys()
    if settings.http:
        from ellmd.server.http.guard import check_exposure, listen_address

        http_address = listen_address(settings.http)
        check_exposure(http_address[0], api_keys)
    prepare_socket_dir(settings.socket_path.parent)
    if settings.socket_path.exists() and socket_in_use(settings.socket_path):
        raise EllmError(f"another ellmd is already serving on {settings.socket_path} (stop it with: ellmd stop)")
    # The store's lock too: a second daemon on this store is refused before the model loads (a fleet
    # replica shares its store: its sessions are leased one by one instead).
    map_size = int(settings.store_map_size_gb * (1 << 30))
    store = open_store(settings.store_backend, settings.store_path, map_size=map_size, replica=settings.replica)
    leases = Leases(store, settings.lease_ttl_s) if settings.replica is not None else None
    servers = None
    try:
        engine = Engine(
            settings.model_path, weight_dtype=settings.weight_dtype, kv_dtype=settings.kv_dtype,
            sequence_length=settings.sequence_length, batch_size=settings.batch_size,
            chunk_size=settings.chunk_size, threads=settings.threads, progress=progress,
        )
        if engine.chat_template is not None:
            engine.chat_template.max_chars = settings.max_render_kb * 1024
        limits = Limits.from_settings(settings, engine.kv.bytes_per_token)
        skills = SkillLibrary(settings.skills_dir)
        rag = RagLibrary(settings.rag_path, default_retriever=settings.rag_retriever)
        runtime = Runtime(engine, store, skills=skills, rag=rag, rag_k=settings.rag_k,
                          snapshot_every_turn=settings.snapshot_every_turn, context_role=settings.context_role,
                          snapshot_ack=settings.snapshot_ack, policy=Policy(engine.chunk_size, settings.gap_ratio),
                          leases=leases, key_owners={key.name: key.owner for key in api_keys})
        if leases is not None:
            leases.start()
        servers = Servers(runtime, settings, http_address, limits, api_keys,
                          signals=signal_pipe(signal.SIGTERM, signal.SIGINT))
        servers.start()
        # The engine loop runs here, on the main thread, which loaded the model and warmed its
        # kernels up (see Runtime.run); the servers' event loop has a thread of its own.
        # A daemon that seems stuck: every thread's stack to the log, from C, whatever holds the GIL.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        runtime.run()
    finally:
        if servers is not None:
            servers.request_stop()
            servers.join()
        store.close()
    if runtime.unsaved:  # what a clean stop did not save, named: the exit code says it too
        log.critical("stopped, but %d session(s) could not be saved (the store keeps their last snapshot): %s",
                     len(runtime.unsaved), ", ".join(runtime.unsaved))
        return 1
    log.info("stopped")
    return 1 if servers.error else 0


def signal_pipe(*signums: int) -> int:
    """A file descriptor that turns readable when one of these signals arrives (call on the main
    thread).

    The kernel may deliver a signal to any thread, and Python runs its handlers on the main thread
    only, which may be waiting on a lock that only a signal of its own interrupts (the engine loop
    on its queue, the fleet on its stop): such a process did not stop. The C-level handler writes
    the signal to the wake-up fd on whichever thread it lands, so that is what is read here; the
    Python handler has nothing left to do."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    for signum in signums:
        signal.signal(signum, lambda *_: None)
    signal.set_wakeup_fd(write)
    return read


class Servers:
    """The Unix-socket (and HTTP) servers, on an asyncio event loop in a thread of their own."""

    def __init__(self, runtime, settings: Settings, http_address: tuple[str, int] | None, limits,
                 api_keys, signals: int):
        self.runtime, self.settings, self.http_address = runtime, settings, http_address
        self.signals = signals  # a signal_pipe: readable, the servers stop gracefully
        self.limits, self.api_keys = limits, list(api_keys)
        self.thread = threading.Thread(target=self._main, name="servers", daemon=True)
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop: asyncio.Event | None = None

    def start(self) -> None:
        """Start serving; a start-up error (a socket or port in use) is raised here."""
        self.thread.start()
        self.ready.wait()
        if self.error:
            raise self.error

    def request_stop(self) -> None:
        """Begin a graceful stop (from any thread, or a signal handler)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.stop.set)

    def join(self) -> None:
        self.thread.join()

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:
            self.error = e
            if self.ready.is_set():  # after start-up: report it here, run() exits non-zero
                log.exception("the servers failed")
        finally:
            self.ready.set()
            self.runtime.queue.put(None)  # whatever happened here, end the engine loop too

    def _on_signal(self) -> None:
        os.read(self.signals, 64)
        self.stop.set()

    async def _serve(self) -> None:
        from ellmd.server.limits import Admission
        from ellmd.server.unix import UnixServer

        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        self.loop.add_reader(self.signals, self._on_signal)
        runtime, settings = self.runtime, self.settings
        info = {"model": str(runtime.engine.model_path)}
        admission = Admission(runtime, self.limits.max_queue)  # one engine queue bound for both servers
        server = UnixServer(runtime, settings.socket_path, self.stop.set, info, self.limits, admission)
        await server.start()
        log.info("serving on %s (store %s, %s%s)", settings.socket_path, settings.store_path, settings.store_backend,
                 f", replica {settings.replica}" if settings.replica is not None else "")
        http = None
        if self.http_address:
            from ellmd.server.http.site import HttpServer

            http = HttpServer(runtime, *self.http_address, limits=self.limits, admission=admission,
                              api_keys=self.api_keys)
            try:
                await http.start()
            except EllmError:
                await server.close()
                raise
            log.info("OpenAI-compatible API on http://%s:%d/v1", *self.http_address)
        self.ready.set()
        await self.stop.wait()
        log.info("stopping: finishing generations and snapshotting sessions")
        # Both servers stop taking requests now; those in flight end with the generations below.
        server.stop_accepting()
        http_closed = asyncio.create_task(http.close()) if http else None
        # End the engine loop while this loop still runs, so the final replies reach their clients.
        await self.loop.run_in_executor(None, runtime.stop)
        if http_closed:
            await http_closed
        await server.close()  # replies sent, then every connection closed, idle ones too


def detach(argv: list[str], settings: Settings, wait_s: float = 600.0) -> int:
    """Start the daemon in the background (pid and log files beside the socket); wait until it serves."""
    from ellmd.server.unix import prepare_socket_dir, socket_in_use

    run_dir = settings.socket_path.parent
    prepare_socket_dir(run_dir)
    log_path, pid_path = run_dir / "ellmd.log", run_dir / "ellmd.pid"
    with open(log_path, "ab") as log_file:
        child = subprocess.Popen(
            [sys.executable, "-m", "ellmd.cli", "start", *argv], stdin=subprocess.DEVNULL,
            stdout=log_file, stderr=log_file, start_new_session=True,
        )
    pid_path.write_text(f"{child.pid}\n")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            pid_path.unlink(missing_ok=True)
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise EllmError(f"the daemon exited during start-up: {tail[0]} (log: {log_path})")
        if settings.socket_path.exists() and socket_in_use(settings.socket_path):
            print(f"ellmd started (pid {child.pid}), socket {settings.socket_path}, log {log_path}")
            return 0
        time.sleep(0.2)
    raise EllmError(f"the daemon did not start serving within {wait_s:.0f}s (log: {log_path})")


def pid_file(settings: Settings) -> Path:
    return settings.socket_path.parent / "ellmd.pid"


def wait_gone(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not path.exists():
            return True
        time.sleep(0.1)
    return False


def cleanup_pid(settings: Settings) -> None:
    path = pid_file(settings)
    if path.exists():
        try:
            os.kill(int(path.read_text()), 0)
        except (ProcessLookupError, ValueError):
            path.unlink(missing_ok=True)
