"""The OpenAI-compatible HTTP app. ``build_app(frontend, settings)`` wires routes to an engine.

Bodies are read and parsed by ``http_io`` (size cap, strict UTF-8 JSON) rather than by
FastAPI, so every bad input gets an OpenAI-shaped error with the right
status. ``/tokenize`` and ``/detokenize`` go through the tokenizer processes:
the api_server never loads a tokenizer.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services import clock
from services.api_server import choices, serving
from services.api_server.frontend import EngineFrontend, EngineRequestError
from services.api_server.http_io import (
    APIError,
    AuthMiddleware,
    BoundedStreamingResponse,
    ClientGone,
    InternalErrorMiddleware,
    XRequestIdMiddleware,
    document_bodies,
    error_response,
    parse_body,
    prepend,
    read_json,
    until_disconnect,
    validate_sampling,
)
from services.api_server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ParamError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    check_template_trust,
)
from services.api_server.tool_calls import ToolCalling
from services.config import RequestLimits
from services.metrics.process_metrics import api_requests, engine_restarts
from services.metrics.registry import render_latest
from services.protocol import DetokenizeRequest as EngineDetokenizeRequest
from services.protocol import GenerateRequest, SamplingParams, TokenizeRequest

VERSION = "0.1.0"


@dataclass
class ServerSettings:
    """The api_server's own flags (vLLM's names where vLLM has them)."""

    served_model_names: list[str]
    model_root: str | None = None
    api_key: str | None = None
    max_num_queued_reqs: int | None = None  # None: no limit; over it new requests get 429
    limits: RequestLimits = field(default_factory=RequestLimits)
    enable_request_id_headers: bool = False
    # --tool-call-parser when --enable-auto-tool-choice is on (tool_choice "auto"), else None
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    created: int = field(default_factory=lambda: int(clock.wall()))
    # ``GET /kv_events``: the engine cores' KV event sockets, and what their hashes depend on
    kv_events: dict[str, Any] | None = None


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

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, param=e.param)

    @app.exception_handler(EngineRequestError)
    async def _engine_error(_: Request, e: EngineRequestError) -> JSONResponse:
        return error_response(e.status, e.message, e.error_type, e.param)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; no one reads it

    @app.exception_handler(ParamError)
    async def _param_error(_: Request, e: ParamError) -> JSONResponse:
        return error_response(400, str(e), param=e.param)

    async def read_body(request: Request) -> Any:
        return await read_json(request, settings.limits.max_request_body_bytes)

    def check_model(model: str | None) -> str:
        if model is None or model == settings.model_root:
            # The model's folder (``root`` in /v1/models) names it too: `vllm bench serve`
            # without --model sends that to /tokenize, as vLLM's own server is named by its path.
            return names[0]
        if model not in names:
            raise APIError(404, f"The model `{model}` does not exist.", "model")
        return model

    def check_sequences(num: int) -> None:
        most = settings.limits.max_sequences_per_request
        if num > most:
            raise APIError(
                400,
                f"This request makes {num} sequences (prompts x n); this server takes at most "
                f"{most} (--max-sequences-per-request).",
                "prompt",
            )

    def check_admission() -> None:
        if (why := frontend.unavailable) is not None:
            raise APIError(503, why)

    def pinned_rank(request: Request) -> int | None:
        """vLLM's ``X-data-parallel-rank`` header: run on that engine core (the tokenizer
        checks the range, as it knows how many there are)."""
        value = request.headers.get("x-data-parallel-rank")
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            raise APIError(
                400,
                f"X-data-parallel-rank must be an integer, got {value!r}",
                "X-data-parallel-rank",
            ) from None

    def response_ids(request: Request, prefix: str, body_id: str | None) -> tuple[str, str]:
        """(response id, engine request ids' base): vLLM's ``{prefix}-{id}``, the id taken from
        the X-Request-Id header, else the body's ``request_id``, else random. A client's id
        need not be unique, so its engine requests also get a random suffix."""
        given = request.headers.get("x-request-id") or body_id
        if not given:
            response_id = f"{prefix}-{uuid.uuid4().hex}"
            return response_id, response_id
        return f"{prefix}-{given}", f"{prefix}-{given}-{uuid.uuid4().hex[:8]}"

    def fan_out(
        ctx: serving.ResponseContext,
        base_id: str,
        sampling: SamplingParams,
        make: Callable[[str, SamplingParams, int], GenerateRequest],
    ) -> list[GenerateRequest]:
        return [
            make(req_id, params, p)
            for req_id, p, params in choices.fan_out(base_id, ctx.num_prompts, sampling)
        ]

    async def respond(
        request: Request,
        stream: bool,
        deltas: serving.Deltas,
        stream_fn: Callable[[serving.Deltas], AsyncIterator[bytes]],
        full_fn: Callable[[serving.Deltas], Awaitable[dict[str, Any]]],
    ) -> Response:
        try:
            if not stream:
                return JSONResponse(await until_disconnect(request, full_fn(deltas)))
            # Wait for the first delta so a rejected request still gets its 4xx status.
            first = await until_disconnect(request, anext(deltas))
        except ClientGone:
            return Response(status_code=499)
        return BoundedStreamingResponse(
            stream_fn(prepend(first, deltas)), settings.limits.stream_send_timeout
        )

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        req = parse_body(CompletionRequest, await read_body(request))
        model = check_model(req.model)
        req.check(settings.limits)
        prompts = req.prompts()
        check_sequences(len(prompts) * req.n)
        if req.kv_transfer_params and len(prompts) != 1:
            raise ParamError("kv_transfer_params", "kv_transfer_params works with one prompt only.")
        sampling = req.completion_sampling_params()
        validate_sampling(sampling, settings.limits.max_logprobs)
        check_admission()
        response_id, base_id = response_ids(request, "cmpl", req.request_id)
        ctx = serving.ResponseContext(
            response_id,
            int(clock.wall()),
            model,
            req.n,
            len(prompts),
            echo=req.echo,
            echo_only=req.echo_only,
            num_logprobs=req.logprobs,
            return_token_ids=req.return_token_ids,
        )
        now = clock.wall()
        dp_rank = pinned_rank(request)

        def make(req_id: str, sub: SamplingParams, p: int) -> GenerateRequest:
            prompt = prompts[p]
            return GenerateRequest(
                req_id,
                sub,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=prompt if isinstance(prompt, list) else None,
                add_special_tokens=req.add_special_tokens,
                arrival_time=now,
                priority=req.priority,
                cache_salt=req.cache_salt,
                data_parallel_rank=dp_rank,
                echo=req.echo,
                return_token_ids=req.return_token_ids,
                kv_transfer_params=req.kv_transfer_params,
            )

        want_lp = req.logprobs is not None
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return await respond(
            request,
            req.stream,
            frontend.generate(
                fan_out(ctx, base_id, sampling, make),
                max_waiting=settings.max_num_queued_reqs,
                on_sent=requests_sent.inc,
            ),
            lambda d: serving.completion_stream(ctx, d, want_logprobs=want_lp, include_usage=usage),
            lambda d: serving.completion_full(ctx, d, want_logprobs=want_lp),
        )

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, await read_body(request))
        model = check_model(req.model)
        req.check(settings.limits, settings.tool_call_parser)
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        sampling = req.sampling_params(max_tokens, req.num_logprobs, req.prompt_logprobs)
        validate_sampling(sampling, settings.limits.max_logprobs)
        tools = None
        if req.tool_choice != "none":
            tools = ToolCalling(
                req.forced_tool, settings.tool_call_parser, req.parallel_tool_calls is not False
            )
            sampling = tools.sampling(sampling)
        check_admission()
        response_id, base_id = response_ids(request, "chatcmpl", req.request_id)
        ctx = serving.ResponseContext(
            response_id, int(clock.wall()), model, req.n, return_token_ids=req.return_token_ids
        )
        messages = [m.to_template() for m in req.messages]
        now = clock.wall()
        dp_rank = pinned_rank(request)

        def make(req_id: str, sub: SamplingParams, p: int) -> GenerateRequest:
            return GenerateRequest(
                req_id,
                sub,
                messages=messages,
                chat_template=req.template(),
                chat_template_kwargs=req.template_kwargs(
                    settings.exclude_tools_when_tool_choice_none
                ),
                add_generation_prompt=req.add_generation_prompt,
                add_special_tokens=req.add_special_tokens,
                arrival_time=now,
                priority=req.priority,
                cache_salt=req.cache_salt,
                data_parallel_rank=dp_rank,
                return_token_ids=req.return_token_ids,
                kv_transfer_params=req.kv_transfer_params,
            )

        want_lp = req.logprobs
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return await respond(
            request,
            req.stream,
            frontend.generate(
                fan_out(ctx, base_id, sampling, make),
                max_waiting=settings.max_num_queued_reqs,
                on_sent=requests_sent.inc,
            ),
            lambda d: serving.chat_stream(
                ctx, d, want_logprobs=want_lp, include_usage=usage, tools=tools
            ),
            lambda d: serving.chat_full(ctx, d, want_logprobs=want_lp, tools=tools),
        )

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await read_body(request)
        req_id = f"tok-{uuid.uuid4().hex}"
        if isinstance(body, dict) and "messages" in body:
            chat = parse_body(TokenizeChatRequest, body)
            check_model(chat.model)
            check_template_trust(None, chat.chat_template_kwargs, settings.limits)
            engine_req = TokenizeRequest(
                req_id,
                messages=[m.to_template() for m in chat.messages],
                add_special_tokens=chat.add_special_tokens,
                add_generation_prompt=chat.add_generation_prompt,
                chat_template_kwargs=chat.template_kwargs(),
                return_token_strs=chat.return_token_strs,
            )
        else:
            plain = parse_body(TokenizeCompletionRequest, body)
            check_model(plain.model)
            engine_req = TokenizeRequest(
                req_id,
                prompt=plain.prompt,
                add_special_tokens=plain.add_special_tokens,
                return_token_strs=plain.return_token_strs,
            )
        check_admission()
        result = await frontend.tokenize(engine_req)
        return JSONResponse(
            {
                "count": len(result.token_ids),
                "max_model_len": result.max_model_len,
                "tokens": result.token_ids,
                "token_strs": result.token_strs,
            }
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = parse_body(DetokenizeRequest, await read_body(request))
        check_model(req.model)
        check_admission()
        result = await frontend.detokenize(
            EngineDetokenizeRequest(f"detok-{uuid.uuid4().hex}", req.tokens)
        )
        return JSONResponse({"prompt": result.text})

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
        return Response(status_code=503 if frontend.errored else 200)

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
            "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest),
            "/detokenize": (DetokenizeRequest,),
        },
    )
    app.add_middleware(InternalErrorMiddleware)  # type: ignore[arg-type]
    if settings.api_key:
        app.add_middleware(AuthMiddleware, api_key=settings.api_key)  # type: ignore[arg-type]
    if settings.enable_request_id_headers:  # outermost: even a 401 carries the id
        app.add_middleware(XRequestIdMiddleware)  # type: ignore[arg-type]
    return app
