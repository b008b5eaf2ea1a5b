"""``POST /v1/embeddings`` (OpenAI's, vLLM's ``OpenAIServingEmbedding``) and vLLM's
``POST /pooling``: inputs in, one pooled vector per input out.

Each input becomes one engine request with ``pooling`` set (``services/protocol.py:
PoolingParams``): the tokenizer tokenizes and truncates it, the scheduler runs its prompt
(prefill only, chunked like any prompt) and finishes it in the step that computes its end,
the worker pools the final norm's hidden states (``services/gpu_worker/pooler.py``), and
the vector comes back as raw float32 bytes on the request's one final delta (the
detokenizer passes them on undecoded). Served only with ``--runner pooling``; a generate
server answers these routes, and a pooling server the generate routes, with vLLM's 400.
"""

from __future__ import annotations

import array
import base64
import sys
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from services import clock
from services.api_server.http_io import APIError
from services.api_server.protocol import OpenAIBaseModel, ParamError, TokenIds
from services.api_server.serving import Deltas, ResponseContext, check_error
from services.api_server.serving_base import ServingBase
from services.protocol import GenerateRequest, PoolingParams, SamplingParams

_Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]


class EmbeddingRequest(OpenAIBaseModel):
    """OpenAI's embeddings body with vLLM's extras (``truncate_prompt_tokens``,
    ``add_special_tokens``, ``priority``, ``request_id``, ``normalize`` / its new name
    ``use_activation``)."""

    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: _Int64 | None = None
    user: str | None = None
    truncate_prompt_tokens: _Int64 | None = None
    add_special_tokens: bool = True
    priority: _Int64 = 0
    request_id: str | None = None
    normalize: bool | None = None
    use_activation: bool | None = None

    def inputs(self) -> list[str | list[int]]:
        """The batch: each input a string or a list of token ids."""
        x = self.input
        if isinstance(x, str):
            return [x]
        if not x:
            raise ParamError("input", "input must not be empty.")
        if all(isinstance(t, int) for t in x):
            return [list(x)]  # type: ignore[arg-type]
        return list(x)  # type: ignore[arg-type]


class PoolingRequest(EmbeddingRequest):
    """vLLM's ``/pooling`` body: an embeddings body and the pooling ``task``; this server
    pools one vector per input (``embed``), not per token (``encode``, ``token_embed``)."""

    task: str | None = None


def _floats(data: bytes) -> list[float]:
    values = array.array("f")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()  # the worker sends little-endian float32
    return values.tolist()


class EmbeddingServing(ServingBase):
    """Serves ``/v1/embeddings`` and ``/pooling``: one engine request per input."""

    async def create_embedding(self, req: EmbeddingRequest, request: Request) -> Response:
        return await self._pool(req, request, "embd", "embedding", "embedding")

    async def create_pooling(self, req: PoolingRequest, request: Request) -> Response:
        if req.task not in (None, "embed"):
            raise ParamError(
                "task", f"Task {req.task} is not supported; this server pools with task embed."
            )
        return await self._pool(req, request, "pool", "pooling", "data")

    def pooling_params(self, req: EmbeddingRequest) -> PoolingParams:
        """The request's pooling: the server's ``--pooler-config``, with the request's
        ``dimensions`` and ``normalize`` (``use_activation``) where it gives them."""
        pooler = self.settings.pooler
        dims = req.dimensions if req.dimensions is not None else pooler.dimensions
        if dims is not None and dims < 1:
            raise ParamError("dimensions", "Dimensions must be greater than 0")
        size = self.settings.embedding_size
        if dims is not None and size is not None and dims > size:
            raise ParamError(
                "dimensions", f"dimensions must be at most the model's hidden size ({size})"
            )
        keep = req.truncate_prompt_tokens
        if keep is not None and keep < 1 and keep != -1:
            raise ParamError(
                "truncate_prompt_tokens", "truncate_prompt_tokens must be -1 or at least 1"
            )
        normalize = req.use_activation if req.use_activation is not None else req.normalize
        return PoolingParams(
            pooling_type=pooler.pooling_type,
            normalize=pooler.normalize if normalize is None else normalize,
            dimensions=dims,
            truncate_prompt_tokens=keep,
        )

    async def _pool(
        self, req: EmbeddingRequest, request: Request, prefix: str, obj: str, field: str
    ) -> Response:
        if self.settings.runner != "pooling":
            raise APIError(400, "The model does not support Embeddings API")
        model = self.check_model(req.model)
        inputs = req.inputs()
        self.check_sequences(len(inputs))
        pooling = self.pooling_params(req)
        self.check_admission()
        response_id, base_id = self.response_ids(request, prefix, req.request_id)
        ctx = ResponseContext(response_id, int(clock.wall()), model, 1, len(inputs))
        now = clock.wall()
        dp_rank = self.pinned_rank(request)

        def make(req_id: str, sampling: SamplingParams, p: int) -> GenerateRequest:
            x = inputs[p]
            return GenerateRequest(
                req_id,
                sampling,
                prompt=x if isinstance(x, str) else None,
                prompt_token_ids=x if isinstance(x, list) else None,
                add_special_tokens=req.add_special_tokens,
                arrival_time=now,
                priority=req.priority,
                data_parallel_rank=dp_rank,
                pooling=pooling,
            )

        async def full(deltas: Deltas) -> dict[str, Any]:
            vectors: list[bytes] = [b""] * ctx.num_prompts
            num_tokens = [0] * ctx.num_prompts
            async for index, delta in deltas:
                check_error(delta)
                vectors[index] = delta.pooled
                num_tokens[index] = delta.num_prompt_tokens
            b64 = req.encoding_format == "base64"
            data = [
                {
                    "index": i,
                    "object": obj,
                    field: base64.b64encode(v).decode() if b64 else _floats(v),
                }
                for i, v in enumerate(vectors)
            ]
            prompt_tokens = sum(num_tokens)
            return {
                "id": ctx.id,
                "object": "list",
                "created": ctx.created,
                "model": ctx.model,
                "data": data,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "total_tokens": prompt_tokens,
                    "completion_tokens": 0,
                    "prompt_tokens_details": None,
                },
            }

        sampling = SamplingParams(max_tokens=1)  # never sampled: the prompt ends the request
        deltas = self.generate(ctx, base_id, sampling, make)
        return await self.respond(request, False, deltas, _no_stream, full)


def _no_stream(deltas: Deltas) -> Any:
    raise AssertionError("embeddings are never streamed")
