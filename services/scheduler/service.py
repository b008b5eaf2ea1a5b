"""The scheduler process: the engine core's busy loop.

One thread owns the input socket and turns arriving messages (new requests,
aborts, stop-string finishes) into a queue; the busy loop drains that queue
each step and blocks on it only when there is no work at all. Each step is the
``EngineCore``'s (schedule -> the executor runs the plan on every worker rank ->
update), then the step's tokens go to the detokenizer in one batch.
"""

from __future__ import annotations

import logging
import queue
import threading

import msgspec

from services import clock
from services.config import ServeConfig
from services.gc_tuning import freeze_gc
from services.ipc import PubSocket, PullSocket, PushSocket, report_ready
from services.kv_cache.events import KVEventPublisher
from services.logging_utils import init_logger
from services.protocol import (
    Abort,
    EngineCoreInput,
    EngineState,
    FinishRequest,
    KVCacheEvent,
    KVTransferDone,
    RequestTokens,
    StepPlan,
    TokenBatch,
    TokenizedBatch,
    TokenizedRequest,
)
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor import MultiprocExecutor
from services.scheduler.metrics import EngineCoreMetrics
from services.structured_output.manager import StructuredOutputManager, vocab_from_folder

logger = init_logger(__name__)

# Aborts can overtake their request (different senders); remember recent ones.
_EARLY_ABORTS_KEPT = 4096


class EngineCoreProc:
    """The scheduler process: an ``EngineCore`` over a ``MultiprocExecutor``, fed by
    an input thread and followed by the detokenizer. Its sockets belong to the
    calling thread (the input socket to the input thread)."""

    def __init__(self, config: ServeConfig, dp_rank: int = 0) -> None:
        ep = config.endpoints.for_engine(dp_rank)
        engine = config.engine
        self.dp_rank = dp_rank
        data_parallel = engine.parallel.data_parallel_size > 1
        self.executor = MultiprocExecutor(
            ep.step_plans,
            ep.step_results,
            engine.parallel.world_size,
            config.num_blocks,
            kv_block_bytes=config.kv_block_bytes,
        )
        self._inputs: queue.SimpleQueue[EngineCoreInput | None] = queue.SimpleQueue()
        self.core = EngineCore(
            engine,
            self.executor,
            enable_kv_cache_events=ep.kv_events is not None or data_parallel,
            structured_output=StructuredOutputManager(
                engine.scheduler.structured_outputs,
                vocab_from_folder(config.model_folder),
                wake=lambda: self._inputs.put(None),  # a grammar compiled: step again
            ),
        )
        self.scheduler = self.core.scheduler
        self._early_aborts: dict[str, None] = {}
        self._detok = PushSocket[TokenBatch](ep.detok_tokens, TokenBatch)
        self._kv_events = (
            KVEventPublisher(
                ep.kv_events, ep.kv_events_replay, ep.kv_events_topic, ep.kv_events_buffer_steps
            )
            if ep.kv_events
            else None
        )
        # With data parallelism the tokenizers route by each engine's load and cached blocks.
        self._state = (
            PubSocket[EngineState](ep.engine_state, EngineState, bind=True)
            if data_parallel
            else None
        )
        self._last_load: tuple[int, int] = (0, 0)
        # A request arrived since the last state: report even if the load looks the same
        # (one that finished in its first step, or was refused), so that the balancer's
        # count of requests routed here but not yet reported goes back to zero.
        self._received = False
        self.metrics = EngineCoreMetrics(config, self.scheduler, logger, dp_rank)
        self.metrics.loop.count_sent_bytes(self.executor.plans_socket, "step_plans")
        self.metrics.loop.count_sent_bytes(self._detok, "detok_tokens")
        self._input_endpoint = ep.engine_core
        self._unsent: tuple[StepPlan, list[RequestTokens], float] | None = None
        self._bound = threading.Event()
        # ACTORSERVE_LOGGING_LEVEL=DEBUG turns on the idle-time integrity check of the KV cache.
        self._debug = logger.isEnabledFor(logging.DEBUG)
        threading.Thread(target=self._input_loop, name="scheduler-input", daemon=True).start()

    def _input_loop(self) -> None:
        sock = PullSocket[EngineCoreInput](self._input_endpoint, EngineCoreInput, bind=True)
        self._bound.set()
        while True:
            try:
                msg = sock.recv()
            except (msgspec.DecodeError, msgspec.ValidationError):
                # Never let one bad frame end this thread: the process would live on, deaf.
                logger.exception("dropping an undecodable message on the scheduler's input")
                continue
            if msg is not None:
                self._inputs.put(msg)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Block until the input socket is bound and every worker rank subscribed to plans."""
        if not self._bound.wait(timeout_s):
            raise RuntimeError("the scheduler's input socket did not bind")
        self.executor.wait_ready(timeout_s)

    # ------------------------------------------------------------------ loop

    def run_forever(self) -> None:
        while True:
            if not self.core.has_work():
                self._flush()
                if self._debug:
                    # Idle is the one moment the whole pool must add up: check it.
                    self.scheduler.check_integrity()
                msg = self.metrics.wait_idle(self._inputs)  # flushes gauges, logs stats when due
                if msg is None:
                    continue
                self._handle(msg)
            while True:
                try:
                    self._handle(self._inputs.get_nowait())
                except queue.Empty:
                    break
            self.step()

    def _handle(self, msg: EngineCoreInput | None) -> None:
        sched = self.scheduler
        if msg is None:
            return
        if isinstance(msg, TokenizedBatch):
            for request in msg.requests:
                self._handle(request)
        elif isinstance(msg, TokenizedRequest):
            self._received = True
            if msg.req_id in self._early_aborts:
                # Aborted before it arrived: report it finished, never run it.
                del self._early_aborts[msg.req_id]
                self._detok.send(TokenBatch([RequestTokens(msg.req_id, [], "abort")]))
                return
            try:
                self.core.add_request(msg)
            except ValueError as e:
                logger.warning("rejected request %s: %s", msg.req_id, e)
                self._detok.send(TokenBatch([RequestTokens(msg.req_id, [], "error")]))
        elif isinstance(msg, Abort):
            unknown = [r for r in msg.req_ids if r not in sched.requests]
            self.core.abort_requests(msg.req_ids)
            for req_id in unknown:
                self._early_aborts[req_id] = None
            while len(self._early_aborts) > _EARLY_ABORTS_KEPT:
                self._early_aborts.pop(next(iter(self._early_aborts)))
        elif isinstance(msg, FinishRequest):
            self.core.finish_requests([msg.req_id], msg.finish_reason, msg.stop_reason)
        elif isinstance(msg, KVTransferDone):
            self.core.kv_transfers_done(msg)
            self.metrics.on_kv_transfer(msg)

    def step(self) -> None:
        start = clock.perf_counter()
        plan, items = self.core.step(while_busy=self._flush)
        busy_s = clock.perf_counter() - start - self.core.last_execute_s
        self._unsent = (plan, items, busy_s)

    def _flush(self) -> None:
        """The last step's tokens to the detokenizer, its KV events and state out, its
        metrics recorded: done once the next plan is submitted, while the workers run it,
        so that the device never waits for this (the tokens leave a schedule() later)."""
        if self._unsent is None:
            return
        plan, items, busy_s = self._unsent
        self._unsent = None
        if items:
            self._detok.send(TokenBatch(items))
        self._publish(self.scheduler.take_events())
        self.metrics.on_step(plan, items, busy_s)

    def _publish(self, events: list[KVCacheEvent]) -> None:
        """KV events to the routers (``--kv-events-endpoint``); with data parallelism the
        engine's state to the tokenizers whenever its load or its cache changed."""
        dp_rank = self.dp_rank if self._state is not None else None
        if self._kv_events is not None and events:
            self._kv_events.publish(clock.wall(), events, dp_rank)
        if self._state is not None:
            sched = self.scheduler
            load = (len(sched.requests) - len(sched.running), len(sched.running))
            if events or load != self._last_load or self._received:
                self._last_load, self._received = load, False
                usage = sched.kv_cache_manager.block_pool.get_usage()
                self._state.send(EngineState(self.dp_rank, *load, usage, events))


def run_scheduler(config: ServeConfig, control_endpoint: str, dp_rank: int = 0) -> None:
    """Process entry point: bind, wait for the workers, report READY, loop forever."""
    core = EngineCoreProc(config, dp_rank)
    core.wait_ready()
    freeze_gc()
    kv = core._kv_events
    report_ready(
        control_endpoint,
        "scheduler",
        engine=dp_rank,
        kv_events=(kv.bound, kv.bound_replay) if kv is not None else ("", ""),
    )
    core.run_forever()
