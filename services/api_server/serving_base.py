"""What every OpenAI endpoint does around the engine (vLLM's ``OpenAIServing``): the model
and admission checks, response and engine request ids, the n-choice fan-out, the
data-parallel rank a client pins, and answering streamed or whole with the client's
disconnect raced against the engine.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from services import clock
from services.api_server import choices
from services.api_server.frontend import EngineFrontend
from services.api_server.http_io import (
    APIError,
    BoundedStreamingResponse,
    ClientGone,
    prepend,
    until_disconnect,
)
from services.api_server.serving import Deltas, ResponseContext
from services.config import RequestLimits
from services.config.pooling import PoolerConfig
from services.http.errors import client_closed
from services.protocol import GenerateRequest, SamplingParams

# (engine request id, the choice's sampling parameters, prompt index) -> its engine request
MakeRequest = Callable[[str, SamplingParams, int], GenerateRequest]


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
    # the access log (a line per request; --disable-uvicorn-access-log), and paths without it
    access_log: bool = True
    access_log_skip: list[str] = field(default_factory=lambda: ["/health", "/load", "/metrics"])
    # --runner (resolved): "pooling" serves /v1/embeddings and /pooling instead of generation
    runner: str = "generate"
    pooler: PoolerConfig = field(default_factory=PoolerConfig)  # --pooler-config
    embedding_size: int | None = None  # the model's hidden size: the most ``dimensions``


class ServingBase:
    """The checks and plumbing shared by the serving classes of the OpenAI routes.

    Contract: built from an engine frontend (``EngineFrontend`` or anything with its
    ``generate``/``tokenize``/``detokenize``/``unavailable``) and the server's settings,
    both read at each call (a flag changed later applies to the next request).
    ``on_sent(num_requests)`` runs once a request group is on its way to the engine (the
    ``api_requests`` metric). A check that fails raises ``APIError``; an engine that
    rejects a request raises ``EngineRequestError`` (the app turns both into responses).
    """

    def __init__(
        self,
        frontend: EngineFrontend,
        settings: ServerSettings,
        *,
        on_sent: Callable[[int], object] | None = None,
    ) -> None:
        self.frontend = frontend
        self.settings = settings
        self.on_sent = on_sent

    def check_model(self, model: str | None) -> str:
        """The served name ``model`` asks for (the first one if none); a 404 if not served."""
        names = self.settings.served_model_names
        if model is None or model == self.settings.model_root:
            # The model's folder (``root`` in /v1/models) names it too: `vllm bench serve`
            # without --model sends that to /tokenize, as vLLM's own server is named by its path.
            return names[0]
        if model not in names:
            raise APIError(404, f"The model `{model}` does not exist.", "model")
        return model

    def check_sequences(self, num: int) -> None:
        most = self.settings.limits.max_sequences_per_request
        if num > most:
            raise APIError(
                400,
                f"This request makes {num} sequences (prompts x n); this server takes at most "
                f"{most} (--max-sequences-per-request).",
                "prompt",
            )

    def check_admission(self) -> None:
        """A 503 while the engine is down, restarting or the server drains."""
        if (why := self.frontend.unavailable) is not None:
            raise APIError(503, why)

    @staticmethod
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

    @staticmethod
    def response_ids(request: Request, prefix: str, body_id: str | None) -> tuple[str, str]:
        """(response id, engine request ids' base): vLLM's ``{prefix}-{id}``, the id taken from
        the X-Request-Id header, else the body's ``request_id``, else random. A client's id
        need not be unique, so its engine requests also get a random suffix."""
        given = request.headers.get("x-request-id") or body_id
        if not given:
            response_id = f"{prefix}-{uuid.uuid4().hex}"
            return response_id, response_id
        return f"{prefix}-{given}", f"{prefix}-{given}-{uuid.uuid4().hex[:8]}"

    def generate(
        self, ctx: ResponseContext, base_id: str, sampling: SamplingParams, make: MakeRequest
    ) -> Deltas:
        """The deltas of the response's ``ctx.num_choices`` engine requests (one per prompt
        and choice, ``make`` building each), with the 429 of ``--max-num-queued-reqs``."""
        reqs = [
            make(req_id, params, p)
            for req_id, p, params in choices.fan_out(base_id, ctx.num_prompts, sampling)
        ]
        return self.frontend.generate(
            reqs, max_waiting=self.settings.max_num_queued_reqs, on_sent=self.on_sent
        )

    async def respond(
        self,
        request: Request,
        stream: bool,
        deltas: Deltas,
        stream_fn: Callable[[Deltas], AsyncIterator[bytes]],
        full_fn: Callable[[Deltas], Awaitable[dict[str, Any]]],
    ) -> Response:
        """The whole response as JSON, or an SSE stream; a client that leaves first gets a
        499 and its engine requests are aborted."""
        try:
            if not stream:
                return JSONResponse(await until_disconnect(request, full_fn(deltas)))
            # Wait for the first delta so a rejected request still gets its 4xx status.
            first = await until_disconnect(request, anext(deltas))
        except ClientGone:
            return client_closed()
        return BoundedStreamingResponse(
            stream_fn(prepend(first, deltas)), self.settings.limits.stream_send_timeout
        )
