"""The scheduler process's metrics hooks: what ``EngineCore``'s busy loop calls.

Per step: token counters, finished requests' histograms, the step's time.
At most every ``GAUGE_INTERVAL_S``, and each time the loop goes idle: a
``Scheduler.get_stats()`` snapshot into the gauges and prefix-cache counters,
the sampled KV residency, and the periodic log line when due. While idle the
loop waits for input with a timeout so that the log line still comes on time.

``--disable-log-stats`` (vLLM's flag) turns all of this off but
``vllm:cache_config_info``: the loop then records nothing per step.
"""

from __future__ import annotations

import logging
import queue
from typing import TypeVar

from services import clock
from services.config import ServeConfig
from services.metrics.engine_metrics import GAUGE_INTERVAL_S, EngineMetrics
from services.metrics.process_metrics import SchedulerLoopMetrics
from services.metrics.stats_logger import LoggingStatLogger
from services.protocol import KVTransferDone, RequestTokens, StepPlan
from services.scheduler.scheduler import Scheduler

T = TypeVar("T")


class EngineCoreMetrics:
    """Records one scheduler's metrics. Contract: call from the busy-loop thread only,
    ``on_step`` after every step (it also drains the scheduler's finished requests)
    and ``wait_idle`` instead of a blocking read of the input queue.
    """

    def __init__(
        self,
        config: ServeConfig,
        scheduler: Scheduler,
        logger: logging.Logger,
        engine_index: int = 0,
    ) -> None:
        self.scheduler = scheduler
        self.enabled = not config.disable_log_stats
        self.engine = EngineMetrics(config, engine_index)
        self.loop = SchedulerLoopMetrics(config, engine_index)
        self.stats_logger = LoggingStatLogger(logger, config.log_stats_interval)
        self._next_flush = 0.0

    def on_step(self, plan: StepPlan, outputs: list[RequestTokens], busy_s: float) -> None:
        """After a step: ``busy_s`` is the scheduler's own time in it (not the workers')."""
        finished = self.scheduler.take_finished_requests()
        if not self.enabled:
            return
        self.loop.step_time.observe(busy_s)
        num_prompt, num_generation = self.engine.record_step(plan, outputs)
        self.stats_logger.record(num_prompt, num_generation)
        if finished:
            self.engine.record_finished(finished)
        now = clock.monotonic()
        if now >= self._next_flush:
            self.flush(now)

    def on_kv_transfer(self, done: KVTransferDone) -> None:
        """A worker rank's KV connector reported transfers that ended."""
        if self.enabled:
            self.engine.record_kv_transfer(done)
            self.stats_logger.record_kv_transfer(done)

    def flush(self, now: float | None = None) -> None:
        """Snapshot the scheduler into the gauges; log the stats line if it is due."""
        now = clock.monotonic() if now is None else now
        residency = self.scheduler.take_kv_cache_residency()
        if not self.enabled:
            return
        stats = self.scheduler.get_stats()
        self.engine.record_scheduler_stats(stats)
        self.engine.record_kv_residency(residency)
        self.stats_logger.maybe_log(stats, now)
        self._next_flush = now + GAUGE_INTERVAL_S

    def wait_idle(self, inputs: queue.SimpleQueue[T]) -> T | None:
        """The engine has no work: flush, then wait for input until the next log line is due.

        Returns the message, or None when the wait timed out (call again).
        """
        self.flush()
        timeout = (
            clock.real_seconds(self.stats_logger.seconds_until_due()) if self.enabled else None
        )
        start = clock.perf_counter()
        try:
            msg: T | None = inputs.get(timeout=timeout)
        except queue.Empty:
            msg = None
        if self.enabled:
            self.loop.idle_seconds.inc(clock.perf_counter() - start)
        return msg
