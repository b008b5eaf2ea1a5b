"""Continuous batching: which tokens of which requests each engine step computes.

It stays whole because it is the one place a request's state changes as a step sees it
(admitted, scheduled, preempted, updated, finished); what does not change state lives
beside it: the step's budget (budget.py), the table of states (request_table.py), the
blocking predicates (blockers.py), the KV connector's side (remote_kv.py) and the
messages out (messages.py).
"""

from __future__ import annotations

import itertools
import logging
import sys

from services import clock
from services.config import CacheConfig, SchedulerConfig
from services.kv_cache.block_hash import BlockHasher
from services.kv_cache.capacity import check_kv_capacity
from services.kv_cache.manager import KVCacheManager
from services.kv_cache.metrics import KVCacheMetrics, KVCacheResidency
from services.kv_transfer.base import KVConnectorScheduler
from services.metrics.stats import SchedulerStats
from services.protocol import KVCacheEvent, KVTransferDone, RequestTokens, StepPlan, StepResult
from services.request import (
    FINISH_STATUS,
    Request,
    RequestEventType,
    RequestStatus,
    check_stop,
)
from services.scheduler.blockers import (
    Blocker,
    Blockers,
    ends_in_flight,
    grammar_needs_token_in_flight,
    num_to_compute,
    token_in_flight,
)
from services.scheduler.budget import StepBudget, StepPicks
from services.scheduler.messages import build_plan, request_tokens
from services.scheduler.remote_kv import RemoteKV
from services.scheduler.request_queue import RequestQueue
from services.scheduler.request_table import RequestTable
from services.structured_output.backend import GrammarError
from services.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

_PREEMPTION_LOG_INTERVAL_S = 10.0


class Scheduler:
    """Owns the requests and the KV cache; turns them into one ``StepPlan`` per step.

    Budget (budget.py): each step has one ``StepBudget`` -- ``max_num_batched_tokens``
    tokens, ``max_num_seqs`` requests, and the cuts applied to a request's tokens
    (``long_prefill_token_threshold``; a prompt larger than what is left is chunked with
    ``enable_chunked_prefill``, else it waits). Passes: running requests (decodes, then
    unfinished prefill chunks), then requests whose KV a connector loaded, then waiting
    ones in policy order (FCFS, or lowest (priority, arrival_time) first) take from it
    in turn. A running request that cannot get a block preempts the newest running one
    (priority policy: the lowest priority, then latest), recomputed later; a step that
    preempts admits no waiting request.

    Table (request_table.py): every request is in one state -- compiling (its grammar),
    waiting, loading / loaded (its KV, through a KV connector: remote_kv.py), running,
    or held once finished while the connector holds its blocks; every move between
    states goes through the ``RequestTable``. Predicates (blockers.py): why a running
    request sits out a step; each feature registers its own (``add_blocker``): its
    sampled token not back yet (``token_in_flight``), its grammar's next bitmask row
    waiting on such a token, async scheduling's tokens in flight ending it.

    ``schedule`` may be called again before the last plan's ``update_from_output``
    (pipeline parallelism, async scheduling keep plans in flight): the next plan takes
    other requests, or later prefill chunks of the same ones. Results must be given back
    in plan order; workers run plans in order, so KV blocks freed or reused by a later
    plan are never read by an earlier one. With ``pipeline_depth`` d > 1 each running
    delta carries the tokens sampled since the request was last scheduled (for the
    stages that do not sample), and one plan takes at most 1/d of the running requests
    (the budget's ``max_running``): the stages get micro-batches of similar size instead
    of one full batch and d - 1 idle stages (what vLLM v0's virtual engines did). Each
    plan carries a bitmask row for every constrained request that samples in it.
    ``max_model_len`` None or 0 means no length limit.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        *,
        enable_kv_cache_events: bool = False,
        pipeline_depth: int = 1,
        async_scheduling: bool = False,
        kv_connector: KVConnectorScheduler | None = None,
        structured_output: StructuredOutputManager | None = None,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.pipeline_depth = pipeline_depth
        self.cache_config = cache_config
        self.max_model_len = scheduler_config.max_model_len or sys.maxsize
        if scheduler_config.max_model_len:
            # Logged here, once, with the pool every rank can hold (the smallest rank's).
            check_kv_capacity(
                num_blocks, cache_config.block_size, scheduler_config.max_model_len, logger
            )
        metrics = None
        if cache_config.kv_cache_metrics:
            metrics = KVCacheMetrics(cache_config.kv_cache_metrics_sample)
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            metrics=metrics,
        )
        self.table = RequestTable(scheduler_config.scheduling_policy)
        self.remote_kv = RemoteKV(
            kv_connector, self.kv_cache_manager, self.table, enable_kv_cache_events
        )
        self.block_hasher: BlockHasher | None = None
        if cache_config.enable_prefix_caching:
            self.block_hasher = BlockHasher(
                cache_config.block_size, cache_config.prefix_caching_hash_algo
            )

        self.blockers = Blockers()
        self.add_blocker("token_in_flight", token_in_flight)
        self.structured_output = structured_output  # these two register their blockers
        self.async_scheduling = async_scheduling
        # Ids the workers must drop before the next step (dict: an ordered set).
        self._finished_req_ids: dict[str, None] = {}
        self._pending_outputs: list[RequestTokens] = []
        self._finished_requests: list[Request] = []
        self._next_step_id = 0
        # step id -> the requests whose scheduled tokens reach their end (they sample)
        self._sampling_by_step: dict[int, set[str]] = {}
        self.num_preemptions = 0
        self._last_preemption_log = -float("inf")
        self._last_step_num_tokens = 0

    # ------------------------------------------------------------------ features, states

    def add_blocker(self, name: str, blocker: Blocker) -> None:
        """Keep a running request out of every step in which ``blocker(request)`` is true
        (it runs again once no blocker holds it). ``ValueError`` if ``name`` is taken."""
        self.blockers.add(name, blocker)

    def remove_blocker(self, name: str) -> None:
        self.blockers.remove(name)

    @property
    def structured_output(self) -> StructuredOutputManager | None:
        return self._structured_output

    @structured_output.setter
    def structured_output(self, manager: StructuredOutputManager | None) -> None:
        self._structured_output = manager
        blocker = grammar_needs_token_in_flight if manager is not None else None
        self.blockers.set("grammar_needs_token_in_flight", blocker)

    @property
    def async_scheduling(self) -> bool:
        return self._async_scheduling

    @async_scheduling.setter
    def async_scheduling(self, enabled: bool) -> None:
        self._async_scheduling = enabled
        self.blockers.set("ends_in_flight", ends_in_flight(self.max_model_len) if enabled else None)

    @property
    def requests(self) -> dict[str, Request]:
        return self.table.requests

    @property
    def waiting(self) -> RequestQueue:
        return self.table.waiting

    @property
    def running(self) -> list[Request]:
        return self.table.running

    @property
    def loading(self) -> dict[str, Request]:
        return self.table.loading

    @property
    def loaded(self) -> dict[str, Request]:
        return self.table.loaded

    @property
    def held(self) -> dict[str, Request]:
        return self.table.held

    # ------------------------------------------------------------------ requests in

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ``ValueError`` for a duplicate id or a bad prompt length."""
        if request.req_id in self.table.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        if not 0 < request.num_prompt_tokens <= self.max_model_len:
            raise ValueError(
                f"request {request.req_id!r} has {request.num_prompt_tokens} prompt tokens; "
                f"it needs between 1 and max_model_len={self.max_model_len}"
            )
        compiling = False
        if request.sampling_params.structured_outputs is not None:
            if self.structured_output is None:
                raise ValueError("this engine has no structured outputs backend")
            try:
                compiling = not self.structured_output.add(request)
            except GrammarError as e:
                raise ValueError(str(e)) from None
        self.remote_kv.request_added(request)
        if self.block_hasher is not None:
            hasher = self.block_hasher
            request.set_block_hasher(
                lambda r: hasher.hash_blocks(r.all_token_ids, r.cache_salt, r.block_hashes)
            )
        request.record_event(RequestEventType.QUEUED)
        self.table.add(request, compiling=compiling)

    def finish_requests(
        self, req_ids: list[str], finish_reason: str = "stop", stop_reason: str | None = None
    ) -> None:
        """Finish requests in any state from outside a step, freeing everything.

        "stop": the detokenizer matched a stop string. Idempotent; unknown ids
        are ignored. Each finish is reported once in the next
        ``update_from_output``; per the serve-path contract in protocol.py
        that report says "abort" whatever the reason (for a stop string the
        detokenizer has already finished the request; the report frees it).
        """
        status = FINISH_STATUS[finish_reason]
        for req_id in req_ids:
            request = self.table.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                assert self.structured_output is not None
                self.structured_output.discard(req_id)
            self.table.take_out(request)
            request.stop_reason = stop_reason
            self._finish(request, status)
            self._pending_outputs.append(self._output(request, [], "abort"))

    def abort_requests(self, req_ids: list[str]) -> None:
        """Abort requests in any state (waiting, running, preempted); see ``finish_requests``."""
        self.finish_requests(req_ids, "abort")

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Free a request that is out of its state collection (or, in ``update_from_output``,
        still in ``running``, which drops it after)."""
        if request.status == RequestStatus.RUNNING:
            self._finished_req_ids[request.req_id] = None
        request.status = status
        request.grammar = None
        hold = self.remote_kv.request_finished(request)
        if not hold:
            self.kv_cache_manager.free(request)
        self.table.retire(request, held=hold)
        self._finished_requests.append(request)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> StepPlan:
        """Plan the next step. ``num_computed_tokens`` advances here, as if the step ran.

        Three passes take from one budget: running requests, then loaded ones (their KV
        came from a connector), then waiting ones (none in a step that preempted).
        """
        self._take_compiled()
        budget = StepBudget.for_step(
            self.scheduler_config, len(self.table.running), self.pipeline_depth
        )
        picks = StepPicks()
        self._schedule_running(budget, picks)
        self._schedule_loaded(budget, picks)
        self._schedule_waiting(budget, picks)
        plan = build_plan(
            self._next_step_id,
            picks,
            self.kv_cache_manager,
            self._finished_req_ids,
            with_new_token_ids=self.pipeline_depth > 1,  # for the stages that do not sample
            kv_connector_metadata=self.remote_kv.build_meta(),
        )
        self._finished_req_ids.clear()
        self._next_step_id += 1
        self._advance(plan, picks)
        return plan

    def _schedule_running(self, budget: StepBudget, picks: StepPicks) -> None:
        """Running requests, decodes first, then unfinished prefill chunks; one that cannot
        get a block preempts the newest running request (itself, at worst)."""
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.table.running:
            (decodes if num_to_compute(r) <= 1 else prefills).append(r)
        for request in itertools.chain(decodes, prefills):
            if budget.tokens == 0 or len(picks.running) >= budget.max_running:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if self.blockers.blocking(request) is not None:
                continue
            num_new = budget.clamp(num_to_compute(request), chunk=True)
            assert num_new is not None
            while (new_blocks := self.kv_cache_manager.allocate_slots(request, num_new)) is None:
                victim = self._preempt_one()
                picks.preempted.append(victim)
                budget.give_back(picks.drop_running(victim))  # scheduled earlier: undone
                if victim is request:
                    return  # it preempted itself: nothing else fits either
            picks.add_running(request, num_new, [b.block_id for b in new_blocks])
            budget.take(num_new)

    def _schedule_loaded(self, budget: StepBudget, picks: StepPicks) -> None:
        """Requests whose KV the connector loaded: their blocks are in place (the last
        token's slot too), so they run as soon as a place is free, before the queue and
        even in a step that preempted (a queued request could otherwise wait for blocks
        that only their running and finishing frees)."""
        for request in list(self.table.loaded.values()):
            if not budget.has_place(len(self.table.running)) or budget.tokens == 0:
                return
            # The rest of its prompt: its last token, or more where the connector supplied
            # a prefix only (offload, storage).
            num_new = budget.clamp(request.num_tokens - request.num_computed_tokens)
            if num_new is None or self.kv_cache_manager.allocate_slots(request, num_new) is None:
                return
            self._admit(request, num_new, budget, picks)

    def _schedule_waiting(self, budget: StepBudget, picks: StepPicks) -> None:
        """Waiting requests in policy order, until one does not fit; none in a step that
        had to preempt."""
        while not picks.preempted and len(self.table.waiting) and budget.tokens > 0:
            request = self.table.waiting.peek()
            # Requests loading their KV take a place too: they run once it has come.
            if not budget.has_place(self.table.num_seated):
                request.waiting_reason = "capacity"
                return
            hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            started = self.remote_kv.start_load(request, hit_blocks, num_hit)
            if started is not None:
                if started:
                    continue
                return  # no room for its blocks: it waits, first in line
            num_new = budget.clamp(request.num_tokens - num_hit)
            if num_new is None:
                request.waiting_reason = "deferred"
                return
            if self.kv_cache_manager.allocate_slots(request, num_new, hit_blocks, num_hit) is None:
                request.waiting_reason = "capacity"
                return
            self.remote_kv.record_prefix_cache_query(request, num_hit, 0)
            request.num_computed_tokens = num_hit
            self._admit(request, num_new, budget, picks)

    def _admit(self, request: Request, num_new: int, budget: StepBudget, picks: StepPicks) -> None:
        self.table.admit(request, self._next_step_id)
        picks.add_new(request, num_new)
        budget.take(num_new)

    def _advance(self, plan: StepPlan, picks: StepPicks) -> None:
        """Advance the scheduled requests as if the plan ran; note which sample, and give
        the constrained ones among them their bitmask rows."""
        sampling: set[str] = set()
        constrained: list[Request] = []
        for request in picks.in_plan_order():
            request.num_computed_tokens += picks.num_tokens[request.req_id]
            request.num_tokens_at_workers = request.num_tokens
            if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
                sampling.add(request.req_id)
                if request.grammar is not None:
                    constrained.append(request)
                if self.async_scheduling and request.pooling is None:
                    request.num_output_placeholders += 1  # the next plan may build on it
        if sampling:
            self._sampling_by_step[plan.step_id] = sampling
        if constrained:
            assert self.structured_output is not None
            plan.grammar_req_ids, plan.grammar_bitmask = self.structured_output.bitmask(constrained)
        self._last_step_num_tokens = plan.total_num_scheduled_tokens

    def _take_compiled(self) -> None:
        """Requests whose grammar compiled join the queue; those whose grammar failed end
        in an error."""
        if self.structured_output is None:
            return
        ready, failed = self.structured_output.take_compiled()
        for request in ready:
            self.table.compiled(request)
        for request, error in failed:
            logger.warning("request %s: %s", request.req_id, error or "grammar engine failed")
            self.table.take_out(request)
            self._finish(request, RequestStatus.FINISHED_ERROR)
            output = self._output(request, [], "error")
            output.error = error
            self._pending_outputs.append(output)

    def update_from_kv_transfers(self, done: KVTransferDone) -> None:
        """One worker rank's report of KV transfers that ended (see ``RemoteKV``)."""
        self.remote_kv.transfers_done(done)

    def _preempt_one(self) -> Request:
        """Preempt the newest (priority policy: lowest priority, then latest) running request."""
        victim = self.table.preempt()
        self.kv_cache_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.num_output_placeholders = 0  # what its plans in flight sample is dropped
        victim.num_preemptions += 1
        victim.waiting_reason = "capacity"
        victim.record_event(RequestEventType.PREEMPTED)
        self._finished_req_ids[victim.req_id] = None  # the workers drop its stale state
        self.num_preemptions += 1
        now = clock.monotonic()
        if now - self._last_preemption_log >= _PREEMPTION_LOG_INTERVAL_S:
            self._last_preemption_log = now
            logger.warning(
                "Sequence group %s is preempted by PreemptionMode.RECOMPUTE mode because there "
                "is not enough KV cache space. This can affect the end-to-end performance. "
                "Increase gpu_memory_utilization or tensor_parallel_size to provide more KV "
                "cache memory. total_cumulative_preemption_cnt=%d",
                victim.req_id,
                self.num_preemptions,
            )
        return victim

    def update_from_output(self, plan: StepPlan, result: StepResult | None) -> list[RequestTokens]:
        """Take in a step's sampled tokens; return what each request produced or how it ended.

        Blocks filled by the step enter the prefix cache; finished requests
        release theirs. Finishes from ``abort_requests`` / ``finish_requests``
        since the last call are reported here too, each exactly once. An empty
        plan needs no result (None) and only flushes those.
        """
        if result is None:
            if not plan.is_empty:
                raise ValueError(f"step {plan.step_id} scheduled tokens but got no result")
            result = StepResult(plan.step_id)
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} given for plan {plan.step_id}")
        outputs, self._pending_outputs = self._pending_outputs, []
        expected = self._sampling_by_step.pop(plan.step_id, set())
        sampled = {req_id: i for i, req_id in enumerate(result.req_ids)}
        prompt_logprobs = {chunk.req_id: chunk for chunk in result.prompt_logprobs}
        pooled = {p.req_id: p.data for p in result.pooled}
        now = clock.monotonic()
        any_finished = False
        scheduled_ids = itertools.chain(
            (r.req_id for r in plan.new_requests), (r.req_id for r in plan.running)
        )
        for req_id in scheduled_ids:
            request = self.table.requests.get(req_id)
            if (
                request is None
                or request.status != RequestStatus.RUNNING
                or request.admitted_step_id > plan.step_id  # preempted since, and resumed
            ):
                continue  # finished or aborted while the step ran
            self.kv_cache_manager.cache_blocks(request)
            if (chunk := prompt_logprobs.get(req_id)) is not None:
                request.add_prompt_logprobs(chunk)
            i = sampled.get(req_id)
            if req_id in expected and self.async_scheduling and request.pooling is None:
                request.num_output_placeholders -= 1
            if req_id not in expected:  # a prefill chunk short of the prompt's end
                if i is not None:
                    logger.warning(
                        "step %d: ignoring a token sampled mid-prefill for %s", plan.step_id, req_id
                    )
                continue
            if request.pooling is not None:  # prefill only: its vector ends it
                outputs.append(self._finish_pooled(request, pooled.get(req_id), plan.step_id))
                any_finished = True
                continue
            if i is None:
                logger.error("step %d: the worker sampled no token for %s", plan.step_id, req_id)
                status: RequestStatus | None = RequestStatus.FINISHED_ERROR
                new_token_ids: list[int] = []
            else:
                new_token_ids = [result.sampled_token_ids[i]]
                request.append_output_token_ids(new_token_ids)
                request.record_event(RequestEventType.NEW_TOKENS, now)
                status = check_stop(request, self.max_model_len)
                if request.grammar is not None:
                    status = self._advance_grammar(request, new_token_ids[0], status)
            if status is not None:
                self._finish(request, status)
                any_finished = True
            logprobs = result.logprobs[i] if i is not None and i < len(result.logprobs) else None
            outputs.append(
                self._output(
                    request,
                    new_token_ids,
                    request.finish_reason,
                    [logprobs] if logprobs is not None else [],
                )
            )
        if any_finished:
            self.table.drop_finished_running()
        return outputs

    def _finish_pooled(self, request: Request, data: bytes | None, step_id: int) -> RequestTokens:
        """A pooling request whose prompt the step computed: finished with its vector (an
        error if the worker sent none), its blocks freed (the full ones stay cached)."""
        if data is None:
            logger.error("step %d: the worker pooled nothing for %s", step_id, request.req_id)
        status = RequestStatus.FINISHED_STOPPED if data else RequestStatus.FINISHED_ERROR
        self._finish(request, status)
        output = self._output(request, [], request.finish_reason)
        output.pooled = data or b""
        return output

    def _advance_grammar(
        self, request: Request, token_id: int, status: RequestStatus | None
    ) -> RequestStatus | None:
        """Move the request's matcher past its new token: an error if the grammar refuses it,
        a stop once the grammar is complete (nothing else could follow)."""
        assert self.structured_output is not None and request.grammar is not None
        if not self.structured_output.accept(request, token_id):
            logger.error(
                "request %s sampled token %d, which its grammar does not allow",
                request.req_id,
                token_id,
            )
            return RequestStatus.FINISHED_ERROR
        if status is None and request.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED
        return status

    _output = staticmethod(request_tokens)  # RequestTokens for a request (messages.py)

    # ------------------------------------------------------------------ state out

    def has_unfinished_requests(self) -> bool:
        """Requests a step can advance (not those waiting for a KV load, or for their
        grammar to compile: a report, or the compile's end, wakes the loop)."""
        compiling = self.structured_output.num_compiling() if self.structured_output else 0
        return len(self.table.requests) > len(self.table.loading) + compiling

    def has_finished_requests(self) -> bool:
        """Finishes the workers or the detokenizer have not been told of yet: worth a step."""
        return bool(
            self._finished_req_ids or self._pending_outputs or self.remote_kv.has_pending_metadata()
        )

    def take_finished_requests(self) -> list[Request]:
        """Requests finished since the last call (any reason), for request-level metrics."""
        finished, self._finished_requests = self._finished_requests, []
        return finished

    def take_events(self) -> list[KVCacheEvent]:
        return self.kv_cache_manager.block_pool.take_events() + self.remote_kv.take_events()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's /reset_prefix_cache) and the connector's tiers
        beyond it; False while blocks are in use."""
        if not self.kv_cache_manager.block_pool.reset_prefix_cache():
            return False
        self.remote_kv.reset_prefix_cache()
        return True

    def take_kv_cache_residency(self) -> KVCacheResidency | None:
        """Sampled block residency since the last call; None unless ``kv_cache_metrics``."""
        metrics = self.kv_cache_manager.block_pool.metrics
        return metrics.take() if metrics is not None else None

    def get_stats(self) -> SchedulerStats:
        pool = self.kv_cache_manager.block_pool
        return SchedulerStats(
            num_running_reqs=len(self.table.running),
            num_waiting_reqs=self.table.num_waiting,
            num_waiting_by_reason=self.table.waiting_by_reason(),
            kv_cache_usage=pool.get_usage(),
            prefix_cache_stats=pool.prefix_cache_stats,
            connector_prefix_cache_stats=self.remote_kv.prefix_cache_stats,
            num_preemptions=self.num_preemptions,
            step_num_scheduled_tokens=self._last_step_num_tokens,
        )

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` unless requests, their states and the KV cache agree."""
        self.kv_cache_manager.check_integrity()
        table = self.table
        problems = table.problems(self.scheduler_config.max_num_seqs)
        block_tables = self.kv_cache_manager.req_to_blocks
        running_ids = {r.req_id for r in table.running}
        if set(block_tables) != {*running_ids, *table.loading, *table.loaded, *table.held}:
            problems.append("block tables are not those of running, loading, loaded, held requests")
        block_size = self.cache_config.block_size
        for r in table.running:
            num_blocks = len(block_tables.get(r.req_id, []))
            if not r.num_computed_tokens <= min(num_blocks * block_size, r.num_tokens):
                problems.append(f"{r}: bad running state ({num_blocks} blocks)")
        if problems:
            raise RuntimeError("scheduler integrity: " + "; ".join(problems))
