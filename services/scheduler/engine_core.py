"""The engine core: one step is schedule -> executor -> update (vLLM's ``EngineCore``).

The server's scheduler process (``service.py``, around sockets) and the offline
``LLM`` (``launch/llm.py``, in-process) drive this same object, so the
admission rules, the step and the bookkeeping after it exist once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from services import clock
from services.config import EngineConfig
from services.kv_transfer.base import create_scheduler_connector
from services.protocol import KVTransferDone, RequestTokens, StepPlan, TokenizedRequest
from services.request import Request
from services.scheduler.executor import Executor
from services.scheduler.scheduler import Scheduler
from services.structured_output.manager import StructuredOutputManager


class EngineCore:
    """A ``Scheduler`` over the KV blocks the executor's ranks hold, and that executor.

    Contract: requests come in already validated by ``RequestProcessor`` (the
    tokenizer's rules); ``step()`` returns each scheduled request's new tokens and
    every finish since the last step, exactly once each.
    """

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        *,
        enable_kv_cache_events: bool = False,
        structured_output: StructuredOutputManager | None = None,
    ) -> None:
        self.executor = executor
        # One plan in flight per pipeline stage: the stages work on different micro-batches.
        # Async scheduling keeps a second plan in flight: planned while the first runs.
        pp = config.parallel.pipeline_parallel_size
        self.pipeline_depth = 2 if config.scheduler.async_scheduling else pp
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            executor.num_blocks,
            enable_kv_cache_events=enable_kv_cache_events,
            pipeline_depth=pp,
            async_scheduling=config.scheduler.async_scheduling,
            kv_connector=create_scheduler_connector(config, executor.kv_block_bytes),
            structured_output=structured_output,
        )
        self.last_execute_s = 0.0  # the wait for the workers in the last step, for metrics
        self._in_flight: deque[StepPlan] = deque()  # submitted, result not yet taken in

    def add_request(self, request: TokenizedRequest) -> None:
        """Queue a request; ``ValueError`` for a duplicate id or a bad length."""
        self.scheduler.add_request(Request.from_tokenized(request))

    def abort_requests(self, req_ids: list[str]) -> None:
        self.scheduler.abort_requests(req_ids)

    def finish_requests(self, req_ids: list[str], reason: str, stop_reason: str | None) -> None:
        self.scheduler.finish_requests(req_ids, reason, stop_reason)

    def kv_transfers_done(self, done: KVTransferDone) -> None:
        """A worker rank's KV connector reports transfers that ended."""
        self.scheduler.update_from_kv_transfers(done)

    def has_work(self) -> bool:
        """Requests to run, plans in flight, or finishes the workers or the output side
        have not heard of."""
        s = self.scheduler
        return bool(self._in_flight) or s.has_unfinished_requests() or s.has_finished_requests()

    def step(
        self, while_busy: Callable[[], None] | None = None
    ) -> tuple[StepPlan, list[RequestTokens]]:
        """One step: submit plans until ``pipeline_depth`` are out (vLLM's batch queue: with
        pipeline parallelism each stage works on its own micro-batch; with async scheduling
        the next plan is out while this one runs), call ``while_busy`` (the host's other
        work, done while the workers compute), then take in the oldest plan's result. A
        plan with nothing to compute still tells the workers what finished; one with
        nothing at all is not sent."""
        self.last_execute_s = 0.0
        while len(self._in_flight) < self.pipeline_depth:
            plan = self.scheduler.schedule()
            if plan.is_empty and not plan.finished_req_ids and not plan.kv_connector_metadata:
                if not self._in_flight:
                    if while_busy is not None:
                        while_busy()
                    return plan, self.scheduler.update_from_output(plan, None)
                break  # nothing new to start: wait for the oldest plan instead
            start = clock.perf_counter()
            self.executor.submit(plan)  # runs the plan in place with one in-process rank
            self.last_execute_s += clock.perf_counter() - start
            self._in_flight.append(plan)
        if while_busy is not None:
            while_busy()
        plan = self._in_flight.popleft()
        start = clock.perf_counter()
        result = self.executor.collect(plan.step_id)
        self.last_execute_s += clock.perf_counter() - start
        return plan, self.scheduler.update_from_output(plan, result)
