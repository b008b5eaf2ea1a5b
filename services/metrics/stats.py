"""Counters and snapshots the scheduler exposes for the metrics exporter."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.kv_cache.metrics import PrefixCacheStats


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
