"""Starting a server: uvicorn on uvloop, signals, readiness.

Every server passes ``drain``: a signal starts the drain instead of stopping uvicorn at once
(the api_server's launcher decides when it stops; ``actorserve router`` and ``pd-proxy``
drain through ``services/router/process.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn

# uvicorn's exit status when the app does not start (its lifespan failed, the port is taken)
STARTUP_FAILURE = 3


def run_app(
    app: Any,
    host: str,
    port: int,
    log_level: str,
    *,
    drain: Callable[[], Awaitable[None]] | None = None,
    on_started: Callable[[], None] | None = None,
    timeout_graceful_shutdown: int | None = None,
    timeout_keep_alive: int = 5,
) -> None:
    """Serve ``app`` on ``host:port`` until stopped, on uvloop.

    ``drain``: SIGTERM and SIGINT no longer stop the server at once: the first one awaits
    ``drain()`` (finish or abort what is in flight), then the server stops; later ones are
    ignored. Without it, uvicorn's handlers stop it (in-flight requests get
    ``timeout_graceful_shutdown`` seconds).
    ``timeout_keep_alive``: seconds an idle client connection stays open (uvicorn's and
    vLLM's 5 by default).
    ``on_started``: called once the server listens and the app's lifespan has started
    (report readiness there).

    ``SystemExit(STARTUP_FAILURE)`` when the server did not start (a taken port, a failed
    lifespan: uvicorn logs why), as ``uvicorn.run``. What ``on_started`` raises stops the
    server and is raised once it has."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        log_level=log_level,
        timeout_graceful_shutdown=timeout_graceful_shutdown,
        timeout_keep_alive=timeout_keep_alive,
    )
    server = uvicorn.Server(config)
    if drain is not None:
        # uvicorn >= 0.29 takes SIGINT/SIGTERM in ``capture_signals`` (older ones in
        # ``install_signal_handlers``); either would replace our handlers and make
        # SIGTERM cut in-flight streams after ``timeout_graceful_shutdown``.
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
        server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        if drain is not None:
            stopping: list[asyncio.Task[None]] = []  # (held: the loop keeps weak references)

            async def stop(drain: Callable[[], Awaitable[None]]) -> None:
                try:
                    await drain()
                finally:
                    server.should_exit = True

            def on_signal() -> None:
                if not stopping:  # else a second signal: the first drain is running
                    stopping.append(loop.create_task(stop(drain)))

            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, on_signal)
        # Awaited here, not in a task: what stops it from starting (a taken port: uvicorn
        # logs it and exits) goes up as it is, without "Task exception was never retrieved".
        announcing = None if on_started is None else loop.create_task(announce(on_started))
        try:
            await server.serve()
        finally:
            if announcing is not None and not announcing.done():
                announcing.cancel()
        if announcing is not None and announcing.done() and not announcing.cancelled():
            announcing.result()  # raises what on_started raised

    async def announce(on_started: Callable[[], None]) -> None:
        while not server.started:
            await asyncio.sleep(0.02)
        try:
            on_started()
        except BaseException:
            server.should_exit = True
            raise

    import uvloop

    # uvicorn's handler re-raises a SIGINT once the server has stopped (as uvicorn.run)
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(main())
    if not server.started:
        sys.exit(STARTUP_FAILURE)
