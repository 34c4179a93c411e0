"""Prometheus metrics of the daemon, served as text at the HTTP API's /metrics.

They cover every generation, over the Unix socket and HTTP alike, and live in their own
CollectorRegistry (not prometheus_client's global one).

Counters, since the daemon started:
  ellm_prompt_tokens_prefilled_total   prompt tokens run through the model
  ellm_prompt_tokens_reused_total      prompt tokens whose KV was already computed (resident or resumed)
  ellm_prompt_tokens_shared_total      of those, tokens copied from another session's prefix
  ellm_generated_tokens_total          tokens generated
  ellm_draft_tokens_total              draft tokens verified (speculative decoding)
  ellm_draft_tokens_accepted_total     of those, tokens the samples agreed with (acceptance rate:
                                       the ratio of the two; each accepted one saved a decode step)
Histograms, one observation per generation:
  ellm_time_to_first_token_seconds     request received to first token (prefill included)
  ellm_decode_tokens_per_second        generated tokens per second after the first
Gauges:
  ellm_last_decode_tokens_per_second   the decode speed of the last generation
  ellm_sessions_resident               sessions holding a KV slot
  ellm_sessions_stored                 sessions in the store
  ellm_generations_active              generations in progress
  ellm_kv_bytes_used                   KV cache bytes holding tokens of resident sessions
  ellm_kv_bytes_capacity               KV cache bytes allocated at start-up

With API keys, only an admin key reads them (they are every tenant's). Counters and the session
and KV gauges are read from the runtime's `stats` op at scrape time, so
one scrape sees one consistent state of the engine thread.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
DECODE_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500)


class Metrics:
    """The daemon's metrics: observes every generation of a runtime, renders the exposition text."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, runtime):
        self.registry = CollectorRegistry()
        self.ttft = Histogram("ellm_time_to_first_token_seconds", "Request received to first token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.decode = Histogram("ellm_decode_tokens_per_second", "Generated tokens per second after the first.",
                                buckets=DECODE_BUCKETS, registry=self.registry)
        self.last_decode = Gauge("ellm_last_decode_tokens_per_second", "Decode speed of the last generation.",
                                 registry=self.registry)
        self.stats: dict = {}
        self.registry.register(self)
        runtime.observers.append(self.observe)

    def observe(self, usage: dict) -> None:
        """Record one finished generation (called on the engine thread; prometheus_client is thread-safe)."""
        self.ttft.observe(usage["ttft_ms"] / 1000)
        if usage.get("decode_tok_s"):  # None when a single token was generated
            self.decode.observe(usage["decode_tok_s"])
            self.last_decode.set(usage["decode_tok_s"])

    def render(self, stats: dict) -> bytes:
        """The exposition text, with the counters and gauges of `stats` (the runtime's stats op)."""
        self.stats = stats
        return generate_latest(self.registry)

    def collect(self):
        """The runtime's counters and gauges, as of the last `render` (prometheus_client's collector API)."""
        stats = self.stats
        if not stats:
            return
        counters = stats["counters"]
        for name, key, help_text in (
            ("ellm_prompt_tokens_prefilled", "prefilled", "Prompt tokens run through the model."),
            ("ellm_prompt_tokens_reused", "reused", "Prompt tokens whose KV was already computed."),
            ("ellm_prompt_tokens_shared", "shared", "Prompt tokens whose KV was copied from another session."),
            ("ellm_generated_tokens", "generated", "Tokens generated."),
            ("ellm_draft_tokens", "drafted", "Draft tokens verified (speculative decoding)."),
            ("ellm_draft_tokens_accepted", "accepted", "Draft tokens the sampled tokens agreed with."),
        ):
            yield CounterMetricFamily(name, help_text, value=counters[key])
        for name, key, help_text in (
            ("ellm_sessions_resident", "sessions_resident", "Sessions holding a KV slot."),
            ("ellm_sessions_stored", "sessions_stored", "Sessions in the store."),
            ("ellm_generations_active", "generating", "Generations in progress."),
            ("ellm_kv_bytes_used", "kv_bytes_used", "KV cache bytes holding tokens of resident sessions."),
            ("ellm_kv_bytes_capacity", "kv_bytes", "KV cache bytes allocated at start-up."),
        ):
            yield GaugeMetricFamily(name, help_text, value=stats[key])
