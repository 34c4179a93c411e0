"""Serve's request router for the replicas: a session goes where it is held, a new one to the least
loaded replica.

Serve's default router places a multiplexed id it has not seen on a replica holding the fewest ids,
counting the ids the replicas have reported, which lags: a burst of new sessions (agents starting
together) all saw the same counts and all went to one replica while the other idled. This router
places a new session on the replica holding the fewest sessions, counting its own placements at
once, then by the requests in flight on each (a request is counted in Serve's queue lengths only
once sent). Sessions first: a session is held for hours while a request lasts seconds, and the
count of sessions does not depend on how fast each replica happens to answer (in-flight counts do:
on a loaded machine a replica that answered sooner drew more of a burst). A known session goes to its replica only, waiting while that replica is full rather than
going to another one (which would find the session leased). Each replica chosen serves the request
it was chosen for (Serve's FIFO mixin may hand it to an older request of another session).
"""

from __future__ import annotations

import random
import time

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

PLACED_S = 30.0  # a placement counts as held until then; the replica's own report of the id comes sooner
SENDING_S = 2.0  # and as in flight until then (Serve's queue length counts a request once it is sent)


class SessionRouter(RequestRouter):
    """Session affinity and even placement of new sessions (the multiplexed id is the session key)."""

    def initialize_state(self, **kwargs):
        self.placed: dict[str, tuple[ReplicaID, float]] = {}  # key -> (replica, when placed)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # a full replica is waited for, not spun on
        key = pending_request.metadata.multiplexed_model_id
        if not key:
            return [candidate_replicas]  # no session: the shortest queue
        now = time.monotonic()
        self.placed = {k: p for k, p in self.placed.items() if now - p[1] < PLACED_S}
        holders = [r for r in candidate_replicas if key in r.multiplexed_model_ids]
        if not holders and key in self.placed:
            holders = [r for r in candidate_replicas if r.replica_id == self.placed[key][0]]
        if holders:
            return [holders]
        chosen = min(random.sample(candidate_replicas, len(candidate_replicas)), key=self.load)
        self.placed[key] = (chosen.replica_id, now)
        return [[chosen]]

    def load(self, replica: RunningReplica) -> tuple[int, int]:
        """(session keys held or just placed, requests in flight or just placed) of a replica."""
        now = time.monotonic()
        placed = {k: t for k, (replica_id, t) in self.placed.items() if replica_id == replica.replica_id}
        sending = sum(now - t < SENDING_S for t in placed.values())
        queue = self.replica_queue_len_cache.get(replica.replica_id) or 0  # counts some of `sending` already
        return len(placed.keys() | replica.multiplexed_model_ids), max(queue, sending)
