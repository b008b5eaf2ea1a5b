"""The api_server process: the app on uvicorn, started by ``launch.child api_server``.

Started by ``services/http/server.py:run_app`` like the router and the PD proxy. The
launcher, not uvicorn, decides when to stop: SIGTERM (or SIGINT) starts a drain —
new requests get 503, live ones get ``--shutdown-timeout`` to finish, the rest are
aborted — and then the server exits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from services.api_server.app import build_app
from services.api_server.frontend import EngineFrontend, FrontendEndpoints
from services.api_server.serving_base import ServerSettings
from services.config import ServeConfig
from services.gc_tuning import freeze_gc
from services.http.server import run_app
from services.ipc import report_ready
from services.logging_utils import init_logger

logger = init_logger(__name__)


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


def server_settings(config: ServeConfig) -> ServerSettings:
    """The api_server's settings from the serve configuration."""
    return ServerSettings(
        served_model_names=config.served_model_names,
        model_root=config.model_folder,
        api_key=config.api_key,
        max_num_queued_reqs=config.max_num_queued_reqs,
        limits=config.limits,
        enable_request_id_headers=config.enable_request_id_headers,
        tool_call_parser=config.tool_call_parser if config.enable_auto_tool_choice else None,
        exclude_tools_when_tool_choice_none=config.exclude_tools_when_tool_choice_none,
        kv_events=kv_events_info(config),
        access_log=not config.disable_uvicorn_access_log,
        access_log_skip=[
            p.strip() for p in config.disable_access_log_for_endpoints.split(",") if p.strip()
        ],
        runner=config.engine.model.resolved_runner,
        pooler=config.engine.model.pooler,
        embedding_size=_hidden_size(config),
    )


def _hidden_size(config: ServeConfig) -> int | None:
    """The model's hidden size, the longest embedding (None when not pooling)."""
    if config.engine.model.resolved_runner != "pooling" or not config.model_folder:
        return None
    try:  # the folder the launcher prepared and the workers loaded: its config.json is good
        size = json.loads((Path(config.model_folder) / "config.json").read_text())["hidden_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return size if isinstance(size, int) else None


def run_api_server_process(config: ServeConfig, control: str) -> None:
    """Serve until the launcher's SIGTERM has drained the server; report READY on
    ``control`` once the port listens."""
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
    app = build_app(frontend, server_settings(config))

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

    def ready() -> None:
        freeze_gc()
        report_ready(control, "api_server")

    run_app(
        app,
        config.host,
        config.port,
        config.log_level,
        drain=drain,
        on_started=ready,
        timeout_graceful_shutdown=1,
        # vLLM's: seconds an idle client connection stays open
        timeout_keep_alive=int(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5")),
    )
