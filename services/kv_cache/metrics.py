"""Sampled KV block residency: lifetime, idle time before eviction, reuse gaps (seconds).

These back vLLM's ``vllm:kv_block_lifetime_seconds``,
``vllm:kv_block_idle_before_evict_seconds`` and ``vllm:kv_block_reuse_gap_seconds``
(``--kv-cache-metrics``, sampled at ``--kv-cache-metrics-sample``). A block is
sampled when it is handed out; its residency ends when it is handed out again
(evicted). Two choices differ from vLLM on purpose: idle time counts from the
moment the block was last released (vLLM: last hit, else allocation),
and the first reuse gap counts from allocation (vLLM: needs two hits), so a
prefix reused once yields one gap, the case the seeds compare against
idle-before-evict.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from services import clock as engine_clock


@dataclass
class KVCacheResidency:
    """Observations collected since the last ``take()``."""

    block_lifetime_s: list[float] = field(default_factory=list)
    idle_before_evict_s: list[float] = field(default_factory=list)
    reuse_gap_s: list[float] = field(default_factory=list)


class KVCacheMetrics:
    """Follows a random ``sample_rate`` share of block allocations through to eviction."""

    def __init__(
        self,
        sample_rate: float,
        clock: Callable[[], float] = engine_clock.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.sample_rate = sample_rate
        self._clock = clock
        self._rng = rng or random.Random()
        self._born: dict[int, float] = {}  # sampled block id -> allocation time
        self._last_access: dict[int, float] = {}  # allocation or latest prefix hit
        self._released: dict[int, float] = {}  # when its last holder let go
        self._observed = KVCacheResidency()

    def on_allocated(self, block_id: int) -> None:
        if self._rng.random() < self.sample_rate:
            self._born[block_id] = self._last_access[block_id] = self._clock()

    def on_hit(self, block_id: int) -> None:
        if block_id in self._born:
            now = self._clock()
            self._observed.reuse_gap_s.append(now - self._last_access[block_id])
            self._last_access[block_id] = now

    def on_released(self, block_id: int) -> None:
        if block_id in self._born:
            self._released[block_id] = self._clock()

    def on_evicted(self, block_id: int) -> None:
        born = self._born.pop(block_id, None)
        if born is not None:
            now = self._clock()
            del self._last_access[block_id]
            self._observed.block_lifetime_s.append(now - born)
            self._observed.idle_before_evict_s.append(now - self._released.pop(block_id, born))

    def take(self) -> KVCacheResidency:
        observed, self._observed = self._observed, KVCacheResidency()
        return observed

    def reset(self) -> None:
        self._born.clear()
        self._last_access.clear()
        self._released.clear()


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
