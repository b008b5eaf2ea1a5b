"""A request's prompt as token ids, for the policies that score by cache.

Two ways, the same result as the replica's own tokenizer process:

- ``--tokenizer MODEL`` (a model folder or GGUF file, as ``serve`` takes): tokenized in the
  router with the engine's own code (``RequestProcessor``: chat template, special tokens),
  no round trip;
- otherwise each request's prompt goes to a healthy replica's ``POST /tokenize`` (ours and
  vLLM's take a completion prompt or chat messages), one extra round trip per request.

A prompt that cannot be tokenized (bad messages, a replica that cannot say) yields
``None``: the request is routed on load alone and the replica answers it, error included.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pydantic

from services.router.replicas import Replica

log = logging.getLogger(__name__)

# Fields of a chat request that change its prompt (vLLM's /tokenize takes them all).
_CHAT_FIELDS = ("add_generation_prompt", "add_special_tokens", "chat_template_kwargs",
                "continue_final_message", "chat_template", "tools", "documents")  # fmt: skip


def _first_prompt(body: dict[str, Any]) -> str | list[int] | None:
    """A completion's prompt: a string, token ids, or the first of several (all of them go
    to the same replica, and the first shares the most with later requests)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return prompt
        first = prompt[0]
        if isinstance(first, str) or (
            isinstance(first, list) and all(isinstance(t, int) for t in first)
        ):
            return first
    return None


class PromptTokenizer:
    """Token ids of a completions or chat request's prompt (``None`` when unknown)."""

    def __init__(self, tokenizer: str | None = None) -> None:
        self._processor = None
        if tokenizer is not None:
            from services.tokenizer.loader import load_serving_tokenizer
            from services.tokenizer.processor import RequestProcessor

            self._processor = RequestProcessor(load_serving_tokenizer(tokenizer), 1 << 31)

    async def token_ids(
        self, chat: bool, body: dict[str, Any], via: Replica | None
    ) -> list[int] | None:
        """Tokenized here with ``--tokenizer``, else by replica ``via`` (None: unknown)."""
        if not chat:
            prompt = _first_prompt(body)
            if prompt is None or isinstance(prompt, list):
                return prompt
        elif not isinstance(body.get("messages"), list):
            return None
        if self._processor is not None:
            return await asyncio.to_thread(self._local, chat, body)
        if via is None or via.client is None or via.client.is_closed:
            return None
        return await self._remote(chat, body, via.client, via.url)

    def _local(self, chat: bool, body: dict[str, Any]) -> list[int] | None:
        from services.api_server.protocol import ChatMessage
        from services.protocol import TokenizeRequest
        from services.tokenizer.processor import PromptError

        assert self._processor is not None
        try:
            if chat:
                messages = [ChatMessage.model_validate(m).to_template() for m in body["messages"]]
                req = TokenizeRequest(
                    "router",
                    messages=messages,
                    add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                    add_special_tokens=bool(body.get("add_special_tokens", False)),
                    chat_template_kwargs=dict(body.get("chat_template_kwargs") or {}),
                )
            else:
                req = TokenizeRequest(
                    "router",
                    prompt=body["prompt"] if isinstance(body["prompt"], str) else body["prompt"][0],
                    add_special_tokens=bool(body.get("add_special_tokens", True)),
                )
            return self._processor.prompt_ids(req)[0]
        except (pydantic.ValidationError, PromptError, TypeError, ValueError):
            return None

    @staticmethod
    async def _remote(chat: bool, body: dict[str, Any], client: httpx.AsyncClient,
                      replica_url: str) -> list[int] | None:  # fmt: skip
        if chat:
            payload = {
                "messages": body["messages"],
                **{k: body[k] for k in _CHAT_FIELDS if k in body},
            }
        else:
            payload = {
                "prompt": _first_prompt(body),
                "add_special_tokens": body.get("add_special_tokens", True),
            }
        if "model" in body:
            payload["model"] = body["model"]
        try:
            r = await client.post(f"{replica_url}/tokenize", json=payload, timeout=10.0)
            if r.status_code != 200:
                return None
            tokens = r.json().get("tokens")
        except (httpx.HTTPError, ValueError, AttributeError, RuntimeError):  # (closed pool)
            return None
        return tokens if isinstance(tokens, list) else None
