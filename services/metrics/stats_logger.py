"""The periodic stats line, as vLLM's ``LoggingStatLogger`` prints it.

Every ``--log-stats-interval`` seconds::

    Engine 000: Avg prompt throughput: 123.4 tokens/s, Avg generation throughput: 56.7 tokens/s,
    Running: 3 reqs, Waiting: 0 reqs, GPU KV cache usage: 4.2%, Prefix cache hit rate: 37.5%

Throughputs are over the interval; the hit rate over the most recent
``HIT_RATE_WINDOW_REQUESTS`` admitted requests (vLLM: 1000). An idle engine
logs at DEBUG once both this and the previous interval saw no tokens, so an
idle server stays quiet.
"""

from __future__ import annotations

import collections
import logging

from services import clock
from services.kv_cache.metrics import PrefixCacheStats
from services.metrics.stats import SchedulerStats
from services.protocol import KVTransferDone

HIT_RATE_WINDOW_REQUESTS = 1000


class PrefixCacheHitRate:
    """Hits / queries over about the last ``window`` requests, from cumulative counts."""

    def __init__(self, window: int = HIT_RATE_WINDOW_REQUESTS) -> None:
        self.window = window
        self._intervals: collections.deque[tuple[int, int, int]] = collections.deque()
        self._sums = [0, 0, 0]  # requests, queries, hits in the window
        self._last = (0, 0, 0)

    def observe(self, stats: PrefixCacheStats) -> None:
        now = (stats.requests, stats.queries, stats.hits)
        delta = tuple(a - b for a, b in zip(now, self._last, strict=True))
        self._last = now
        if not delta[0]:
            return
        self._intervals.append(delta)  # type: ignore[arg-type]
        self._sums = [a + b for a, b in zip(self._sums, delta, strict=True)]
        while len(self._intervals) > 1 and self._sums[0] - self._intervals[0][0] >= self.window:
            old = self._intervals.popleft()
            self._sums = [a - b for a, b in zip(self._sums, old, strict=True)]

    @property
    def hit_rate(self) -> float:
        return self._sums[2] / self._sums[1] if self._sums[1] else 0.0


class LoggingStatLogger:
    """Accumulates token counts per step; ``maybe_log`` prints one line per interval."""

    def __init__(self, logger: logging.Logger, interval_s: float, engine_index: int = 0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.engine_index = engine_index
        self.hit_rate = PrefixCacheHitRate()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._last_log = clock.monotonic()
        self._last_was_active = False
        self._xfer_seconds: list[float] = []  # per KV transfer since the last line
        self._xfer_bytes = 0
        self._xfer_failed = 0
        self._xfer_expired = 0

    def record(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self._num_prompt_tokens += num_prompt_tokens
        self._num_generation_tokens += num_generation_tokens

    def record_kv_transfer(self, done: KVTransferDone) -> None:
        per = max(len(done.finished_recving), 1)
        self._xfer_seconds += [done.seconds / per] * len(done.finished_recving)
        self._xfer_bytes += done.num_bytes
        self._xfer_failed += len(done.failed_recving)
        self._xfer_expired += done.num_expired

    def _log_kv_transfers(self) -> None:
        """vLLM's "KV Transfer metrics" line, when there were transfers since the last."""
        times = sorted(self._xfer_seconds)
        if not (times or self._xfer_failed or self._xfer_expired):
            return
        n = len(times)
        total = sum(times)
        self.logger.info(
            "KV Transfer metrics: Num successful transfers=%d, Avg xfer time (ms)=%.3f, "
            "P90 xfer time (ms)=%.3f, Avg MB per transfer=%.3f, Throughput (MB/s)=%.3f, "
            "Num failed transfers=%d, Num expired holds=%d",
            n,
            1e3 * total / n if n else 0.0,
            1e3 * times[min(int(0.9 * n), n - 1)] if n else 0.0,
            self._xfer_bytes / 1e6 / n if n else 0.0,
            self._xfer_bytes / 1e6 / total if total else 0.0,
            self._xfer_failed,
            self._xfer_expired,
        )
        self._xfer_seconds, self._xfer_bytes = [], 0
        self._xfer_failed = self._xfer_expired = 0

    def seconds_until_due(self, now: float | None = None) -> float:
        now = clock.monotonic() if now is None else now
        return max(self._last_log + self.interval_s - now, 0.0)

    def maybe_log(self, stats: SchedulerStats, now: float | None = None) -> bool:
        """Log if an interval has passed since the last line; True if it did."""
        now = clock.monotonic() if now is None else now
        elapsed = now - self._last_log
        if elapsed < self.interval_s:
            return False
        self.hit_rate.observe(stats.prefix_cache_stats)
        prompt_tps = self._num_prompt_tokens / elapsed
        generation_tps = self._num_generation_tokens / elapsed
        active = bool(self._num_prompt_tokens or self._num_generation_tokens)
        level = logging.INFO if active or self._last_was_active else logging.DEBUG
        self._last_was_active = active
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._last_log = now
        self.logger.log(
            level,
            "Engine %03d: Avg prompt throughput: %.1f tokens/s, "
            "Avg generation throughput: %.1f tokens/s, Running: %d reqs, Waiting: %d reqs, "
            "GPU KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            self.engine_index,
            prompt_tps,
            generation_tps,
            stats.num_running_reqs,
            stats.num_waiting_reqs,
            stats.kv_cache_usage * 100,
            self.hit_rate.hit_rate * 100,
        )
        self._log_kv_transfers()
        return True
