"""Continuous batching: which tokens of which requests each engine step computes."""

from __future__ import annotations

import itertools
import logging
import sys

from services import clock
from services.config import CacheConfig, SchedulerConfig
from services.kv_cache.block_hash import BlockHasher
from services.kv_cache.capacity import check_kv_capacity
from services.kv_cache.free_block_queue import KVCacheBlock
from services.kv_cache.manager import KVCacheManager
from services.kv_cache.metrics import KVCacheMetrics, KVCacheResidency, PrefixCacheStats
from services.kv_transfer.base import KVConnectorScheduler
from services.metrics.stats import SchedulerStats
from services.protocol import (
    KVCacheEvent,
    KVTransferDone,
    NewRequest,
    RequestTokens,
    RunningRequestDelta,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from services.request import (
    FINISH_STATUS,
    Request,
    RequestEventType,
    RequestStatus,
    check_stop,
    reaches_length,
)
from services.scheduler.request_queue import create_request_queue
from services.structured_output.backend import GrammarError
from services.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

_PREEMPTION_LOG_INTERVAL_S = 10.0


class Scheduler:
    """Owns the requests and the KV cache; turns them into one ``StepPlan`` per step.

    Each step has one token budget (``max_num_batched_tokens``) and at most
    ``max_num_seqs`` requests run. Running requests come first (decodes, then
    unfinished prefill chunks), then waiting ones in policy order (FCFS, or
    lowest (priority, arrival_time) first). A prompt larger than what is left
    of the budget is chunked (``enable_chunked_prefill``; without it the prompt
    waits), and no request gets more than ``long_prefill_token_threshold``
    tokens in one step when that is set. When a running request cannot get a
    block, the newest running request (priority policy: the lowest priority,
    then latest) is preempted and recomputed later; a step that preempts
    admits no waiting request.

    A request's next token is only scheduled once the token it sampled has come
    back, but ``schedule`` may be called again before the last plan's
    ``update_from_output`` (pipeline parallelism keeps several plans in flight):
    the next plan then takes other requests, or later prefill chunks of the same
    ones. Results must be given back in plan order. Workers run plans in order, so
    KV blocks freed or reused by a later plan are never read by an earlier one.
    With ``pipeline_depth`` d > 1 (one plan in flight per pipeline stage) each
    running delta carries the tokens sampled since the request was last scheduled
    (for the stages that do not sample), and one plan takes at most 1/d of the
    running requests, so the stages get micro-batches of similar size instead of one
    full batch and d - 1 idle stages (what vLLM v0's virtual engines did).
    ``max_model_len`` None or 0 means no length limit.

    With a KV connector (``--kv-transfer-config``) a waiting request whose prompt KV an
    outside source supplies gets its blocks, then waits in ``loading``
    (``WAITING_FOR_REMOTE_KVS``) until every worker rank reports the load; then it runs
    as soon as a place is free, before the queue (``loaded``), or, if the load failed,
    goes back to the head of the queue to compute its prompt.
    A finished request whose blocks the connector holds for a transfer stays in
    ``held`` until every rank reports the transfer over.

    A request with structured outputs waits for its grammar (``WAITING_FOR_GRAMMAR``,
    compiled by ``structured_output`` off this thread) before it joins the queue; each plan
    carries a bitmask row for every constrained request that samples in it, and its
    sampled tokens advance the request's matcher. With async scheduling a constrained
    request is not planned again until its last token is back (its row depends on it).
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
        self.structured_output = structured_output
        self.connector = kv_connector
        self.pipeline_depth = pipeline_depth
        self.async_scheduling = async_scheduling
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
        if kv_connector is not None:
            if kv_connector.keeps_blocks:  # per-block calls only where someone listens
                self.kv_cache_manager.block_pool.listener = kv_connector
            kv_connector.enable_events(enable_kv_cache_events)
        # Prompt tokens asked of the connector and supplied by it (vLLM's
        # vllm:external_prefix_cache_queries / _hits), once per admission.
        self.connector_prefix_cache_stats = PrefixCacheStats()
        self.block_hasher: BlockHasher | None = None
        if cache_config.enable_prefix_caching:
            self.block_hasher = BlockHasher(
                cache_config.block_size, cache_config.prefix_caching_hash_algo
            )

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.scheduling_policy)
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # their KV is being loaded by the connector
        self.loaded: dict[str, Request] = {}  # their KV is in place: they run next
        self.held: dict[str, Request] = {}  # finished; the connector holds their blocks
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

    # ------------------------------------------------------------------ requests in

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ``ValueError`` for a duplicate id or a bad prompt length."""
        if request.req_id in self.requests:
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
        if self.connector is not None:
            self.connector.request_added(request)
        if self.block_hasher is not None:
            hasher = self.block_hasher
            request.set_block_hasher(
                lambda r: hasher.hash_blocks(r.all_token_ids, r.cache_salt, r.block_hashes)
            )
        request.record_event(RequestEventType.QUEUED)
        self.requests[request.req_id] = request
        if compiling:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
        else:
            request.status = RequestStatus.WAITING
            self.waiting.add(request)

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
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.loading[req_id]
            elif request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                assert self.structured_output is not None
                self.structured_output.discard(req_id)
            elif req_id in self.loaded:
                del self.loaded[req_id]
            else:
                self.waiting.remove([request])
            request.stop_reason = stop_reason
            self._finish(request, status)
            self._pending_outputs.append(self._output(request, [], "abort"))

    def abort_requests(self, req_ids: list[str]) -> None:
        """Abort requests in any state (waiting, running, preempted); see ``finish_requests``."""
        self.finish_requests(req_ids, "abort")

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Free a request that is already out of ``running`` and ``waiting``."""
        if request.status == RequestStatus.RUNNING:
            self._finished_req_ids[request.req_id] = None
        request.status = status
        request.grammar = None
        hold = False
        if self.connector is not None:
            blocks = self.kv_cache_manager.req_to_blocks.get(request.req_id, [])
            hold, request.kv_transfer_params_out = self.connector.request_finished(request, blocks)
        if hold:
            self.held[request.req_id] = request
        else:
            self.kv_cache_manager.free(request)
        del self.requests[request.req_id]
        self._finished_requests.append(request)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> StepPlan:
        """Plan the next step. ``num_computed_tokens`` advances here, as if the step ran."""
        cfg = self.scheduler_config
        threshold = cfg.long_prefill_token_threshold
        token_budget = cfg.token_budget
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        preempted: list[Request] = []
        if self.structured_output is not None:
            self._take_compiled()

        # Running requests: decodes first, then unfinished prefill chunks.
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.running:
            (decodes if _num_to_compute(r) <= 1 else prefills).append(r)
        micro_batch = -(-len(self.running) // self.pipeline_depth)  # requests per plan
        for request in itertools.chain(decodes, prefills):
            if token_budget == 0 or len(scheduled_running) >= micro_batch:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = _num_to_compute(request)
            if num_new == 0:
                continue  # its sampled token has not come back yet
            if request.grammar is not None and request.num_output_placeholders:
                continue  # its next bitmask row needs the token a plan in flight samples
            pending = request.num_output_placeholders
            if pending and reaches_length(request, self.max_model_len, pending):
                continue  # the tokens its plans in flight sample end it: no step past that
            if 0 < threshold < num_new:
                num_new = threshold
            num_new = min(num_new, token_budget)
            while (new_blocks := self.kv_cache_manager.allocate_slots(request, num_new)) is None:
                victim = self._preempt_one()
                preempted.append(victim)
                if victim.req_id in num_scheduled:  # scheduled earlier in this step: undo that
                    token_budget += num_scheduled.pop(victim.req_id)
                    del new_block_ids[victim.req_id]
                    scheduled_running.remove(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break  # it preempted itself: nothing else fits either
            scheduled_running.append(request)
            num_scheduled[request.req_id] = num_new
            new_block_ids[request.req_id] = [b.block_id for b in new_blocks]
            token_budget -= num_new

        # Requests whose KV the connector loaded: their blocks are in place (the last
        # token's slot too), so they run as soon as a place is free, before the queue and
        # even in a step that preempted (a queued request could otherwise wait for blocks
        # that only their running and finishing frees).
        for request in list(self.loaded.values()):
            if len(self.running) >= cfg.max_num_seqs or token_budget == 0:
                break
            # The rest of its prompt: its last token, or more where the connector supplied
            # a prefix only (offload, storage).
            num_new = request.num_tokens - request.num_computed_tokens
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > token_budget and cfg.enable_chunked_prefill:
                num_new = token_budget
            if (
                num_new > token_budget
                or self.kv_cache_manager.allocate_slots(request, num_new) is None
            ):
                break
            del self.loaded[request.req_id]
            self._admit(request, scheduled_new)
            num_scheduled[request.req_id] = num_new
            token_budget -= num_new

        # Waiting requests, unless this step had to preempt.
        while not preempted and len(self.waiting) and token_budget > 0:
            request = self.waiting.peek()
            # Requests loading their KV take a place too: they run once it has come.
            if len(self.running) + len(self.loading) + len(self.loaded) >= cfg.max_num_seqs:
                request.waiting_reason = "capacity"
                break
            hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            if self.connector is not None:
                started = self._start_load(request, hit_blocks, num_hit)
                if started is not None:
                    if started:
                        continue
                    break  # no room for its blocks: it waits, first in line
            num_new = request.num_tokens - num_hit
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > token_budget:
                if not cfg.enable_chunked_prefill:
                    request.waiting_reason = "deferred"
                    break
                num_new = token_budget
            if self.kv_cache_manager.allocate_slots(request, num_new, hit_blocks, num_hit) is None:
                request.waiting_reason = "capacity"
                break
            self.waiting.pop()
            self._record_cache_queries(request, num_hit, 0)
            request.num_computed_tokens = num_hit
            self._admit(request, scheduled_new)
            num_scheduled[request.req_id] = num_new
            token_budget -= num_new

        plan = StepPlan(
            step_id=self._next_step_id,
            new_requests=[
                NewRequest(
                    req_id=r.req_id,
                    token_ids=list(r.all_token_ids),
                    num_prompt_tokens=r.num_prompt_tokens,
                    sampling=r.worker_sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(r.req_id),
                    num_computed_tokens=r.num_computed_tokens,
                    eos_token_id=r.eos_token_id,
                )
                for r in scheduled_new
            ],
            running=[
                RunningRequestDelta(
                    r.req_id,
                    new_block_ids[r.req_id],
                    r.num_computed_tokens,
                    r.all_token_ids[r.num_tokens_at_workers :] if self.pipeline_depth > 1 else [],
                )
                for r in scheduled_running
            ],
            num_scheduled_tokens=[num_scheduled[r.req_id] for r in scheduled_new]
            + [num_scheduled[r.req_id] for r in scheduled_running],
            finished_req_ids=list(self._finished_req_ids),
            kv_connector_metadata=(
                self.connector.build_connector_meta() if self.connector is not None else b""
            ),
        )
        self._finished_req_ids.clear()
        self._next_step_id += 1
        sampling: set[str] = set()
        constrained: list[Request] = []
        for request in itertools.chain(scheduled_new, scheduled_running):
            request.num_computed_tokens += num_scheduled[request.req_id]
            request.num_tokens_at_workers = request.num_tokens
            if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
                sampling.add(request.req_id)
                if request.grammar is not None:
                    constrained.append(request)
                if self.async_scheduling:
                    request.num_output_placeholders += 1  # the next plan may build on it
        if sampling:
            self._sampling_by_step[plan.step_id] = sampling
        if constrained:
            assert self.structured_output is not None
            plan.grammar_req_ids, plan.grammar_bitmask = self.structured_output.bitmask(constrained)
        self._last_step_num_tokens = plan.total_num_scheduled_tokens
        return plan

    def _take_compiled(self) -> None:
        """Requests whose grammar compiled join the queue; those whose grammar failed end
        in an error."""
        assert self.structured_output is not None
        ready, failed = self.structured_output.take_compiled()
        for request in ready:
            request.status = RequestStatus.WAITING
            self.waiting.add(request)
        for request, error in failed:
            logger.warning("request %s: %s", request.req_id, error or "grammar engine failed")
            self._finish(request, RequestStatus.FINISHED_ERROR)
            output = self._output(request, [], "error")
            output.error = error
            self._pending_outputs.append(output)

    def _admit(self, request: Request, scheduled_new: list[Request]) -> None:
        request.status = RequestStatus.RUNNING
        request.admitted_step_id = self._next_step_id
        request.record_event(RequestEventType.SCHEDULED)
        self.running.append(request)
        scheduled_new.append(request)

    def _start_load(
        self, request: Request, hit_blocks: list[KVCacheBlock], num_hit: int
    ) -> bool | None:
        """Move the waiting request at the head into ``loading`` when the connector supplies
        part of its prompt asynchronously: True. None when it does not (schedule the request
        as usual); False when its blocks do not fit (nothing changed; it waits, "capacity").

        The blocks cover the whole prompt (what is loaded, what it then computes, the last
        token's slot), so that once loaded the request runs without needing another
        block: loaded requests waiting for blocks that only their own admission could
        free would never run."""
        assert self.connector is not None
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit)
        if not (num_external and load_async):
            return None
        manager = self.kv_cache_manager
        num_new = request.num_tokens - num_hit
        if manager.allocate_slots(request, num_new, hit_blocks, num_hit) is None:
            request.waiting_reason = "capacity"
            return False
        self.waiting.pop()
        self._record_cache_queries(request, num_hit, num_external)
        self.connector.update_state_after_alloc(
            request, manager.get_block_ids(request.req_id), num_external
        )
        request.num_computed_tokens = num_hit + num_external
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.req_id] = request
        return True

    def _record_cache_queries(self, request: Request, num_hit: int, num_external: int) -> None:
        """An admitted request's prefix lookups; its cached tokens count both (as vLLM)."""
        self.kv_cache_manager.record_prefix_cache_query(request, num_hit)
        if self.connector is not None and not request.skip_reading_prefix_cache:
            self.connector_prefix_cache_stats.record(
                request.num_tokens, num_external, preempted=request.is_recomputing
            )
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit + num_external

    def update_from_kv_transfers(self, done: KVTransferDone) -> None:
        """One worker rank's report of transfers that ended: free holds that are over,
        make loaded requests ready to run (``loaded``), queue failed ones to recompute."""
        if self.connector is None:
            return
        outcome = self.connector.update_connector_output(done)
        for req_id in outcome.sent:
            if (held := self.held.pop(req_id, None)) is not None:
                self.kv_cache_manager.free(held)
        failed = set(outcome.failed)
        for req_id in outcome.loaded + outcome.failed:
            if (held := self.held.pop(req_id, None)) is not None:  # aborted while loading
                self.kv_cache_manager.free(held)
                continue
            request = self.loading.pop(req_id, None)
            if request is None:
                continue
            request.status = RequestStatus.WAITING
            if req_id in failed:
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0
                # It comes back as a preempted request does: its prompt lookup is counted
                # apart, and its cached tokens are what that lookup finds.
                request.num_cached_tokens = -1
                request.load_failed = True
                self.waiting.prepend(request)  # it waited longest
            else:
                self.loaded[req_id] = request

    def _preempt_one(self) -> Request:
        """Preempt the newest (priority policy: lowest priority, then latest) running request."""
        if self.scheduler_config.scheduling_policy == "priority":
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
            self.running.remove(victim)
        else:
            victim = self.running.pop()
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_output_placeholders = 0  # what its plans in flight sample is dropped
        victim.num_preemptions += 1
        victim.waiting_reason = "capacity"
        victim.record_event(RequestEventType.PREEMPTED)
        self.waiting.prepend(victim)
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
        now = clock.monotonic()
        any_finished = False
        scheduled_ids = itertools.chain(
            (r.req_id for r in plan.new_requests), (r.req_id for r in plan.running)
        )
        for req_id in scheduled_ids:
            request = self.requests.get(req_id)
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
            if req_id in expected and self.async_scheduling:
                request.num_output_placeholders -= 1
            if req_id not in expected:  # a prefill chunk short of the prompt's end
                if i is not None:
                    logger.warning(
                        "step %d: ignoring a token sampled mid-prefill for %s", plan.step_id, req_id
                    )
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
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return outputs

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

    @staticmethod
    def _output(
        request: Request, new_token_ids: list[int], finish_reason: str | None, logprobs=()
    ) -> RequestTokens:
        prompt_logprobs: list[TokenLogprobs] = []
        first_output = 0 < len(new_token_ids) == request.num_output_tokens
        if first_output and request.sampling_params.prompt_logprobs is not None:
            prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, []
        return RequestTokens(
            req_id=request.req_id,
            new_token_ids=new_token_ids,
            finish_reason=finish_reason,
            stop_reason=request.stop_reason if finish_reason is not None else None,
            logprobs=list(logprobs),
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            prompt_logprobs=prompt_logprobs,
            kv_transfer_params=request.kv_transfer_params_out if finish_reason else None,
        )

    # ------------------------------------------------------------------ state out

    def has_unfinished_requests(self) -> bool:
        """Requests a step can advance (not those waiting for a KV load, or for their
        grammar to compile: a report, or the compile's end, wakes the loop)."""
        compiling = self.structured_output.num_compiling() if self.structured_output else 0
        return len(self.requests) > len(self.loading) + compiling

    def has_finished_requests(self) -> bool:
        """Finishes the workers or the detokenizer have not been told of yet: worth a step."""
        return bool(
            self._finished_req_ids
            or self._pending_outputs
            or (self.connector is not None and self.connector.has_pending_metadata())
        )

    def take_finished_requests(self) -> list[Request]:
        """Requests finished since the last call (any reason), for request-level metrics."""
        finished, self._finished_requests = self._finished_requests, []
        return finished

    def take_events(self) -> list[KVCacheEvent]:
        events = self.kv_cache_manager.block_pool.take_events()
        if self.connector is not None:
            events += self.connector.take_events()
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's /reset_prefix_cache) and the connector's tiers
        beyond it; False while blocks are in use."""
        if not self.kv_cache_manager.block_pool.reset_prefix_cache():
            return False
        if self.connector is not None:
            self.connector.reset_prefix_cache()
        return True

    def take_kv_cache_residency(self) -> KVCacheResidency | None:
        """Sampled block residency since the last call; None unless ``kv_cache_metrics``."""
        metrics = self.kv_cache_manager.block_pool.metrics
        return metrics.take() if metrics is not None else None

    def get_stats(self) -> SchedulerStats:
        # vLLM counts requests waiting for their KV as deferred; loaded ones wait for a place.
        compiling = len(self.requests) - len(self.running) - len(self.waiting)
        compiling -= len(self.loading) + len(self.loaded)
        by_reason = {"capacity": len(self.loaded), "deferred": len(self.loading) + compiling}
        for request in self.waiting:
            by_reason[request.waiting_reason] += 1
        pool = self.kv_cache_manager.block_pool
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.loading) + len(self.loaded) + compiling,
            num_waiting_by_reason=by_reason,
            kv_cache_usage=pool.get_usage(),
            prefix_cache_stats=pool.prefix_cache_stats,
            connector_prefix_cache_stats=(
                self.connector_prefix_cache_stats if self.connector is not None else None
            ),
            num_preemptions=self.num_preemptions,
            step_num_scheduled_tokens=self._last_step_num_tokens,
        )

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` unless requests, queues and the KV cache agree."""
        self.kv_cache_manager.check_integrity()
        problems: list[str] = []
        running_ids = [r.req_id for r in self.running]
        waiting_ids = [r.req_id for r in self.waiting]
        others = [*self.loading, *self.loaded]
        others += [
            r.req_id
            for r in self.requests.values()
            if r.status == RequestStatus.WAITING_FOR_GRAMMAR
        ]
        if sorted(running_ids + waiting_ids + others) != sorted(self.requests):
            problems.append("running + waiting + loading + loaded != all requests")
        if len(self.running) > self.scheduler_config.max_num_seqs:
            problems.append(f"{len(self.running)} running > max_num_seqs")
        tables = set(self.kv_cache_manager.req_to_blocks)
        if tables != {*running_ids, *self.loading, *self.loaded, *self.held}:
            problems.append("block tables are not those of running, loading, loaded, held requests")
        block_size = self.cache_config.block_size
        for r in self.running:
            table = self.kv_cache_manager.req_to_blocks.get(r.req_id, [])
            if r.status != RequestStatus.RUNNING or not (
                r.num_computed_tokens <= len(table) * block_size
                and r.num_computed_tokens <= r.num_tokens
            ):
                problems.append(f"{r}: bad running state ({len(table)} blocks)")
        for r in self.waiting:
            if r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                problems.append(f"{r}: bad waiting state")
            if r.num_computed_tokens != 0:
                problems.append(f"{r}: waiting with computed tokens")
        if problems:
            raise RuntimeError("scheduler integrity: " + "; ".join(problems))


def _num_to_compute(request: Request) -> int:
    """Tokens of the request not yet in any plan: known ones, and with async scheduling the
    ones its plans in flight sample (the workers feed those in themselves)."""
    return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
