"""The worker process: one per rank; owns the model and the KV cache, runs StepPlans.

Start-up: load the model, measure how many KV blocks fit the memory budget,
allocate them, subscribe to step plans, then report READY with that number
(the launcher hands it to the scheduler). Loop: receive a StepPlan, execute it,
and (rank 0) push the StepResult back to the scheduler.
"""

from __future__ import annotations

import time
from pathlib import Path

from services.config import ServeConfig
from services.gpu_worker.model_runner import ModelRunner
from services.ipc import PushSocket, SubSocket, report_ready
from services.logging_utils import init_logger
from services.metrics.process_metrics import worker_forward_time
from services.protocol import StepPlan, StepResult
from services.scheduler.capacity import check_kv_capacity

logger = init_logger(__name__)


def run_worker(config: ServeConfig, control_endpoint: str, rank: int = 0) -> None:
    """Process entry point. A capacity error (not even one request fits) ends it with ConfigError."""
    engine = config.engine
    runner = ModelRunner(engine, Path(config.model_folder))
    num_blocks = runner.determine_num_blocks()
    check_kv_capacity(num_blocks, engine.cache.block_size, engine.scheduler.max_model_len, logger)
    runner.initialize_kv_cache(num_blocks)
    plans = SubSocket[StepPlan](config.endpoints.step_plans, StepPlan)
    results = (
        PushSocket[StepResult](config.endpoints.step_results, StepResult) if rank == 0 else None
    )
    forward_time = worker_forward_time(config)
    report_ready(control_endpoint, "worker", num_blocks)
    while True:
        plan = plans.recv()
        if plan is None:
            continue
        start = time.perf_counter()
        result = runner.execute(plan)
        forward_time.observe(time.perf_counter() - start)
        if results is not None:
            results.send(result)
