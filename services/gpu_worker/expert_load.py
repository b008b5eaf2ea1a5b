"""How evenly the router spreads tokens over the experts, and so over expert-parallel ranks.

Every ``INTERVAL_S`` one rank per engine core (one for all engine cores in lock-step, where
every rank sees every engine's routing) takes the experts' load from the model
(``WorkerBackend.expert_load``: one host sync), adds it to
``actorserve:expert_tokens_total{expert,ep_rank}`` and logs the imbalance: the busiest
expert-parallel rank's load over the mean (1.0 is even; EP's step waits for the busiest),
and the hottest expert's share. vLLM's ``--enable-eplb`` would move experts by the same
numbers; here they are measured.
"""

from __future__ import annotations

import os
import time
from typing import Any

from services.config import ServeConfig
from services.flags import ConfigError
from services.gpu_worker.base import WorkerBackend
from services.gpu_worker.distributed import ParallelState
from services.logging_utils import init_logger
from services.metrics.process_metrics import expert_tokens

logger = init_logger(__name__)

INTERVAL_S = 10.0
INTERVAL_ENV = "ACTORSERVE_EXPERT_LOAD_INTERVAL_S"  # another interval (tests: 0, every step)


class ExpertLoadReport:
    def __init__(
        self, worker: WorkerBackend, counter: Any, labels: tuple[str, str], ep_size: int
    ) -> None:
        self.worker = worker
        self._counter, self._labels = counter, labels
        self.ep_size = ep_size
        try:
            self.interval_s = float(os.environ.get(INTERVAL_ENV, INTERVAL_S))
        except ValueError:
            raise ConfigError(
                f"{INTERVAL_ENV} must be a number of seconds, got {os.environ[INTERVAL_ENV]!r}"
            ) from None
        self._last = time.monotonic()
        self.own_rank: int | None = None  # counting only this expert-parallel rank's experts

    @classmethod
    def for_rank(
        cls, config: ServeConfig, worker: WorkerBackend, parallel: ParallelState, dp_rank: int
    ) -> ExpertLoadReport | None:
        """The reporter of this rank if it is the one that reports (TP rank 0 of the last
        stage; in lock-step, of engine 0), and the model has experts."""
        # With --all2all-backend all_to_all a rank sees only the pairs sent to its experts:
        # every rank reports those. Else every rank sees the whole step's routing: one does.
        own = parallel.ep_size > 1 and parallel.all2all_backend == "all_to_all"
        first = parallel.is_output_rank and (parallel.dp_size == 1 or parallel.dp_rank == 0)
        if not (own or first) or worker.expert_load() is None:
            return None
        counter, labels = expert_tokens(config, dp_rank)
        report = cls(worker, counter, labels, parallel.ep_size)
        report.own_rank = parallel.ep_rank if own else None
        return report

    def maybe_report(self) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self.report(now - self._last)
        self._last = now

    def report(self, seconds: float) -> list[int]:
        load = self.worker.expert_load() or []
        total = sum(load)
        if not total:
            return load
        per_rank = len(load) // self.ep_size
        for expert, n in enumerate(load):
            if n:
                self._counter.labels(*self._labels, str(expert), str(expert // per_rank)).inc(n)
        hottest = max(range(len(load)), key=load.__getitem__)
        share = 100.0 * load[hottest] / total
        if self.own_rank is not None:
            mine = load[self.own_rank * per_rank : (self.own_rank + 1) * per_rank]
            logger.info(
                "expert load over %.0f s: expert-parallel rank %d's experts got %d (token, "
                "expert) pairs, %.2f x an even share of them; hottest expert %d (%.1f%%)",
                seconds, self.own_rank, total, imbalance(mine), hottest, share,
            )  # fmt: skip
            return load
        if self.ep_size == 1:
            logger.info(
                "expert load over %.0f s: %d (token, expert) pairs; over the experts imbalance "
                "(max / mean) %.2f; hottest expert %d (%.1f%%)",
                seconds, total, imbalance(load), hottest, share,
            )  # fmt: skip
            return load
        ranks = [sum(load[r * per_rank : (r + 1) * per_rank]) for r in range(self.ep_size)]
        logger.info(
            "expert load over %.0f s: %d (token, expert) pairs; per expert-parallel rank %s, "
            "imbalance (max / mean) %.2f; hottest expert %d (%.1f%%)",
            seconds, total, ranks, imbalance(ranks), hottest, share,
        )  # fmt: skip
        return load


def imbalance(loads: list[int]) -> float:
    """The busiest's load over the mean (1.0: even); 1.0 for no load."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean else 1.0
