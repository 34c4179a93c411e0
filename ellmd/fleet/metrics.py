"""The fleet's /metrics: every replica's daemon metrics in one Prometheus exposition, each sample
labelled with its replica.

Each replica publishes its daemon's /metrics text to the `Board` deployment every few seconds;
the ingress renders the board at /metrics. A replica that stopped publishing (dead, or removed)
drops off after a few periods.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

PUBLISH_S = 5.0  # how often a replica publishes its metrics
STALE_S = 3 * PUBLISH_S


def merge(texts: dict[str, str]) -> bytes:
    """One exposition of several replicas' texts, a `replica` label on every sample."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value, sample.timestamp)

    class Collector:
        def collect(self):
            return iter(families.values())

    registry = CollectorRegistry()
    registry.register(Collector())
    return generate_latest(registry)


class Board:
    """The Serve deployment (one replica) that holds the replicas' latest metrics."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.texts: dict[str, tuple[float, str]] = {}

    def publish(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def render(self) -> bytes:
        now = time.monotonic()
        self.texts = {name: entry for name, entry in self.texts.items() if now - entry[0] < STALE_S}
        return merge({name: text for name, (_, text) in self.texts.items()})
