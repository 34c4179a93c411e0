"""Ops on the daemon and the connection: stats, live, and the socket server's hello, cancel, shutdown.

`stats` runs on the engine thread as in ops/sessions.py. The others run on the socket server
(runs="connection"): `handler(link, **args)`, where the link is the connection the request came
on (Link: what a handler may use of it); the server only frames and dispatches them.
"""

from __future__ import annotations

import time
from typing import Protocol

from ellmd.runtime import schemas as s
from ellmd.runtime.errors import ProtocolError
from ellmd.runtime.ops.base import Op

PROTOCOL_VERSION = 1
STATS = ("model", "model_type", "slots", "sequence_length", "kv_bytes", "kv_bytes_per_token", "kv_bytes_used",
         "kv_bytes_free", "kv_dtype", "kv_capacity", "sessions_resident", "sessions_stored", "store", "replica",
         "generating", "uptime_s",
         "counters", "scheduler")


class Link(Protocol):
    """What a connection offers the ops it runs itself."""

    greeted: bool  # hello succeeded: other ops may follow
    in_flight: dict  # request id -> runtime.Request, this connection's requests not answered yet

    def identity(self) -> dict:
        """The daemon as hello presents it: server, max_frame, model..."""

    def stop_daemon(self) -> None:
        """Stop the daemon once the current reply is sent."""


def stats(rt, request):
    return {
        "model": str(rt.engine.model_path), "model_type": rt.engine.spec.model_type,
        **rt.residency.stats(), "generating": len(rt.generations.active),
        "uptime_s": round(time.time() - rt.started, 1), "counters": dict(rt.counters),
        "scheduler": rt.policy.stats(),
    }


def live(rt, request):
    """What the engine is doing now: each slot's session and state, the requests it holds, and the
    `stats` (one op, so that a live view costs the engine loop one request a refresh)."""
    prefills = {job.session.slot: job for job in rt.prefills}
    generations = {gen.session.slot: gen for gen in rt.generations.active}
    now = time.perf_counter()
    slots = [slot_state(i, session, prefills.get(i), generations.get(i), now)
             for i, session in enumerate(rt.residency.slots)]
    return {"slots": slots, "prefilling": len(rt.prefills), "generating": len(rt.generations.active),
            "waiting": len(rt.waiting) + sum(map(len, rt.deferred.values())), "queued": rt.queue.qsize(),
            "stats": stats(rt, request)}


def slot_state(index: int, session, prefill, gen, now: float) -> dict:
    """One slot: free, idle (a session resident), prefilling (done of total tokens) or generating (tok/s)."""
    if session is None:
        return {"slot": index, "state": "free", "session_id": None}
    state = {"slot": index, "session_id": session.session_id, "title": session.title, "tokens": session.length,
             "state": "idle"}
    if prefill is not None:
        state.update(state="prefilling", done=prefill.done, total=len(prefill.tokens))
    elif gen is not None:
        count, began = len(gen.generated), gen.first_token_at
        state.update(state="generating", generated=count,
                     tok_s=round((count - 1) / (now - began), 2) if count > 1 and now > began else None)
    return state


def hello(link: Link, protocol, client=None):
    """The handshake, the first request of a connection: the client's protocol version must be ours."""
    if protocol != PROTOCOL_VERSION:
        raise ProtocolError("protocol_version",
                            f"this daemon speaks protocol {PROTOCOL_VERSION}, the client {protocol!r}")
    link.greeted = True
    return {"protocol": PROTOCOL_VERSION, **link.identity()}


def cancel(link: Link, request_id):
    """Stop an earlier request of the same connection (see PROTOCOL.md, cancel)."""
    request = link.in_flight.get(request_id)
    if request is not None:
        request.cancelled.set()
    return {"cancelled": request is not None}


def shutdown(link: Link):
    link.stop_daemon()
    return {}


OPS = (
    Op("stats", s.NoArgs, stats, "admin", reply=STATS),
    Op("live", s.NoArgs, live, "admin", reply=("slots", "prefilling", "generating", "waiting", "queued", "stats")),
    Op("hello", s.Hello, hello, "admin", runs="connection", reply=("protocol", "server", "max_frame", "model"),
       errors=("protocol_version",)),
    Op("cancel", s.Cancel, cancel, "admin", runs="connection", reply=("cancelled",)),
    Op("shutdown", s.NoArgs, shutdown, "admin", runs="connection", reply=()),
)
