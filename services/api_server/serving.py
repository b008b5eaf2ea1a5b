"""The response shapes completions and chat share, in vLLM's form: SSE framing, the
OpenAI error body, each chunk's envelope, usage, and the prompt's logprobs.

A request group is ``num_prompts * n`` engine requests; choice ``index`` is
``prompt_index * n + i`` as in vLLM. Usage counts come from the engine
(each prompt counted once, every choice's output tokens summed). Each endpoint's own
shapes live beside its serving class (``serving_completion``, ``serving_chat``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from services.api_server.choices import ChoiceState
from services.api_server.frontend import EngineRequestError
from services.protocol import DecodedPromptLogprobs, TextDelta

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
_MIN_LOGPROB = -9999.0  # vLLM clamps -inf so the JSON stays valid

Deltas = AsyncIterator[tuple[int, TextDelta]]


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def clamp_logprob(x: float) -> float:
    return max(x, _MIN_LOGPROB)


@dataclass
class ResponseContext:
    """What every chunk of one response repeats, and how choices map to prompts."""

    id: str
    created: int
    model: str
    n: int
    num_prompts: int = 1
    echo: bool = False
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, its token dropped
    num_logprobs: int | None = None  # completions' ``logprobs``: top-N per echoed prompt token
    return_token_ids: bool = False  # vLLM's prompt_token_ids / token_ids fields

    @property
    def num_choices(self) -> int:
        return self.n * self.num_prompts


def usage(ctx: ResponseContext, states: list[ChoiceState]) -> dict[str, Any]:
    firsts = [states[p * ctx.n] for p in range(ctx.num_prompts)]
    prompt = sum(s.num_prompt_tokens for s in firsts)
    completion = sum(s.num_output_tokens for s in states)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.num_cached_tokens for s in firsts)},
    }
    if reasoning := sum(s.num_reasoning_tokens for s in states):  # OpenAI's field
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


def check_error(delta: TextDelta) -> None:
    """A delta that ends its request in an error: raise it as the HTTP error it is."""
    if delta.finish_reason == "error":
        if delta.error is not None:  # the request's own fault (its grammar)
            raise EngineRequestError(400, delta.error, "BadRequestError")
        raise EngineRequestError(500, "the engine failed while generating", "InternalServerError")


def chunk(ctx: ResponseContext, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """A response (or one streamed chunk of it): its envelope around ``choices``."""
    return {
        "id": ctx.id,
        "object": obj,
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
    }


def kv_transfer_params(states: list[ChoiceState]) -> dict[str, Any]:
    """vLLM's top-level ``kv_transfer_params`` (where a prefill instance holds the KV)."""
    params = states[0].kv_transfer_params if states else None
    return {} if params is None else {"kv_transfer_params": params}


def prompt_logprobs_json(prompt: DecodedPromptLogprobs | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then for each token a map
    from token id to its logprob, rank and text (the prompt's token, then the top-N)."""
    if prompt is None:
        return None
    out: list[Any] = [None]
    for lp in prompt.items:
        entry = {str(lp.token_id): _logprob_entry(lp.logprob, lp.rank, lp.token)}
        alternatives = zip(lp.top_token_ids, lp.top_tokens, lp.top_logprobs, strict=True)
        for rank, (token_id, token, logprob) in enumerate(alternatives, start=1):
            entry.setdefault(str(token_id), _logprob_entry(logprob, rank, token))
        out.append(entry)
    return out


def _logprob_entry(logprob: float, rank: int, token: str) -> dict[str, Any]:
    return {"logprob": clamp_logprob(logprob), "rank": rank, "decoded_token": token}
