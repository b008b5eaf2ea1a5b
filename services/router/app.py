"""``actorserve router``: an OpenAI-compatible front for several replicas (ours or vLLM's).

Routes ``POST /v1/completions`` and ``/v1/chat/completions`` by ``--policy``
(``services/router/policies.py``), streams the replica's answer through unchanged, and
passes every other path (``/v1/models``, ``/tokenize``, ``/version``, ...) to the least busy
healthy replica. A request moves to another replica only before its first byte reached the
client: a refused connection, a 5xx answer or a connection lost before the first byte. After
that, a replica that dies ends a stream with an OpenAI error event and ``[DONE]``, never a hang.

Its own routes: ``/health`` (200 while a replica is healthy and the router is not
draining), ``/metrics`` (the router's, ``services/router/metrics.py``), and with
``--api-key`` the admin endpoint ``/admin/backends`` (``GET`` lists the replicas with what
the router knows of them, ``POST {"url": ...}`` adds one, ``DELETE {"url": ...}`` removes
one; ``Authorization: Bearer KEY``). Clients' ``Authorization`` headers pass through to
the replicas.

The process (``run_router``, ``services/router/process.py``): the servers' log format, a
line per request (``--disable-uvicorn-access-log``), and a drain on SIGTERM.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from services.http.errors import add_error_handlers, error_response
from services.logging_utils import configure_process_logging
from services.router.config import RouterConfig
from services.router.discovery import discovering
from services.router.policies import POLICIES
from services.router.process import RouterApp, add_ops, serve, use_uvicorn_logging
from services.router.replicas import check_url, normalize_url
from services.router.router import Router

__all__ = ["Router", "RouterConfig", "build_app", "run_router"]

log = logging.getLogger(__name__)


def build_app(config: RouterConfig) -> FastAPI:
    if config.policy not in POLICIES:
        raise ValueError(f"unknown policy {config.policy!r}")
    state: dict[str, Router] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        use_uvicorn_logging()
        async with Router.new_client() as client:
            router = state["router"] = Router(config, client)
            try:
                for url in config.backends:
                    await router.add_replica(url)
                if router.refused:
                    # Started with replicas whose hashes differ: no index could serve them all.
                    why = "; ".join(f"{u}: {w}" for u, w in router.refused.items())
                    log.error("refusing to start: %s", why)
                    raise RuntimeError(why)
                async with discovering(config.discovery, router, config.role):
                    yield
            finally:
                await router.replicas.close()
                await router.follower.close()

    app = RouterApp(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    add_ops(app, config, "router", lambda r, p: state["router"].generate(r, p))

    def admin_denied(request: Request) -> Response | None:
        if config.api_key is None:
            return error_response(403, "start the router with --api-key to use /admin",
                                  "PermissionDeniedError")  # fmt: skip
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {config.api_key}".encode()):
            return error_response(401, "Unauthorized", "AuthenticationError")
        return None

    async def admin_target(request: Request) -> str | Response:
        """The replica URL an admin request names, or the response refusing it."""
        if (denied := admin_denied(request)) is not None:
            return denied
        try:
            body = await request.json()
            return check_url(normalize_url(str(body["url"])))
        except (ValueError, KeyError, TypeError):
            return error_response(
                400, 'the body must be {"url": "http://host:port"}', "BadRequestError"
            )

    @app.get("/health")
    async def health() -> Response:
        n = len(state["router"].replicas.healthy())
        if n == 0:
            return error_response(503, "no healthy replica", "ServiceUnavailableError")
        return JSONResponse({"status": "ok", "healthy_replicas": n})

    @app.get("/metrics")
    async def metrics() -> Response:
        router = state["router"]
        router.refresh_gauges()
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/admin/backends")
    async def list_backends(request: Request) -> Response:
        return admin_denied(request) or JSONResponse({"backends": state["router"].describe()})

    @app.post("/admin/backends")
    async def add_backend(request: Request) -> Response:
        url = await admin_target(request)
        if isinstance(url, Response):
            return url
        router = state["router"]
        replica = await router.add_replica(url)
        if url in router.refused:
            await router.remove_replica(url)
            return error_response(
                400, f"{url} refused: {router.refused.pop(url)}", "BadRequestError"
            )
        return JSONResponse({"url": replica.url, "healthy": replica.healthy})

    @app.delete("/admin/backends")
    async def remove_backend(request: Request) -> Response:
        url = await admin_target(request)
        if isinstance(url, Response):
            return url
        if not await state["router"].remove_replica(url):
            return error_response(404, f"no backend {url}", "NotFoundError")
        return JSONResponse({"url": url, "removed": True})

    @app.api_route("/admin/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def admin_other(request: Request, rest: str) -> Response:
        """/admin is the router's own: never passed on to a replica."""
        if (denied := admin_denied(request)) is not None:
            return denied
        if rest == "backends":
            response = error_response(405, f"{request.method} is not allowed on "
                                      "/admin/backends", "MethodNotAllowedError")  # fmt: skip
            response.headers["allow"] = "GET, POST, DELETE"
            return response
        return error_response(404, f"no admin endpoint /admin/{rest}", "NotFoundError")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def other(request: Request, path: str) -> Response:
        return await state["router"].passthrough(request, "/" + path)

    return app


def run_router(config: RouterConfig) -> int:
    configure_process_logging()
    app = build_app(config)
    n = len(config.backends)
    details = f"policy {config.policy}, {n} backend{'s' * (n != 1)}"
    if config.discovery is not None:
        details += f", discovering {config.discovery.describe()}"
    return serve(app, config, "router", details)
