"""``POST /v1/chat/completions`` (vLLM's ``OpenAIServingChat``): messages in, an assistant
message out, whole or streamed, with tool calls parsed from the text when tools are on."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from services import clock
from services.api_server.choices import ChoiceState
from services.api_server.frontend import EngineRequestError
from services.api_server.http_io import validate_sampling
from services.api_server.protocol import ChatCompletionRequest
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
from services.api_server.tool_calls import CallStart, Content, Event, ToolCalling
from services.http.errors import error_body
from services.protocol import DecodedLogprob, GenerateRequest, SamplingParams

logger = logging.getLogger(__name__)


class ChatServing(ServingBase):
    """Serves ``/v1/chat/completions``: the tokenizer renders the chat template; one engine
    request per choice."""

    async def create_chat_completion(
        self, req: ChatCompletionRequest, request: Request
    ) -> Response:
        """Answer a parsed chat request; ``request`` gives its headers and disconnect. Bad
        input raises ``APIError``/``ParamError``, the engine's refusal ``EngineRequestError``."""
        ctx, deltas, tools = self.start(req, request, "chatcmpl")
        want_lp = req.logprobs
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await self.respond(
            request,
            req.stream,
            deltas,
            lambda d: chat_stream(
                ctx, d, want_logprobs=want_lp, include_usage=include_usage, tools=tools
            ),
            lambda d: chat_full(ctx, d, want_logprobs=want_lp, tools=tools),
        )

    def start(
        self, req: ChatCompletionRequest, request: Request, id_prefix: str
    ) -> tuple[ResponseContext, Deltas, ToolCalling | None]:
        """Check a chat request and send it to the engine: the response's context, its
        deltas, and the tool calling that parses them (None with tools off). The other APIs
        built on chat (Anthropic's Messages) answer these in their own shapes."""
        settings = self.settings
        model = self.check_model(req.model)
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
        self.check_admission()
        response_id, base_id = self.response_ids(request, id_prefix, req.request_id)
        ctx = ResponseContext(
            response_id, int(clock.wall()), model, req.n, return_token_ids=req.return_token_ids
        )
        messages = [m.to_template() for m in req.messages]
        now = clock.wall()
        dp_rank = self.pinned_rank(request)

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

        return ctx, self.generate(ctx, base_id, sampling, make), tools


def chat_logprobs(lps: list[DecodedLogprob]) -> dict[str, Any]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {
            "token": token,
            "logprob": clamp_logprob(logprob),
            "bytes": list(token.encode("utf-8")),
        }

    return {
        "content": [
            {
                **entry(lp.token, lp.logprob),
                "top_logprobs": [
                    entry(t, x) for t, x in zip(lp.top_tokens, lp.top_logprobs, strict=False)
                ],
            }
            for lp in lps
        ]
    }


def _tool_call_deltas(events: list[Event], tools: ToolCalling) -> tuple[str, list[dict[str, Any]]]:
    """A chunk's content and its ``delta.tool_calls`` entries (OpenAI's shape: a call's
    first entry has its id, type and name; later ones add to its arguments)."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif not tools.parallel and e.index > 0:
            continue
        elif isinstance(e, CallStart):
            calls.append({"index": e.index, "id": e.id, "type": "function",
                          "function": {"name": e.name, "arguments": ""}})  # fmt: skip
        elif calls and calls[-1]["index"] == e.index:
            calls[-1]["function"]["arguments"] += e.text
        else:
            calls.append({"index": e.index, "function": {"arguments": e.text}})
    return "".join(content), calls


async def chat_stream(
    ctx: ResponseContext,
    deltas: Deltas,
    *,
    want_logprobs: bool,
    include_usage: bool,
    tools: ToolCalling | None = None,
) -> AsyncIterator[bytes]:
    states = [ChoiceState() for _ in range(ctx.num_choices)]
    calls = [tools.stream() for _ in states] if tools is not None else []
    obj = "chat.completion.chunk"
    # The first chunk of every choice carries the role, as OpenAI and vLLM send it.
    for i in range(ctx.num_choices):
        role = {
            "index": i,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        yield sse(chunk(ctx, obj, [role]))
    try:
        async for index, delta in deltas:
            check_error(delta)
            states[index].update(delta, delta.text)
            finish_reason = delta.finish_reason
            message: dict[str, Any] = {"content": delta.text}
            if delta.reasoning:  # vLLM's field, and the name it had before (still read)
                message = {"content": delta.text} if delta.text else {}
                message["reasoning"] = message["reasoning_content"] = delta.reasoning
            if tools is not None:
                stream = calls[index]
                events = stream.feed(delta.text)
                if finish_reason is not None:
                    events += stream.finish()
                    finish_reason = tools.finish_reason(bool(stream.calls), finish_reason)
                content, tool_calls = _tool_call_deltas(events, tools)
                message = {"content": content} if content else {}
                if delta.reasoning:
                    message["reasoning"] = message["reasoning_content"] = delta.reasoning
                if tool_calls:
                    message["tool_calls"] = tool_calls
                if not (message or finish_reason or want_logprobs or ctx.return_token_ids):
                    continue  # held back (a tag's start) or nothing to show yet
            choice: dict[str, Any] = {
                "index": index,
                "delta": message,
                "logprobs": chat_logprobs(delta.logprobs) if want_logprobs else None,
                "finish_reason": finish_reason,
            }
            if finish_reason is not None:
                choice["stop_reason"] = delta.stop_reason
            out = chunk(ctx, obj, [choice])
            if ctx.return_token_ids:
                choice["token_ids"] = delta.token_ids
                if delta.prompt_token_ids is not None:  # vLLM: top level, in the first chunk
                    out["prompt_token_ids"] = delta.prompt_token_ids
            yield sse(out)
        if include_usage:
            yield sse({**chunk(ctx, obj, []), "usage": usage(ctx, states)})
    except EngineRequestError as e:
        yield sse(error_body(e.status, e.message, e.error_type, e.param))
    except Exception as e:  # a bug here must end the stream in an error, not cut it
        logger.exception("chat stream %s failed", ctx.id)
        yield sse(error_body(500, f"the server failed: {type(e).__name__}", "InternalServerError"))
    yield DONE


def _chat_message(
    state: ChoiceState, tools: ToolCalling | None
) -> tuple[dict[str, Any], str | None]:
    """A whole choice's message and finish reason; a thinking model's thinking in
    ``reasoning`` (vLLM's field) and ``reasoning_content`` (its older name, still read)."""
    text = "".join(state.text)
    thinking = "".join(state.reasoning) or None
    if tools is None:
        message: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": []}
        finish_reason = state.finish_reason
    else:
        stream = tools.stream()
        stream.feed(text)
        stream.finish()
        message = {
            "role": "assistant",
            "content": tools.content(stream),
            "tool_calls": [call.to_json() for call in tools.calls(stream)],
        }
        finish_reason = tools.finish_reason(bool(stream.calls), state.finish_reason)
    if thinking is not None:
        message["reasoning"] = message["reasoning_content"] = thinking
    return message, finish_reason


async def chat_full(
    ctx: ResponseContext, deltas: Deltas, *, want_logprobs: bool, tools: ToolCalling | None = None
) -> dict[str, Any]:
    states = [ChoiceState() for _ in range(ctx.num_choices)]
    async for index, delta in deltas:
        check_error(delta)
        states[index].update(delta, delta.text)
    choices = []
    for i, s in enumerate(states):
        message, finish_reason = _chat_message(s, tools)
        choices.append({
            "index": i,
            "message": message,
            "logprobs": chat_logprobs(s.logprobs) if want_logprobs else None,
            "finish_reason": finish_reason,
            "stop_reason": s.stop_reason,
            **({"token_ids": s.token_ids} if ctx.return_token_ids else {}),
        })  # fmt: skip
    return {
        **chunk(ctx, "chat.completion", choices),
        "usage": usage(ctx, states),
        "prompt_logprobs": prompt_logprobs_json(states[0].prompt_logprobs),
        "prompt_token_ids": states[0].prompt_token_ids if ctx.return_token_ids else None,
        **kv_transfer_params(states),
    }
