"""``actorserve pd-proxy``: prefill on one instance, generate on another (the seeds' six steps).

1. The client's request reaches the proxy.
2. The proxy sends it to a prefill instance (chosen by ``--prefill-policy``, prefix-aware
   ``cost`` by default) with ``max_tokens`` 1, not streamed, and
   ``kv_transfer_params: {"do_remote_decode": true}``.
3. The prefill instance computes the prompt, samples one token and answers with
   ``kv_transfer_params`` naming where it holds the prompt's KV blocks.
4. The proxy drops that token and sends the original request, with those params, to a
   decode instance (``--decode-policy``, by load).
5. The decode instance pulls the KV from the prefill instance's workers (never through
   the proxy; ``services/kv_transfer/p2p/``) and generates.
6. Its answer streams back through the proxy as it comes.

Each side is a ``Router`` over its instances: health checks, load readings, retries on
another instance before the first byte, exactly as ``actorserve router``; and the process
is the router's (``services/router/process.py``: log format, access log, drain on SIGTERM).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from services.http.errors import add_error_handlers, error_response
from services.logging_utils import configure_process_logging
from services.router.config import RouterConfig
from services.router.discovery import discovering
from services.router.forward import parse_object
from services.router.process import RouterApp, add_ops, serve, use_uvicorn_logging
from services.router.router import Router

log = logging.getLogger(__name__)

_CHAT = {"/v1/completions": False, "/v1/chat/completions": True}


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The request the prefill instance gets: one token, whole, holding the KV for a pull."""
    pre = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    pre.update(max_tokens=1, stream=False, n=1)
    if chat and "max_completion_tokens" in body:
        pre["max_completion_tokens"] = 1
    pre["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return pre


class PDProxy:
    def __init__(self, prefill: Router, decode: Router) -> None:
        self.prefill = prefill
        self.decode = decode

    async def generate(self, request: Request, path: str) -> Response:
        arrived = time.perf_counter()
        raw = await self.decode._read_body(request)
        if isinstance(raw, Response):
            return raw
        body = parse_object(raw)
        if not body:  # not a JSON object: the decode instance answers with its own error
            return await self.decode.route(request, path, raw, body, arrived)
        pre = prefill_body(body, _CHAT[path])
        answer = await self.prefill.route(request, path, json.dumps(pre).encode(), pre, arrived)
        content = await _read(answer)
        if answer.status_code != 200:  # the request's own error (400 ...), or 503: pass it on
            return Response(content, answer.status_code, media_type="application/json")
        params = parse_object(content).get("kv_transfer_params")
        if not isinstance(params, dict):
            return error_response(
                502,
                "the prefill instance returned no kv_transfer_params: start it with "
                '--kv-transfer-config \'{"kv_connector": "p2p", "kv_role": "kv_producer"}\'',
                "BadGatewayError",
            )
        decode = {**body, "kv_transfer_params": params}
        return await self.decode.route(request, path, json.dumps(decode).encode(), decode, arrived)


async def _read(response: Response) -> bytes:
    """A (streaming) response's whole body; the router's bookkeeping for it (its close
    hook) runs once it is read."""
    iterator = getattr(response, "body_iterator", None)
    if iterator is None:
        return bytes(response.body)
    chunks = [c if isinstance(c, bytes) else str(c).encode() async for c in iterator]
    if response.background is not None:
        await response.background()
    return b"".join(chunks)


def build_pd_app(prefill: RouterConfig, decode: RouterConfig) -> FastAPI:
    state: dict[str, PDProxy] = {}
    # The log names each side's instances (unless the configs name them already).
    if prefill.role == "backend":
        prefill = dataclasses.replace(prefill, role="prefill")
    if decode.role == "backend":
        decode = dataclasses.replace(decode, role="decode")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        use_uvicorn_logging()
        async with Router.new_client() as pc, Router.new_client() as dc:
            proxy = state["proxy"] = PDProxy(Router(prefill, pc), Router(decode, dc))
            sides = (proxy.prefill, proxy.decode)
            try:
                for router, config in zip(sides, (prefill, decode), strict=True):
                    for url in config.backends:
                        await router.add_replica(url)
                async with (
                    discovering(prefill.discovery, proxy.prefill, "prefill"),
                    discovering(decode.discovery, proxy.decode, "decode"),
                ):
                    yield
            finally:
                for router in sides:
                    await router.replicas.close()
                    await router.follower.close()

    app = RouterApp(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    add_ops(app, decode, "PD proxy", lambda r, p: state["proxy"].generate(r, p))

    @app.get("/health")
    async def health() -> Response:
        proxy = state["proxy"]
        p, d = len(proxy.prefill.replicas.healthy()), len(proxy.decode.replicas.healthy())
        if not (p and d):
            return error_response(
                503, f"healthy instances: {p} prefill, {d} decode", "ServiceUnavailableError"
            )
        return JSONResponse({"status": "ok", "healthy_prefill": p, "healthy_decode": d})

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def other(request: Request, path: str) -> Response:
        """/v1/models, /tokenize ...: a decode instance answers."""
        return await state["proxy"].decode.passthrough(request, "/" + path)

    return app


def run_pd_proxy(prefill: RouterConfig, decode: RouterConfig) -> int:
    """Serve until SIGTERM has drained it; the process's settings (host, port, drain, access
    log) are ``decode``'s."""
    configure_process_logging()
    app = build_pd_app(prefill, decode)
    details = (f"prefill: {len(prefill.backends)} ({prefill.policy}), "
               f"decode: {len(decode.backends)} ({decode.policy})")  # fmt: skip
    for side, config in (("prefill", prefill), ("decode", decode)):
        if config.discovery is not None:
            details += f", discovering {side} {config.discovery.describe()}"
    return serve(app, decode, "PD proxy", details)
