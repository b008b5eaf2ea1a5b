"""Entry point of every child process: ``python -m launch.child ROLE [RANK [DP_RANK]]``.

The ServeConfig arrives as JSON on stdin (no pickle). Each role's code lives
in its own service folder; this module only decodes the configuration, sets
up the guards against outliving the launcher, and calls the role's run
function. A user-facing configuration error prints one ``error:`` line and
exits 2; the launcher then shuts the server down and reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
from typing import Any

import msgspec

from launch.process import watch_parent
from services.config import ConfigError, ServeConfig
from services.gc_tuning import freeze_gc
from services.ipc import report_ready
from services.logging_utils import init_logger

CONTROL_ENV = "ACTORSERVE_CONTROL"
logger = init_logger(__name__)


def _threads_for_helper_process() -> None:
    """Tokenizer, detokenizer, scheduler and api_server stay lean: the worker gets the cores."""
    # Through the environment, not torch.set_num_threads: most helpers never
    # import torch, and importing it only to set threads costs seconds of CPU
    # per process at start-up.
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def kv_events_info(config: ServeConfig) -> dict[str, Any] | None:
    """What ``GET /kv_events`` reports: where each engine core publishes, and the block
    size and hash algorithm a subscriber needs to match its hashes."""
    if not config.kv_event_publishers:
        return None
    cache = config.engine.cache
    return {
        "publishers": [dataclasses.asdict(p) for p in config.kv_event_publishers],
        "block_size": cache.block_size,
        "prefix_caching_hash_algo": cache.prefix_caching_hash_algo,
        "model": config.served_model_names[0],
    }


def _run_api_server(config: ServeConfig, control: str) -> None:
    import uvicorn

    from services.api_server.app import ServerSettings, build_app
    from services.api_server.frontend import EngineFrontend, FrontendEndpoints

    ep = config.endpoints
    frontend = EngineFrontend(
        FrontendEndpoints(
            ep.tokenizer_requests,
            ep.api_outputs,
            tuple(e.engine_core for e in ep.engines(config.engine.parallel.data_parallel_size)),
        ),
        max_model_len=config.engine.scheduler.resolved_max_model_len,
        retry_waiting_on_restart=config.retry_waiting_on_restart,
    )
    settings = ServerSettings(
        served_model_names=config.served_model_names,
        model_root=config.model_folder,
        api_key=config.api_key,
        max_num_queued_reqs=config.max_num_queued_reqs,
        limits=config.limits,
        enable_request_id_headers=config.enable_request_id_headers,
        tool_call_parser=config.tool_call_parser if config.enable_auto_tool_choice else None,
        exclude_tools_when_tool_choice_none=config.exclude_tools_when_tool_choice_none,
        kv_events=kv_events_info(config),
    )
    app = build_app(frontend, settings)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            loop="uvloop",
            log_level=config.log_level,
            timeout_graceful_shutdown=1,
        )
    )
    # The launcher, not uvicorn, decides when to stop: SIGTERM starts the drain.
    # uvicorn >= 0.29 takes SIGINT/SIGTERM in ``capture_signals`` (older ones in
    # ``install_signal_handlers``); either would replace our handlers and make
    # SIGTERM cut in-flight streams after ``timeout_graceful_shutdown``.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]

    async def drain() -> None:
        if frontend.draining:
            return  # a second signal: the first drain is running
        frontend.draining = True  # new requests get 503 from here on
        deadline = asyncio.get_running_loop().time() + config.shutdown_timeout
        # A request admitted just before registers with the frontend a few loop
        # turns later (its handler's task): give it that time to be counted.
        await asyncio.sleep(0.2)
        while frontend.num_live and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if frontend.num_live:
            logger.warning("shutdown timeout: aborting %d requests", frontend.num_live)
            await frontend.abort(frontend.live_request_ids())
            # Let the abort deltas reach the clients; a CPU step in flight can take seconds.
            abort_deadline = asyncio.get_running_loop().time() + 10
            while frontend.num_live and asyncio.get_running_loop().time() < abort_deadline:
                await asyncio.sleep(0.05)
        server.should_exit = True

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: loop.create_task(drain()))
        loop.add_signal_handler(signal.SIGINT, lambda: loop.create_task(drain()))
        serving = loop.create_task(server.serve())
        while not server.started:
            if serving.done():
                serving.result()  # raises what stopped it (e.g. the port is taken)
                raise SystemExit(1)
            await asyncio.sleep(0.02)
        freeze_gc()
        report_ready(control, "api_server")
        await serving

    import uvloop

    uvloop.run(main())


def main() -> int:
    role = sys.argv[1]
    rank = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    dp_rank = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    watch_parent()
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=ServeConfig)
    control = os.environ[CONTROL_ENV]
    if role != "api_server":
        # Stopped by the launcher once the api_server has drained: a clean exit.
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the launcher; it decides
    try:
        if role == "worker":
            from services.gpu_worker.worker import run_worker

            run_worker(config, control, rank, dp_rank)
            # Skip the interpreter's teardown: triton's bindings report their module objects
            # as "leaked" at finalization (nanobind), 40 lines of noise after every clean exit.
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        _threads_for_helper_process()
        if role == "scheduler":
            from services.scheduler.service import run_scheduler

            run_scheduler(config, control, dp_rank)
        elif role == "tokenizer":
            from services.tokenizer.service import run_tokenizer_process

            run_tokenizer_process(config, control)
        elif role == "detokenizer":
            from services.detokenizer.service import run_detokenizer_process

            run_detokenizer_process(config, control)
        elif role == "api_server":
            _run_api_server(config, control)
        else:
            print(f"error: unknown role {role!r}", file=sys.stderr)
            return 2
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
