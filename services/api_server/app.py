"""The OpenAI-compatible HTTP app. ``build_app(frontend, settings)`` wires routes to an engine.

Each OpenAI route's logic is a serving class (``serving_completion``, ``serving_chat``,
``serving_tokenize``, over ``serving_base``); this module only wires routes to them, with
the middleware, the error handlers and the small routes (/health, /metrics, /v1/models).
Bodies are read and parsed by ``http_io`` (size cap, strict UTF-8 JSON) rather than by
FastAPI, so every bad input gets an OpenAI-shaped error with the right status.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.api_server.frontend import EngineFrontend, EngineRequestError
from services.api_server.http_io import (
    AccessLogMiddleware,
    APIError,
    AuthMiddleware,
    InternalErrorMiddleware,
    XRequestIdMiddleware,
    document_bodies,
    error_response,
    parse_body,
    read_json,
)
from services.api_server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ParamError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from services.api_server.serving_base import ServerSettings
from services.api_server.serving_chat import ChatServing
from services.api_server.serving_completion import CompletionServing
from services.api_server.serving_embeddings import (
    EmbeddingRequest,
    EmbeddingServing,
    PoolingRequest,
)
from services.api_server.serving_messages import (
    CountTokensRequest,
    MessagesRequest,
    MessagesServing,
)
from services.api_server.serving_messages import error_response as anthropic_error
from services.api_server.serving_responses import ResponsesServing
from services.api_server.serving_tokenize import TokenizeServing
from services.http.errors import add_error_handlers
from services.metrics.process_metrics import api_requests, engine_restarts
from services.metrics.registry import render_latest

__all__ = ["VERSION", "ServerSettings", "build_app"]

VERSION = "0.1.0"


def build_app(frontend: EngineFrontend, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving ``frontend``'s engine; starts and closes the frontend with the app."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await frontend.start()
        try:
            yield
        finally:
            await frontend.close()

    app = FastAPI(title="actorserve", version=VERSION, lifespan=lifespan)
    names = settings.served_model_names
    requests_sent = api_requests(names[0] if names else "")
    frontend.on_restarted = engine_restarts(names[0] if names else "")

    add_error_handlers(app)  # APIError as its OpenAI error, ClientGone as a 499

    @app.exception_handler(EngineRequestError)
    async def _engine_error(_: Request, e: EngineRequestError) -> JSONResponse:
        return error_response(e.status, e.message, e.error_type, e.param)

    @app.exception_handler(ParamError)
    async def _param_error(_: Request, e: ParamError) -> JSONResponse:
        return error_response(400, str(e), param=e.param)

    async def read_body(request: Request) -> Any:
        return await read_json(request, settings.limits.max_request_body_bytes)

    completions = CompletionServing(frontend, settings, on_sent=requests_sent.inc)
    chat = ChatServing(frontend, settings, on_sent=requests_sent.inc)
    messages = MessagesServing(frontend, settings, on_sent=requests_sent.inc)  # Anthropic's
    responses = ResponsesServing(frontend, settings, on_sent=requests_sent.inc)
    tokenization = TokenizeServing(frontend, settings)
    embeddings = EmbeddingServing(frontend, settings, on_sent=requests_sent.inc)

    def generation_only(api: str) -> None:
        """A --runner pooling server generates nothing: vLLM's 400 for its generate APIs."""
        if settings.runner == "pooling":
            raise APIError(400, f"The model does not support {api} API")

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        generation_only("Completions")
        req = parse_body(CompletionRequest, await read_body(request))
        return await completions.create_completion(req, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        generation_only("Chat Completions")
        req = parse_body(ChatCompletionRequest, await read_body(request))
        return await chat.create_chat_completion(req, request)

    @app.post("/v1/messages")
    async def create_message(request: Request) -> Response:
        if settings.runner == "pooling":  # Anthropic's error shape on Anthropic's route
            return anthropic_error(400, "The model does not support Messages API")
        return await messages.create_message(request, lambda: read_body(request))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: Request) -> Response:
        return await messages.count_tokens(lambda: read_body(request))

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        generation_only("Responses")
        return await responses.create(request, lambda: read_body(request))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return responses.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        return await responses.cancel(response_id)

    @app.post("/v1/embeddings")
    async def create_embedding(request: Request) -> Response:
        req = parse_body(EmbeddingRequest, await read_body(request))
        return await embeddings.create_embedding(req, request)

    @app.post("/pooling")
    async def create_pooling(request: Request) -> Response:
        req = parse_body(PoolingRequest, await read_body(request))
        return await embeddings.create_pooling(req, request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return await tokenization.tokenize(await read_body(request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = parse_body(DetokenizeRequest, await read_body(request))
        return await tokenization.detokenize(req)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        cards = [
            {
                "id": name,
                "object": "model",
                "created": settings.created,
                "owned_by": "actorserve",
                "root": settings.model_root or name,
                "parent": None,
                "max_model_len": frontend.max_model_len,
            }
            for name in names
        ]
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/health")
    async def health() -> Response:
        """200 (empty, as vLLM's) while the engine serves. Else 503 from the first moment
        (a drain, a dead or restarting engine), so that balancers stop sending here, with
        ``{"status": "draining" | "dead" | "restarting", "message": ...}``."""
        if (why := frontend.unavailable) is None:
            return Response(status_code=200)
        return JSONResponse({"status": frontend.status, "message": why}, status_code=503)

    @app.get("/load")
    async def load() -> JSONResponse:
        """This server's load as its front end sees it, for routers that poll often (the
        full ``/metrics`` merges every process's series). ``server_load`` is vLLM's field
        (requests in flight); waiting = no output yet (queued or in prefill). Engine
        requests only: a ``/tokenize`` call (a router's, say) is no load on the engine."""
        live, waiting = frontend.num_in_flight, frontend.num_waiting
        return JSONResponse({"server_load": live, "num_requests_waiting": waiting,
                             "num_requests_running": live - waiting})  # fmt: skip

    @app.get("/kv_events")
    async def kv_events() -> Response:
        if settings.kv_events is None:
            return error_response(
                404, "KV events are off: start the server with --kv-events-endpoint auto"
            )
        return JSONResponse(settings.kv_events)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": VERSION})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = render_latest()  # every process's series (multiprocess mode)
        return Response(body, media_type=content_type)

    document_bodies(
        app,
        {
            "/v1/completions": (CompletionRequest,),
            "/v1/chat/completions": (ChatCompletionRequest,),
            "/v1/messages": (MessagesRequest,),
            "/v1/messages/count_tokens": (CountTokensRequest,),
            "/v1/embeddings": (EmbeddingRequest,),
            "/pooling": (PoolingRequest,),
            "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest),
            "/detokenize": (DetokenizeRequest,),
        },
    )
    app.add_middleware(InternalErrorMiddleware)  # type: ignore[arg-type]
    if settings.api_key:
        app.add_middleware(AuthMiddleware, api_key=settings.api_key)  # type: ignore[arg-type]
    if settings.enable_request_id_headers:  # outermost: even a 401 carries the id
        app.add_middleware(XRequestIdMiddleware)  # type: ignore[arg-type]
    if settings.access_log:  # outside it: the line names the id the client got
        app.add_middleware(AccessLogMiddleware, skip_paths=settings.access_log_skip)  # type: ignore[arg-type]
    return app
