"""The engine core: one step is schedule -> executor -> update (vLLM's ``EngineCore``).

The server's scheduler process (``service.py``, around sockets) and the offline
``LLM`` (``services/engine.py``, in-process) drive this same object, so the
admission rules, the step and the bookkeeping after it exist once.
"""

from __future__ import annotations

import time

from services.config import EngineConfig
from services.protocol import RequestTokens, StepPlan, StepResult, TokenizedRequest
from services.scheduler.executor import Executor
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler


class EngineCore:
    """A ``Scheduler`` over the KV blocks the executor's ranks hold, and that executor.

    Contract: requests come in already validated by ``RequestProcessor`` (the
    tokenizer's rules); ``step()`` returns each scheduled request's new tokens and
    every finish since the last step, exactly once each.
    """

    def __init__(
        self, config: EngineConfig, executor: Executor, *, enable_kv_cache_events: bool = False
    ) -> None:
        self.executor = executor
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            executor.num_blocks,
            enable_kv_cache_events=enable_kv_cache_events,
        )
        self.last_execute_s = 0.0  # the workers' share of the last step, for metrics

    def add_request(self, request: TokenizedRequest) -> None:
        """Queue a request; ``ValueError`` for a duplicate id or a bad length."""
        self.scheduler.add_request(Request.from_tokenized(request))

    def abort_requests(self, req_ids: list[str]) -> None:
        self.scheduler.abort_requests(req_ids)

    def finish_requests(self, req_ids: list[str], reason: str, stop_reason: str | None) -> None:
        self.scheduler.finish_requests(req_ids, reason, stop_reason)

    def has_work(self) -> bool:
        """Requests to run, or finishes the workers or the output side have not heard of."""
        s = self.scheduler
        return s.has_unfinished_requests() or s.has_finished_requests()

    def step(self) -> tuple[StepPlan, list[RequestTokens]]:
        """One step. A plan with nothing to compute still tells the workers what finished."""
        plan = self.scheduler.schedule()
        result: StepResult | None = None
        self.last_execute_s = 0.0
        if not plan.is_empty or plan.finished_req_ids:
            start = time.perf_counter()
            result = self.executor.execute(plan)
            self.last_execute_s = time.perf_counter() - start
        return plan, self.scheduler.update_from_output(plan, result)
