"""Run the api_server process: uvicorn (uvloop) serving ``build_app`` on a frontend."""

from __future__ import annotations

import uvicorn

from services.api_server.app import ServerSettings, build_app
from services.api_server.frontend import EngineFrontend, FrontendEndpoints


def run_api_server(
    settings: ServerSettings,
    endpoints: FrontendEndpoints,
    *,
    max_model_len: int,
    host: str = "0.0.0.0",
    port: int = 8000,
    log_level: str = "info",
) -> None:
    """Process entry point: blocks until uvicorn exits (SIGINT/SIGTERM)."""
    frontend = EngineFrontend(endpoints, max_model_len=max_model_len)
    app = build_app(frontend, settings)
    uvicorn.run(
        app,
        host=host,
        port=port,
        loop="uvloop",
        log_level=log_level,
        timeout_graceful_shutdown=None,
    )
