"""Executors: how the engine core reaches its worker ranks (vLLM's executor layer).

The engine core hands each StepPlan to an executor and gets one StepResult back;
it never touches worker sockets or processes itself.

- ``UniprocExecutor``: the one rank lives in the calling process (the offline engine
  with a single rank: no sockets, no copies).
- ``MultiprocExecutor``: ranks are processes. Each plan is published once on a PUB
  socket every rank subscribes to; the output rank (TP rank 0 of the last pipeline
  stage) pushes the result back on a PULL socket. Waiting for it polls, so a dead rank
  is noticed (through ``is_alive``) instead of blocking forever.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from pathlib import Path

from services.config import EngineConfig
from services.ipc import PullSocket, XPubSocket
from services.logging_utils import init_logger
from services.protocol import StepPlan, StepResult

logger = init_logger(__name__)

_POLL_MS = 500


class WorkerDied(RuntimeError):
    """A worker rank exited while the engine waited for a step's result."""


class Executor(ABC):
    """Runs every StepPlan on every worker rank, in order, and returns the output rank's
    StepResult. ``num_blocks`` is the KV cache blocks every rank can hold;
    ``kv_block_bytes`` one block's bytes over all ranks (0: unknown).

    Several plans may be submitted before the oldest result is collected (the engine
    core keeps one in flight per pipeline stage); ``collect`` returns them in plan order.
    """

    num_blocks: int
    kv_block_bytes: int = 0

    @abstractmethod
    def submit(self, plan: StepPlan) -> None: ...

    @abstractmethod
    def collect(self, step_id: int) -> StepResult: ...

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release the ranks (the default has nothing to release)."""


class UniprocExecutor(Executor):
    """One rank in this process, built by the ``--worker-backend`` registry."""

    def __init__(self, config: EngineConfig, folder: Path | None) -> None:
        from services.gpu_worker.base import WorkerBackend
        from services.gpu_worker.distributed import SINGLE_RANK
        from services.kv_cache.capacity import check_kv_capacity
        from services.registry import WORKER_BACKENDS, load_backend

        backend = load_backend(
            WORKER_BACKENDS, "worker backend", config.worker.worker_backend, WorkerBackend
        )
        self.worker = backend(config, folder, SINGLE_RANK)
        self.num_blocks = self.worker.determine_num_blocks()
        self.kv_block_bytes = self.worker.kv_cache_bytes_per_block()
        max_len = config.scheduler.resolved_max_model_len
        check_kv_capacity(self.num_blocks, config.cache.block_size, max_len)
        self.worker.initialize_kv_cache(self.num_blocks)
        self.worker.capture_cuda_graphs()
        # Run at submit; taken in order (async scheduling submits a second plan first).
        self._results: deque[StepResult] = deque()

    def submit(self, plan: StepPlan) -> None:
        plan.sent_at = time.monotonic()
        self._results.append(self.worker.execute(plan))

    def collect(self, step_id: int) -> StepResult:
        result = self._results.popleft()
        assert result.step_id == step_id, (result.step_id, step_id)
        return result


class MultiprocExecutor(Executor):
    """Worker ranks in other processes, reached over ZeroMQ.

    Binds ``plans_endpoint`` (XPUB) and ``results_endpoint`` (PULL); the ranks connect.
    ``wait_ready`` returns once all ``num_ranks`` have subscribed, so no plan is lost
    to PUB/SUB's slow joiner. ``is_alive`` (optional) returns None while every rank
    lives, else a description of the dead one; it is asked while a result is awaited.
    """

    def __init__(
        self,
        plans_endpoint: str,
        results_endpoint: str,
        num_ranks: int,
        num_blocks: int,
        is_alive: Callable[[], str | None] | None = None,
        kv_block_bytes: int = 0,
    ) -> None:
        self.num_ranks = num_ranks
        self.num_blocks = num_blocks
        self.kv_block_bytes = kv_block_bytes
        self._plans = XPubSocket[StepPlan](plans_endpoint, StepPlan, bind=True)
        self._results = PullSocket[StepResult](results_endpoint, StepResult, bind=True)
        self._is_alive = is_alive

    @property
    def plans_socket(self) -> XPubSocket[StepPlan]:
        return self._plans

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        if not self._plans.wait_for_subscribers(self.num_ranks, timeout_s):
            raise RuntimeError(
                f"the {self.num_ranks} worker ranks did not subscribe to step plans in time"
            )

    def submit(self, plan: StepPlan) -> None:
        plan.sent_at = time.monotonic()
        self._plans.send(plan)

    def collect(self, step_id: int) -> StepResult:
        while True:
            result = self._results.recv(timeout_ms=_POLL_MS)
            if result is None:
                dead = self._is_alive() if self._is_alive is not None else None
                if dead is not None:
                    raise WorkerDied(dead)
                continue
            if result.step_id == step_id:
                return result
            logger.error("dropping a stale step result (%s, expected %d)", result, step_id)

    def shutdown(self) -> None:
        self._plans.close()
        self._results.close()
