"""The fleet as a Ray Serve application: an ingress and N replicas of the daemon.

The ingress takes every HTTP request (the daemon's whole HTTP API: OpenAI, Responses, Anthropic,
health), works out its routing key (routing.py) and hands it to a replica through a
DeploymentHandle with that key as the multiplexed id (router.py picks the replica); the reply
streams back as the replica's daemon sends it, with the replica's name in `X-Ellm-Replica`.
/metrics answers every replica's metrics, labelled by replica (metrics.py).

A request that meets a session held by another replica (409 session_leased: a dead replica's lease
not yet given up) or a replica that died under it is tried again, on the replica the router picks
then, for up to `retry_s` seconds; nothing was sent to the client before, and the daemon never
acknowledged the turn, so nothing is lost or doubled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

from ellmd.fleet.metrics import Board
from ellmd.fleet.replica import REPLICA_HEADER, Replica
from ellmd.fleet.routing import routing_key

log = logging.getLogger("ellmd.fleet")

APP_NAME = "ellm"
RETRY_PAUSE_S = 0.25
READY_LINE = "ellm fleet: serving"  # printed once every replica is up
# Ray's own bookkeeping, slowed: at its defaults an idle 2-replica fleet took 0.27 of a core (Serve's
# control loop every 0.1 s, each deployment replica exporting metrics every 0.1 s, Ray's metrics
# collection), taken from the replicas' kernels; 0.17 with these. The fleet's metrics are the daemons'.
QUIET_RAY = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
             "RAY_enable_metrics_collection": "0"}
# Ray's memory monitor off: it kills actors once the node passes 95% of its memory, and the replicas
# commit their KV tensors up front by design. With it on, a node at 95% (a 24 GiB machine running the
# tests beside the fleet) had Serve's controller killed, restarted and killed again for 15 minutes, the
# fleet never serving. The kernel's OOM killer still applies.
NO_RAY_MEMORY_KILLS = {"RAY_memory_monitor_refresh_ms": "0"}
LEASED_CODE = "session_leased"  # the HTTP error code of a session another replica holds


@dataclasses.dataclass
class FleetSettings:
    """What `ellmd fleet start` and a Serve config file's `args` set (the same names)."""

    replicas: int = 2
    threads: int = 1
    batch_size: int = 4
    sequence_length: int = 8192
    model_path: str | None = None
    store: str | None = None
    store_backend: str = "lmdb"
    config: str | None = None  # an ellmd.toml every replica's daemon reads (flags here win)
    sessions_per_replica: int = 32  # Serve's LRU of session ids per replica; beyond it, the oldest is released
    max_ongoing_requests: int = 64  # per replica: generations batch in its daemon, so admit many
    retry_s: float = 30.0

    def daemon_args(self, replica: str) -> list[str]:
        """The flags of a replica's `ellmd start` (the socket and port are its own too)."""
        args = ["--replica", replica, "--threads", str(self.threads), "--batch-size", str(self.batch_size),
                "--sequence-length", str(self.sequence_length), "--store-backend", self.store_backend]
        for flag, value in (("--model-path", self.model_path), ("--store", self.store), ("--config", self.config)):
            if value:
                args += [flag, value]
        return args


class Ingress:
    """The HTTP entry point: routes each request to a replica by its key, streams the reply."""

    def __init__(self, replica, board, retry_s: float):
        self.replica, self.board = replica, board
        self.retry_s = retry_s

    async def __call__(self, request):
        from starlette.responses import Response, StreamingResponse

        if request.url.path == "/metrics":  # every replica's, not the metrics of whichever replica answers
            return Response(await self.board.render.remote(), media_type=Board.content_type)
        body = await request.body()
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None  # the daemon answers the malformed body
        key = routing_key(request.headers, parsed, request.url.path)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        head, refusal, reply = await self.first_answer(key, request.method, path, headers, body)
        if refusal is not None:
            return Response(refusal, status_code=head["status"], headers=head["headers"])
        return StreamingResponse(pieces(reply), status_code=head["status"], headers=head["headers"])

    async def first_answer(self, key, method, path, headers, body):
        """Send to a replica until one answers other than "held elsewhere" (or time is up).

        Returns (status and headers, the whole body of a 409 or None, the reply stream)."""
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError

        deadline = time.monotonic() + self.retry_s
        while True:
            handle = self.replica.options(stream=True, multiplexed_model_id=key or "")
            reply = handle.forward.remote(method, path, headers, body)
            try:
                head = await reply.__anext__()
            except (RayActorError, BackPressureError) as e:
                if time.monotonic() > deadline:
                    raise
                log.warning("key %s: replica unavailable (%s); trying again", key, type(e).__name__)
            else:
                if head["status"] != 409:
                    return head, None, reply
                refusal = b"".join([piece async for piece in pieces(reply)])
                if not held_elsewhere(refusal) or time.monotonic() > deadline:
                    return head, refusal, None
                log.info("key %s: held by another replica than %s; trying again", key, head["headers"][REPLICA_HEADER])
            await asyncio.sleep(RETRY_PAUSE_S)


async def pieces(reply):
    async for piece in reply:
        yield piece


def held_elsewhere(body: bytes) -> bool:
    """Is a 409 the refusal of a session whose lease another replica holds?"""
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == LEASED_CODE


def application(settings: FleetSettings):
    """The Serve application of a fleet (for `serve.run`)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from ellmd.fleet.router import SessionRouter

    board = serve.deployment(Board, name="metrics", ray_actor_options={"num_cpus": 0}).bind()
    replica = serve.deployment(
        Replica, name="replica", num_replicas=settings.replicas, max_ongoing_requests=settings.max_ongoing_requests,
        ray_actor_options={"num_cpus": settings.threads}, health_check_period_s=2, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=120, request_router_config=RequestRouterConfig(request_router_class=SessionRouter),
    ).bind(settings, board)
    ingress = serve.deployment(Ingress, name="ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=1000)
    return ingress.bind(replica, board, settings.retry_s)


def build_app(args: dict):
    """The application builder a Serve config file names (`import_path: ellmd.fleet.app:build_app`)."""
    known = {f.name for f in dataclasses.fields(FleetSettings)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown fleet settings: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return application(FleetSettings(**args))


def run(settings: FleetSettings, http: tuple[str, int], address: str | None = None, on_ready=print) -> None:
    """Run a fleet in the foreground until SIGTERM or SIGINT, then stop it cleanly: every replica's
    daemon snapshots its sessions and gives up their leases. With `address`, join that Ray cluster
    (and leave it running); else start a local Ray sized for the replicas."""
    import os
    import signal

    import ray
    from ray import serve

    from ellmd.server.daemon import signal_pipe

    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        for name, value in {**QUIET_RAY, **NO_RAY_MEMORY_KILLS}.items():  # the local Ray's processes inherit them
            os.environ.setdefault(name, value)
        start_local_ray(max(os.cpu_count() or 1, settings.replicas * settings.threads))
    try:
        serve.start(http_options={"host": http[0], "port": http[1]})
        serve.run(application(settings), name=APP_NAME, route_prefix="/")
        signals = signal_pipe(signal.SIGTERM, signal.SIGINT)  # after Ray's start, which sets handlers of its own
        on_ready(f"{READY_LINE} http://{http[0]}:{http[1]} with {settings.replicas} replicas x {settings.threads} "
                 "threads (SIGTERM or Ctrl-C stops it)")
        os.read(signals, 1)
        on_ready("ellm fleet: stopping (replicas snapshot their sessions)")
        serve.delete(APP_NAME)
        serve.shutdown()
    finally:
        ray.shutdown()


def start_local_ray(cpus: int, attempts: int = 3) -> None:
    """A local Ray. Its raylet gives its agent a fixed 15 s to start and aborts past it, which a
    busy 2-core machine can miss (the agent's imports alone took 17 s at a load of 11); the next
    attempt finds those imports in the page cache."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
            return
        except Exception as e:  # Ray raises a bare Exception for a node that did not start
            if "timed out during startup" not in str(e) or attempt == attempts:
                raise
            log.warning("Ray did not start (%s); trying again", e)
            ray.shutdown()
