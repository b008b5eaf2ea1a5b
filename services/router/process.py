"""The router's and the PD proxy's process: the app on uvicorn (``services/http/server.py``),
its log lines, and its drain.

Both log in the servers' format (``services/logging_utils.py``; uvicorn's lines too),
say where they listen, and on SIGTERM (or SIGINT) drain as the api_server does: new
requests get 503 (``/health`` too), those in flight (a stream until its last byte) get
``--shutdown-timeout`` seconds to end, then the process exits 0; streams still open then
are cut. A second signal changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response

from services.gc_tuning import freeze_gc
from services.http.errors import APIError, ClientGone, client_closed, error_response
from services.http.middleware import AccessLogMiddleware, AccessRecord, Drain, DrainMiddleware
from services.http.server import run_app
from services.logging_utils import configure_process_logging, use_for_uvicorn
from services.router.config import RouterConfig

log = logging.getLogger(__name__)


def add_ops(app: RouterApp, config: RouterConfig, what: str,
            generate: Callable[[Request, str], Awaitable[Response]]) -> Drain:  # fmt: skip
    """The middlewares every router process has: the drain (the innermost: it counts what
    the app serves) and, outside it, the access log (``config.access_log``); and the
    generate routes, before all of them (``GenerateRoutes``). The app's ``Drain`` is
    returned and kept as ``app.state.drain``. (The app's lifespan calls
    ``use_uvicorn_logging``.)"""
    drain = app.state.drain = Drain()
    message = f"the {what} is shutting down"
    app.add_middleware(DrainMiddleware, drain=drain, message=message)  # type: ignore[arg-type]
    skip = set(config.access_log_skip)
    if config.access_log:
        app.add_middleware(AccessLogMiddleware, skip_paths=skip)  # type: ignore[arg-type]
    logged = set(GENERATE_PATHS) - skip if config.access_log else set()
    app.generate_routes = GenerateRoutes(generate, drain, logged)
    return drain


GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


class RouterApp(FastAPI):
    """FastAPI, with ``POST /v1/completions`` and ``/v1/chat/completions`` taken before its
    middlewares (``generate_routes``, set by ``add_ops``)."""

    generate_routes: GenerateRoutes | None = None

    def build_middleware_stack(self) -> Any:
        stack = super().build_middleware_stack()
        if self.generate_routes is None:
            return stack
        self.generate_routes.app = stack
        return self.generate_routes


class GenerateRoutes:
    """``POST /v1/completions`` and ``/v1/chat/completions`` straight to ``generate(request,
    path)``, before FastAPI's middlewares and routing: a relayed stream's ~130 chunks each
    go to uvicorn's ``send`` as they are, where every middleware would wrap it (two of
    them did: ~0.6 ms of CPU a request). What those do for every other route, done here:
    the drain counts these requests (while it drains, the app's answers 503), the access
    line (``AccessRecord``: a ``RelayedAnswer`` keeps what the line says itself), an
    ``APIError`` or ``ClientGone`` answers as the app's handlers answer them, and anything
    else as a 500 in OpenAI's error shape (the traceback logged)."""

    def __init__(self, generate: Callable[[Request, str], Awaitable[Response]], drain: Drain,
                 logged: set[str]) -> None:  # fmt: skip
        self.app: Any = None  # the app's middleware stack: every other request
        self.generate, self.drain, self.logged = generate, drain, logged  # paths with a line

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path")
        if (scope["type"] != "http" or scope["method"] != "POST" or path not in GENERATE_PATHS
                or self.drain.draining):  # fmt: skip
            await self.app(scope, receive, send)
            return
        record = AccessRecord(scope) if path in self.logged else None
        self.drain.in_flight += 1
        try:
            try:
                response = await self.generate(Request(scope, receive), path)
            except APIError as e:
                response = error_response(e.status, e.message, param=e.param)
            except ClientGone:
                response = client_closed()
            except Exception as e:  # (as the api_server's InternalErrorMiddleware)
                log.exception("internal error in POST %s", path)
                response = error_response(500, f"Internal server error: {type(e).__name__}")
            if record is None:
                await response(scope, receive, send)
            elif (fill := getattr(response, "fill", None)) is not None:  # keeps its line
                try:
                    await response(scope, receive, send)
                finally:
                    fill(record)
            else:
                await response(scope, receive, record.wrap(send))
        finally:
            self.drain.in_flight -= 1
            if record is not None:
                record.log()


def use_uvicorn_logging() -> None:
    """uvicorn's lines in the servers' format, its access lines replaced by the access log.
    Called in the app's lifespan: uvicorn has set up its loggers by then (``uvicorn.Config``
    does), and only its first two start-up lines (INFO) went out before."""
    use_for_uvicorn(access_log=False)
    errors = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _CutByShutdown) for f in errors.filters):
        errors.addFilter(_CutByShutdown())


class _CutByShutdown(logging.Filter):
    """Drops uvicorn's traceback of each request it cancels once the drain's timeout has
    passed: the drain has said how many it cuts, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, asyncio.CancelledError)


def serve(app: FastAPI, config: RouterConfig, what: str, details: str) -> int:
    """Serve ``app`` (built with ``add_ops``) on ``config.host:port`` until SIGTERM or SIGINT
    has drained it; 0 then. ``what``: "router" or "PD proxy", ``details``: said with where
    it listens."""
    configure_process_logging()
    drain: Drain = app.state.drain
    host = f"[{config.host}]" if ":" in config.host else config.host

    async def stop() -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        log.info("%s shutting down: draining %d request(s) in flight (up to %g s)",
                 what, drain.in_flight, config.shutdown_timeout)  # fmt: skip
        left = await drain.finish(config.shutdown_timeout)
        if left:
            log.warning("%s shutdown timeout (%g s): cutting %d request(s) still in flight",
                        what, config.shutdown_timeout, left)  # fmt: skip
        else:
            log.info("%s drained in %.1f s", what, loop.time() - began)

    def started() -> None:
        freeze_gc()  # as the server's processes (~0.7 ms of CPU a request here in collections)
        log.info("%s listening on http://%s:%d (%s)", what, host, config.port, details)

    run_app(
        app,
        config.host,
        config.port,
        config.log_level,
        drain=stop,
        on_started=started,
        timeout_graceful_shutdown=1,
        timeout_keep_alive=config.timeout_keep_alive,
    )
    log.info("%s stopped", what)
    return 0
