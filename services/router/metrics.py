"""The router's own ``/metrics`` (a registry of its own: it is one process, not an engine).

- ``router:decisions_total{policy,replica}``: requests routed;
- ``router:retries_total{replica}``: requests moved off a replica before their first byte;
- ``router:request_errors_total{reason}``: ``no_replica``, ``all_failed``, ``stream_broken``;
- ``router:predicted_cached_tokens_total{replica}`` against
  ``router:measured_cached_tokens_total{replica}`` (the increments of the replica's own
  ``vllm:prefix_cache_hits``) and ``router:measured_cache_queries_total{replica}``: how well
  the index predicts the replica's cache;
- ``router:prompt_tokens_total{replica}``: prompt tokens routed (when the prompt was tokenized);
- ``router:kv_event_batches_total{replica}``, ``router:kv_event_resyncs{replica,reason}``
  (gap not replayable, sequence went back, reconnected), ``router:kv_event_lag_seconds``;
- ``router:index_blocks{replica}`` (the KV events' index where the replica publishes), ``router:replica_healthy{replica}``,
  ``router:replica_in_flight{replica}``, ``router:replica_prefill_seconds_per_token{replica}``;
- ``router:hot_prefix_copies``: requests ``cost`` sent to copy a hot prefix;
- ``router:burst_wait_seconds{replica}``: what burst followers waited for their leader;
- ``router:time_to_first_byte_seconds{replica}`` (measured at the router, waits included) and
  ``router:predicted_ttft_seconds{replica}`` (the ``cost`` policy's estimate).
"""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip


class RouterMetrics:
    def __init__(self) -> None:
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}  # ``child``
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("router:decisions", "Requests routed, by policy and replica.",
                                 ["policy", "replica"], registry=r)  # fmt: skip
        self.retries = Counter("router:retries", "Requests moved to another replica before "
                               "their first byte.", ["replica"], registry=r)  # fmt: skip
        self.errors = Counter("router:request_errors", "Requests the router could not serve.",
                              ["reason"], registry=r)  # fmt: skip
        self.predicted_cached = Counter("router:predicted_cached_tokens", "Prompt tokens the "
                                        "router expected the replica to hold.", ["replica"],
                                        registry=r)  # fmt: skip
        self.measured_cached = Counter("router:measured_cached_tokens", "Increments of the "
                                       "replica's vllm:prefix_cache_hits.", ["replica"],
                                       registry=r)  # fmt: skip
        self.measured_queries = Counter("router:measured_cache_queries", "Increments of the "
                                        "replica's vllm:prefix_cache_queries.", ["replica"],
                                        registry=r)  # fmt: skip
        self.prompt_tokens = Counter("router:prompt_tokens", "Prompt tokens routed (tokenized "
                                     "prompts only).", ["replica"], registry=r)  # fmt: skip
        self.index_blocks = Gauge("router:index_blocks", "Blocks the prefix index holds for "
                                  "the replica.", ["replica"], registry=r)  # fmt: skip
        self.healthy = Gauge("router:replica_healthy", "1 while the replica is in rotation.",
                             ["replica"], registry=r)  # fmt: skip
        self.in_flight = Gauge("router:replica_in_flight", "Requests open on the replica.",
                               ["replica"], registry=r)  # fmt: skip
        self.prefill_s_per_token = Gauge("router:replica_prefill_seconds_per_token",
                                         "Measured prefill seconds per computed token.",
                                         ["replica"], registry=r)  # fmt: skip
        self.event_batches = Counter("router:kv_event_batches", "KV event batches applied.",
                                     ["replica"], registry=r)  # fmt: skip
        self.resyncs = Gauge("router:kv_event_resyncs", "Times the replica's KV event index "
                             "was rebuilt, by reason.", ["replica", "reason"], registry=r)  # fmt: skip
        self.event_lag = Gauge("router:kv_event_lag_seconds", "Age of the last KV event batch "
                               "when applied.", ["replica"], registry=r)  # fmt: skip
        self.burst_wait = Histogram("router:burst_wait_seconds", "Time a burst follower "
                                    "waited for its leader's prefill.", ["replica"],
                                    buckets=_TTFT_BUCKETS, registry=r)  # fmt: skip
        self.hot_copies = Gauge("router:hot_prefix_copies", "Requests the cost policy sent "
                                "away from a prefix's holder to copy it.", registry=r)  # fmt: skip
        self.ttfb = Histogram("router:time_to_first_byte_seconds", "From the request's arrival "
                              "at the router to the replica's first byte.", ["replica"],
                              buckets=_TTFT_BUCKETS, registry=r)  # fmt: skip
        self.predicted_ttft = Histogram("router:predicted_ttft_seconds", "The cost policy's "
                                        "estimate of time to first token.", ["replica"],
                                        buckets=_TTFT_BUCKETS, registry=r)  # fmt: skip

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, kept: ``labels`` takes a lock and builds its key on
        every call (~3 us), and the request path and each KV event batch move series by
        replica."""
        key = (metric, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def remove_replica(self, url: str) -> None:
        for key in [k for k in self._children if url in k[1]]:
            del self._children[key]
        for gauge in (self.index_blocks, self.healthy, self.in_flight, self.prefill_s_per_token,
                      self.event_lag):  # fmt: skip
            with contextlib.suppress(KeyError):
                gauge.remove(url)

    def render(self) -> bytes:
        return generate_latest(self.registry)
