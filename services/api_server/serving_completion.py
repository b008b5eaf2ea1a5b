"""``POST /v1/completions`` (vLLM's ``OpenAIServingCompletion``): prompts in, text out,
whole or streamed, with echo, logprobs in the completions shape, and usage."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from services import clock
from services.api_server.choices import ChoiceState
from services.api_server.frontend import EngineRequestError
from services.api_server.http_io import validate_sampling
from services.api_server.protocol import CompletionRequest, ParamError
from services.api_server.serving import (
    DONE,
    Deltas,
    ResponseContext,
    check_error,
    chunk,
    clamp_logprob,
    kv_transfer_params,
    prompt_logprobs_json,
    sse,
    usage,
)
from services.api_server.serving_base import ServingBase
from services.http.errors import error_body
from services.protocol import (
    DecodedLogprob,
    DecodedPromptLogprobs,
    GenerateRequest,
    SamplingParams,
    TextDelta,
)

_OBJECT = "text_completion"


class CompletionServing(ServingBase):
    """Serves ``/v1/completions``: one engine request per prompt and choice."""

    async def create_completion(self, req: CompletionRequest, request: Request) -> Response:
        """Answer a parsed completion request; ``request`` gives its headers and
        disconnect. Bad input raises ``APIError``/``ParamError``, the engine's refusal
        ``EngineRequestError``."""
        settings = self.settings
        model = self.check_model(req.model)
        req.check(settings.limits)
        prompts = req.prompts()
        self.check_sequences(len(prompts) * req.n)
        if req.kv_transfer_params and len(prompts) != 1:
            raise ParamError("kv_transfer_params", "kv_transfer_params works with one prompt only.")
        sampling = req.completion_sampling_params()
        validate_sampling(sampling, settings.limits.max_logprobs)
        self.check_admission()
        response_id, base_id = self.response_ids(request, "cmpl", req.request_id)
        ctx = ResponseContext(
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
        dp_rank = self.pinned_rank(request)

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
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await self.respond(
            request,
            req.stream,
            self.generate(ctx, base_id, sampling, make),
            lambda d: completion_stream(ctx, d, want_logprobs=want_lp, include_usage=include_usage),
            lambda d: completion_full(ctx, d, want_logprobs=want_lp),
        )


def completion_logprobs(
    lps: list[DecodedLogprob],
    offset: int,
    prompt: DecodedPromptLogprobs | None = None,
    num_prompt_top: int = 0,
) -> dict[str, Any]:
    """The completions ``logprobs`` object; with ``prompt`` (echo), the prompt's tokens come
    first, the first of them with null logprobs, each with its top ``num_prompt_top``."""
    out: dict[str, list[Any]] = {
        "text_offset": [],
        "token_logprobs": [],
        "tokens": [],
        "top_logprobs": [],
    }

    def add(token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        nonlocal offset
        out["text_offset"].append(offset)
        out["token_logprobs"].append(logprob)
        out["tokens"].append(token)
        out["top_logprobs"].append(top)
        offset += len(token)

    def add_lp(lp: DecodedLogprob, num_top: int | None) -> None:
        alternatives = zip(lp.top_tokens[:num_top], lp.top_logprobs[:num_top], strict=True)
        top = {lp.token: clamp_logprob(lp.logprob)}
        top.update({t: clamp_logprob(x) for t, x in alternatives})
        add(lp.token, clamp_logprob(lp.logprob), top)

    if prompt is not None:
        add(prompt.first_token, None, None)
        for lp in prompt.items:
            add_lp(lp, num_prompt_top)
    for lp in lps:
        add_lp(lp, None)
    return out


def _completion_text(ctx: ResponseContext, delta: TextDelta) -> str:
    text = "" if ctx.echo_only else delta.text
    if ctx.echo and delta.prompt_text is not None:
        return delta.prompt_text + text
    return text


def _completion_lps(
    ctx: ResponseContext,
    state: ChoiceState,
    lps: list[DecodedLogprob],
    prompt: DecodedPromptLogprobs | None,
) -> dict[str, Any]:
    """Logprobs of a choice (or of one chunk of it): echoed prompt tokens first, then outputs."""
    if ctx.echo and prompt is not None:
        outputs = [] if ctx.echo_only else lps
        out = completion_logprobs(outputs, state.next_offset, prompt, ctx.num_logprobs or 0)
    else:
        out = completion_logprobs(lps, state.next_offset)
    if out["tokens"]:
        state.next_offset = out["text_offset"][-1] + len(out["tokens"][-1])
    return out


async def completion_stream(
    ctx: ResponseContext, deltas: Deltas, *, want_logprobs: bool, include_usage: bool
) -> AsyncIterator[bytes]:
    states = [ChoiceState() for _ in range(ctx.num_choices)]
    try:
        async for index, delta in deltas:
            check_error(delta)
            text = _completion_text(ctx, delta)
            states[index].update(delta, text)
            lps = None
            if want_logprobs:
                lps = _completion_lps(ctx, states[index], delta.logprobs, delta.prompt_logprobs)
            choice = {
                "index": index,
                "text": text,
                "logprobs": lps,
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
            }
            if ctx.return_token_ids:
                choice["prompt_token_ids"] = delta.prompt_token_ids
                choice["token_ids"] = delta.token_ids
            yield sse(chunk(ctx, _OBJECT, [choice]))
        if include_usage:
            yield sse({**chunk(ctx, _OBJECT, []), "usage": usage(ctx, states)})
    except EngineRequestError as e:
        yield sse(error_body(e.status, e.message, e.error_type, e.param))
    yield DONE


async def completion_full(
    ctx: ResponseContext, deltas: Deltas, *, want_logprobs: bool
) -> dict[str, Any]:
    states = [ChoiceState() for _ in range(ctx.num_choices)]
    async for index, delta in deltas:
        check_error(delta)
        states[index].update(delta, _completion_text(ctx, delta))
    choices = []
    for i, s in enumerate(states):
        lps = None
        if want_logprobs:
            lps = _completion_lps(ctx, s, s.logprobs, s.prompt_logprobs)
        choices.append(
            {
                "index": i,
                "text": "".join(s.text),
                "logprobs": lps,
                "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason,
                "prompt_logprobs": prompt_logprobs_json(s.prompt_logprobs),
                **_token_ids(ctx, s),
            }
        )
    return {
        **chunk(ctx, _OBJECT, choices),
        "usage": usage(ctx, states),
        **kv_transfer_params(states),
    }


def _token_ids(ctx: ResponseContext, state: ChoiceState) -> dict[str, Any]:
    if not ctx.return_token_ids:
        return {}
    return {"prompt_token_ids": state.prompt_token_ids, "token_ids": state.token_ids}
