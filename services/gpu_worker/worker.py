"""The worker process: one per rank; owns its shard of the model and of the KV cache.

Start-up: join the torch.distributed group (when there is more than one rank),
build the ``--worker-backend`` (load the model shard), measure how many KV blocks
fit this rank's memory budget, allocate them, subscribe to step plans, then
report READY with that number (the launcher gives the scheduler the minimum over
ranks). Loop: receive a StepPlan, execute it, and (the output rank) push the
StepResult back to the scheduler.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import zmq

from services import clock
from services.config import EngineConfig, ModelArchConfig, ServeConfig
from services.flags import ConfigError
from services.gc_tuning import freeze_gc
from services.gpu_worker.base import WorkerBackend
from services.gpu_worker.distributed import init_distributed, rank_state
from services.gpu_worker.expert_load import ExpertLoadReport
from services.gpu_worker.lockstep import DPLockstep, run_agreed_step, wait_for_every_rank
from services.ipc import STOP_SIGNAL, PushSocket, SubSocket, report_ready
from services.kv_cache.capacity import check_kv_capacity
from services.kv_transfer.base import KVConnectorWorker, create_worker_connector
from services.logging_utils import init_logger
from services.metrics.process_metrics import device_seconds, worker_forward_time
from services.model_loader import load_hf_config
from services.protocol import EngineCoreInput, KVTransferDone, StepPlan, StepResult
from services.registry import WORKER_BACKENDS, load_backend

logger = init_logger(__name__)

STARTUP_TIMEOUT_S = 900.0  # as long as the launcher waits for every worker to be ready


def run_worker(config: ServeConfig, control_endpoint: str, rank: int = 0, dp_rank: int = 0) -> None:
    """Process entry point for worker ``rank`` of data-parallel engine ``dp_rank``. A
    capacity error (not even one request fits) ends it with ConfigError."""
    engine = config.engine
    endpoints = config.endpoints.for_engine(dp_rank)
    lockstep = engine.parallel.dp_lockstep
    if engine.parallel.master_port is not None and not lockstep:
        engine.parallel.master_port += dp_rank  # each engine's ranks form their own group
    folder = Path(config.model_folder)
    arch = ModelArchConfig.from_hf_config(load_hf_config(folder))
    backend = load_backend(
        WORKER_BACKENDS, "worker backend", engine.worker.worker_backend, WorkerBackend
    )
    layers = arch.num_hidden_layers
    if backend.uses_collectives:
        device = engine.worker.resolved_device()
        parallel = init_distributed(engine.parallel, rank, device, layers, dp_rank)
    elif lockstep:  # no collectives of its own (the simulated backend), but the agreement
        parallel = init_distributed(engine.parallel, rank, "cpu", layers, dp_rank)
    else:
        parallel = rank_state(engine.parallel, rank, layers)
    worker: WorkerBackend = backend(engine, folder, parallel)
    if lockstep:  # engines load at their own pace; the profile's collectives span them
        wait_for_every_rank(parallel, STARTUP_TIMEOUT_S, "the memory profile")
    num_blocks = worker.determine_num_blocks()
    # Fail early when this rank cannot hold one request; the scheduler logs the pool.
    max_len = engine.scheduler.resolved_max_model_len
    check_kv_capacity(num_blocks, engine.cache.block_size, max_len)
    worker.initialize_kv_cache(num_blocks)
    worker.capture_cuda_graphs()
    connector = _kv_connector(engine, worker, rank, endpoints.engine_core)
    # Across machines a crashed node 0 closes no connection: heartbeats notice it.
    heartbeat: dict[int, int] = {zmq.HEARTBEAT_IVL: 2000, zmq.HEARTBEAT_TIMEOUT: 10_000}
    plans = SubSocket[StepPlan](
        endpoints.step_plans,
        StepPlan,
        options=heartbeat if endpoints.step_plans.startswith("tcp://") else None,
    )
    results = (
        PushSocket[StepResult](endpoints.step_results, StepResult)
        if parallel.is_output_rank
        else None
    )
    forward_time = worker_forward_time(config, rank, dp_rank)
    device = device_seconds(config, rank, dp_rank)
    device_last = (0.0, 0.0)
    trace = StepTrace.from_env(rank, dp_rank)
    load = ExpertLoadReport.for_rank(config, worker, parallel, dp_rank)
    agreement = DPLockstep(parallel) if lockstep else None
    if lockstep:
        wait_for_every_rank(parallel, STARTUP_TIMEOUT_S, "the first step")
    freeze_gc()
    report_ready(
        control_endpoint,
        "worker",
        num_blocks,
        rank,
        dp_rank,
        kv_block_bytes=worker.kv_cache_bytes_per_block(),
    )
    # The scheduler going away (its process, or node 0 for a rank on another machine)
    # shows as the plan socket's peer disconnecting: end then, never wait forever. Exit 0:
    # in a shutdown that is the expected end, and after a crash whoever supervises this
    # process (the launcher on this node) sees an unexpected exit all the same.
    lost = plans.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    poller = zmq.Poller()
    poller.register(plans.socket, zmq.POLLIN)
    poller.register(lost, zmq.POLLIN)
    if connector is not None:
        # Stopped by the launcher: the connector ends its work first (storage writes the
        # blocks still queued for the disk, for a few seconds). Not in the handler itself:
        # it may interrupt the connector holding a lock its shutdown needs.
        signal.signal(STOP_SIGNAL, _raise_stop)
    pending: StepPlan | None = None  # in lock-step: a plan held until the ranks agree
    try:
        while True:
            wait_ms = None if agreement is None else 0 if pending else int(agreement.poll_s * 1e3)
            ready = dict(poller.poll(wait_ms))
            if lost in ready:
                logger.info(
                    "worker rank %d: the scheduler at %s went away; exiting", rank, plans.endpoint
                )
                break
            if pending is None:
                pending = plans.recv_nowait()
            if load is not None:
                load.maybe_report()
            agreed = None if agreement is None else agreement.agree(pending)
            if agreement is not None and agreed is None:
                continue  # nothing to run, or an engine's ranks do not all have its plan
            plan, pending = pending, None
            if plan is None and agreed is None:
                continue
            start = clock.perf_counter()
            if plan is not None and connector is not None:
                connector.bind_connector_metadata(plan.kv_connector_metadata)
                connector.start_load_kv()
            if agreed is not None:
                result = run_agreed_step(worker, agreed, plan, parallel.dp_rank)
            else:
                assert plan is not None
                result = worker.execute(plan)
            end = clock.perf_counter()
            if (seen := worker.device_seconds()) is not None:  # a dummy step's time too
                for state, total, last in zip(("busy", "idle"), seen, device_last, strict=True):
                    device[state].inc(total - last)
                device_last = seen
            if plan is None:
                continue
            forward_time.observe(end - start)
            if trace is not None:
                trace.record(plan, start, end)
            if results is not None:
                assert result is not None
                results.send(result)
        if connector is not None:
            # The launcher's stop may follow the scheduler's exit: from here it is
            # ignored (one raised before this line lands below all the same).
            signal.signal(STOP_SIGNAL, signal.SIG_IGN)
    except _Stop:
        pass  # the handler ignored later stops
    if connector is None:
        raise SystemExit(0)
    connector.shutdown()
    os._exit(0)


class _Stop(BaseException):
    """The launcher's stop in a worker whose KV connector has work to end."""


def _raise_stop(*_: object) -> None:
    # One stop: a second one must not interrupt the connector's shutdown.
    signal.signal(STOP_SIGNAL, signal.SIG_IGN)
    raise _Stop


def _kv_connector(
    engine: EngineConfig, worker: WorkerBackend, rank: int, engine_core: str
) -> KVConnectorWorker | None:
    """The worker half of ``--kv-transfer-config``'s connector over this rank's KV cache;
    it reports to the scheduler's input socket (from its own threads)."""
    if engine.kv_transfer is None:
        return None
    caches = worker.kv_caches_for_transfer()
    if caches is None:
        raise ConfigError(
            f"--kv-transfer-config needs KV cache tensors; --worker-backend "
            f"{engine.worker.worker_backend} has none"
        )
    sock = PushSocket[EngineCoreInput](engine_core, EngineCoreInput)
    lock = threading.Lock()

    def report(done: KVTransferDone) -> None:
        with lock:
            sock.send(done)

    connector = create_worker_connector(engine, rank, report)
    assert connector is not None
    connector.simulated_link = worker.simulated_kv_link()
    connector.register_kv_caches(*caches)
    return connector


class StepTrace:
    """``ACTORSERVE_STEP_TRACE_DIR=DIR``: each rank appends one Chrome trace event per step
    to ``DIR/rank{r}.json`` (open it in Perfetto or chrome://tracing; the array's closing
    bracket is optional in that format). It shows when each rank was busy, e.g. both
    pipeline stages at once."""

    ENV = "ACTORSERVE_STEP_TRACE_DIR"

    def __init__(self, path: Path, rank: int) -> None:
        self.rank = rank
        self._file = path.open("w", buffering=1)
        self._file.write("[\n")

    @classmethod
    def from_env(cls, rank: int, dp_rank: int = 0) -> StepTrace | None:
        folder = os.environ.get(cls.ENV)
        if not folder:
            return None
        name = f"rank{rank}.json" if dp_rank == 0 else f"dp{dp_rank}-rank{rank}.json"
        return cls(Path(folder) / name, rank)

    def record(self, plan: StepPlan, start: float, end: float) -> None:
        event = {
            "name": f"step {plan.step_id}",
            "ph": "X",
            "ts": start * 1e6,
            "dur": (end - start) * 1e6,
            "pid": 0,
            "tid": self.rank,
            "args": {"tokens": plan.total_num_scheduled_tokens},
        }
        self._file.write(json.dumps(event) + ",\n")
