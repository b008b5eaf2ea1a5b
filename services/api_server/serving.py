"""Engine deltas -> OpenAI responses, in vLLM's shapes (completions and chat, streamed or not).

A request group is ``num_prompts * n`` engine requests; choice ``index`` is
``prompt_index * n + i`` as in vLLM. Usage counts come from the engine
(each prompt counted once, every choice's output tokens summed).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from services.api_server.choices import ChoiceState
from services.api_server.frontend import EngineRequestError
from services.api_server.tool_calls import CallStart, Content, Event, ToolCalling
from services.protocol import DecodedLogprob, DecodedPromptLogprobs, TextDelta

logger = logging.getLogger(__name__)

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
_MIN_LOGPROB = -9999.0  # vLLM clamps -inf so the JSON stays valid

Deltas = AsyncIterator[tuple[int, TextDelta]]


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def error_body(
    status: int, message: str, error_type: str, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def _lp(x: float) -> float:
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
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.num_cached_tokens for s in firsts)},
    }


def _check_error(delta: TextDelta) -> None:
    if delta.finish_reason == "error":
        if delta.error is not None:  # the request's own fault (its grammar)
            raise EngineRequestError(400, delta.error, "BadRequestError")
        raise EngineRequestError(500, "the engine failed while generating", "InternalServerError")


# ---------------------------------------------------------------- completions


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
        top = {lp.token: _lp(lp.logprob)}
        top.update({t: _lp(x) for t, x in alternatives})
        add(lp.token, _lp(lp.logprob), top)

    if prompt is not None:
        add(prompt.first_token, None, None)
        for lp in prompt.items:
            add_lp(lp, num_prompt_top)
    for lp in lps:
        add_lp(lp, None)
    return out


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
    return {"logprob": _lp(logprob), "rank": rank, "decoded_token": token}


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
            _check_error(delta)
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
            yield sse(_chunk(ctx, "text_completion", [choice]))
        if include_usage:
            yield sse({**_chunk(ctx, "text_completion", []), "usage": usage(ctx, states)})
    except EngineRequestError as e:
        yield sse(error_body(e.status, e.message, e.error_type, e.param))
    yield DONE


async def completion_full(
    ctx: ResponseContext, deltas: Deltas, *, want_logprobs: bool
) -> dict[str, Any]:
    states = [ChoiceState() for _ in range(ctx.num_choices)]
    async for index, delta in deltas:
        _check_error(delta)
        states[index].update(delta, _completion_text(ctx, delta))
    choices = []
    for i, s in enumerate(states):
        text = "".join(s.text)
        lps = None
        if want_logprobs:
            lps = _completion_lps(ctx, s, s.logprobs, s.prompt_logprobs)
        choices.append(
            {
                "index": i,
                "text": text,
                "logprobs": lps,
                "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason,
                "prompt_logprobs": prompt_logprobs_json(s.prompt_logprobs),
                **_token_ids(ctx, s),
            }
        )
    return {
        **_chunk(ctx, "text_completion", choices),
        "usage": usage(ctx, states),
        **_kv_transfer_params(states),
    }


def _kv_transfer_params(states: list[ChoiceState]) -> dict[str, Any]:
    """vLLM's top-level ``kv_transfer_params`` (where a prefill instance holds the KV)."""
    params = states[0].kv_transfer_params if states else None
    return {} if params is None else {"kv_transfer_params": params}


def _token_ids(ctx: ResponseContext, state: ChoiceState) -> dict[str, Any]:
    if not ctx.return_token_ids:
        return {}
    return {"prompt_token_ids": state.prompt_token_ids, "token_ids": state.token_ids}


def _chunk(ctx: ResponseContext, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": ctx.id,
        "object": obj,
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
    }


# ---------------------------------------------------------------- chat


def chat_logprobs(lps: list[DecodedLogprob]) -> dict[str, Any]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8"))}

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
        yield sse(_chunk(ctx, obj, [role]))
    try:
        async for index, delta in deltas:
            _check_error(delta)
            states[index].update(delta, delta.text)
            finish_reason = delta.finish_reason
            message: dict[str, Any] = {"content": delta.text}
            if tools is not None:
                stream = calls[index]
                events = stream.feed(delta.text)
                if finish_reason is not None:
                    events += stream.finish()
                    finish_reason = tools.finish_reason(bool(stream.calls), finish_reason)
                content, tool_calls = _tool_call_deltas(events, tools)
                message = {"content": content} if content else {}
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
            chunk = _chunk(ctx, obj, [choice])
            if ctx.return_token_ids:
                choice["token_ids"] = delta.token_ids
                if delta.prompt_token_ids is not None:  # vLLM: top level, in the first chunk
                    chunk["prompt_token_ids"] = delta.prompt_token_ids
            yield sse(chunk)
        if include_usage:
            yield sse({**_chunk(ctx, obj, []), "usage": usage(ctx, states)})
    except EngineRequestError as e:
        yield sse(error_body(e.status, e.message, e.error_type, e.param))
    except Exception as e:  # a bug here must end the stream in an error, not cut it
        logger.exception("chat stream %s failed", ctx.id)
        yield sse(error_body(500, f"the server failed: {type(e).__name__}", "InternalServerError"))
    yield DONE


def _chat_message(
    state: ChoiceState, tools: ToolCalling | None
) -> tuple[dict[str, Any], str | None]:
    """A whole choice's message and finish reason."""
    text = "".join(state.text)
    if tools is None:
        return {"role": "assistant", "content": text, "tool_calls": []}, state.finish_reason
    stream = tools.stream()
    stream.feed(text)
    stream.finish()
    message = {
        "role": "assistant",
        "content": tools.content(stream),
        "tool_calls": [call.to_json() for call in tools.calls(stream)],
    }
    return message, tools.finish_reason(bool(stream.calls), state.finish_reason)


async def chat_full(
    ctx: ResponseContext, deltas: Deltas, *, want_logprobs: bool, tools: ToolCalling | None = None
) -> dict[str, Any]:
    states = [ChoiceState() for _ in range(ctx.num_choices)]
    async for index, delta in deltas:
        _check_error(delta)
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
        **_chunk(ctx, "chat.completion", choices),
        "usage": usage(ctx, states),
        "prompt_logprobs": prompt_logprobs_json(states[0].prompt_logprobs),
        "prompt_token_ids": states[0].prompt_token_ids if ctx.return_token_ids else None,
        **_kv_transfer_params(states),
    }
