"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's ``OpenAIServingTokenization``): both
go through the tokenizer processes, so the api_server never loads a tokenizer."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi.responses import JSONResponse

from services.api_server.http_io import parse_body
from services.api_server.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    check_template_trust,
)
from services.api_server.serving_base import ServingBase
from services.protocol import DetokenizeRequest as EngineDetokenizeRequest
from services.protocol import TokenizeRequest


class TokenizeServing(ServingBase):
    """Serves ``/tokenize`` (a prompt, or chat messages through the chat template) and
    ``/detokenize``."""

    async def tokenize(self, body: Any) -> JSONResponse:
        """``body``: the request's JSON, a chat request if it has ``messages``."""
        req_id = f"tok-{uuid.uuid4().hex}"
        if isinstance(body, dict) and "messages" in body:
            chat = parse_body(TokenizeChatRequest, body)
            self.check_model(chat.model)
            check_template_trust(None, chat.chat_template_kwargs, self.settings.limits)
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
            self.check_model(plain.model)
            engine_req = TokenizeRequest(
                req_id,
                prompt=plain.prompt,
                add_special_tokens=plain.add_special_tokens,
                return_token_strs=plain.return_token_strs,
            )
        self.check_admission()
        result = await self.frontend.tokenize(engine_req)
        return JSONResponse(
            {
                "count": len(result.token_ids),
                "max_model_len": result.max_model_len,
                "tokens": result.token_ids,
                "token_strs": result.token_strs,
            }
        )

    async def detokenize(self, req: DetokenizeRequest) -> JSONResponse:
        self.check_model(req.model)
        self.check_admission()
        result = await self.frontend.detokenize(
            EngineDetokenizeRequest(f"detok-{uuid.uuid4().hex}", req.tokens)
        )
        return JSONResponse({"prompt": result.text})
