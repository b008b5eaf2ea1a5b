"""A request's prompt as its token count and block hashes, for the policies that score by
cache.

Two ways, the same tokens as the replica's own tokenizer process:

- ``--tokenizer MODEL`` (a model folder or GGUF file, as ``serve`` takes): tokenized in the
  router with the engine's own code (``RequestProcessor``: chat template, special tokens),
  no round trip, and only past the longest prefix already seen (``prompt_cache.py``: the
  token ids and block hashes of earlier prompts' segments);
- otherwise each request's prompt goes to a healthy replica's ``POST /tokenize`` (ours and
  vLLM's take a completion prompt or chat messages), one extra round trip per request.

A prompt that cannot be tokenized (bad messages, a replica that cannot say) yields no
tokens: the request is routed on load alone and the replica answers it, error included.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import httpx
import pydantic

from services.kv_cache.block_hash import BlockHasher
from services.protocol import BlockHash
from services.router.prompt_cache import PrefixTokenCache
from services.router.replicas import Replica

log = logging.getLogger(__name__)

# A prompt with more new text than this is tokenized in a thread (the event loop goes on).
INLINE_CHARS = 4096

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
    """A completions or chat request's prompt as its token count and block hashes."""

    def __init__(self, tokenizer: str | None = None) -> None:
        self._processor = None
        self._cache: PrefixTokenCache | None = None
        if tokenizer is not None:
            # (a router process) One prompt at a time on the calling thread: HF tokenizers'
            # rayon pool would spread each over the cores, then spin waiting for more.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            from services.tokenizer.loader import load_serving_tokenizer
            from services.tokenizer.processor import RequestProcessor

            info = load_serving_tokenizer(tokenizer)
            self._processor = RequestProcessor(info, 1 << 31)
            self._cache = PrefixTokenCache(info)

    async def prompt_blocks(self, chat: bool, body: dict[str, Any], via: Replica | None,
                            hasher: BlockHasher, salt: str | None) -> tuple[int, list[BlockHash]]:  # fmt: skip
        """The prompt's token count and its full blocks' hashes; (0, []) when unknown.
        Tokenized here with ``--tokenizer`` (``PrefixTokenCache``: only past the longest
        prefix it knows, in a thread when that is long), else by replica ``via``."""
        if not chat:
            prompt = _first_prompt(body)
            if prompt is None:
                return 0, []
            if isinstance(prompt, list):
                return len(prompt), hasher.hash_blocks(prompt, salt)
        elif not isinstance(body.get("messages"), list):
            return 0, []
        if self._cache is not None:
            text = self._text(chat, body)
            if text is None:
                return 0, []
            cache = self._cache
            plan = cache.plan(*text)
            if plan.new_chars > INLINE_CHARS or plan.check:
                new = await asyncio.to_thread(cache.tokenize, plan)
            else:
                new = cache.tokenize(plan)
            return cache.commit(plan, new, hasher, salt)
        if via is None or via.client is None or via.client.is_closed:
            return 0, []
        ids = await self._remote(chat, body, via.client, via.url)
        return (len(ids), hasher.hash_blocks(ids, salt)) if ids else (0, [])

    def _text(self, chat: bool, body: dict[str, Any]) -> tuple[str, bool] | None:
        """The text the replica tokenizes (a chat's rendered) and whether with special
        tokens (as ``RequestProcessor.prompt_ids``); None when it cannot be made."""
        from services.api_server.protocol import ChatMessage
        from services.tokenizer.processor import PromptError

        assert self._processor is not None
        try:
            if chat:
                messages = [ChatMessage.model_validate(m).to_template() for m in body["messages"]]
                text = self._processor.render(
                    messages, None, bool(body.get("add_generation_prompt", True)),
                    dict(body.get("chat_template_kwargs") or {}),
                )  # fmt: skip
                return text, bool(body.get("add_special_tokens", False))
            prompt = _first_prompt(body)
            assert isinstance(prompt, str)
            return prompt, bool(body.get("add_special_tokens", True))
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
