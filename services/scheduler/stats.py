"""Counters and snapshots the scheduler exposes for the metrics exporter."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache lookups, in tokens, counted once per admitted request.

    Lookups of preempted requests coming back are counted apart, as vLLM does,
    so that recomputation does not inflate ``vllm:prefix_cache_hits``.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclass
class SchedulerStats:
    """A snapshot after a step: gauges now, counters since start-up.

    ``num_waiting_by_reason``: "capacity" for requests the scheduler tried to
    admit (or preempted) and had no room for (KV blocks or ``max_num_seqs``),
    "deferred" for requests not tried yet (queue order, token budget, or a step
    that preempted).
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_waiting_by_reason: dict[str, int] = field(default_factory=dict)
    kv_cache_usage: float = 0.0
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # Prompt tokens asked of a KV connector and supplied by it; None without a connector.
    connector_prefix_cache_stats: PrefixCacheStats | None = None
    num_preemptions: int = 0
    step_num_scheduled_tokens: int = 0  # vllm:iteration_tokens_total, last step
