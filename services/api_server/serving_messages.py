"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``), as vLLM
serves it: the request becomes a chat request (system prompt, text, ``tool_use`` and
``tool_result`` blocks as the chat template's messages and tool calls; ``tools`` and
``tool_choice`` as OpenAI's), runs through ``ChatServing.start``, and the answer comes back
in Anthropic's shapes: content blocks (``text``, ``tool_use`` with its parsed ``input``),
``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``), usage, and
a stream of Anthropic's events (``message_start``, ``content_block_start`` /
``_delta`` / ``_stop``, ``message_delta``, ``message_stop``). Errors, whole or in a stream,
are Anthropic's ``{"type": "error", "error": {"type", "message"}}``.

Usage follows Anthropic's accounting: ``input_tokens`` are the prompt tokens computed,
``cache_read_input_tokens`` those found in the prefix cache (their sum is the prompt).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from services.api_server.choices import ChoiceState
from services.api_server.frontend import EngineRequestError
from services.api_server.http_io import APIError, parse_body
from services.api_server.protocol import (
    ChatCompletionRequest,
    OpenAIBaseModel,
    ParamError,
    TokenizeChatRequest,
    check_template_trust,
)
from services.api_server.serving import Deltas, ResponseContext, check_error
from services.api_server.serving_chat import ChatServing
from services.api_server.tool_calls import CallArguments, CallStart, Content, Event, ToolCalling
from services.protocol import TokenizeRequest

logger = logging.getLogger(__name__)
_json = msgspec.json.Encoder()

# ---- the request


class TextBlock(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ImageBlock(OpenAIBaseModel):
    type: Literal["image", "document"]


class ToolUseBlock(OpenAIBaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(OpenAIBaseModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False


class ThinkingBlock(OpenAIBaseModel):
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
    Field(discriminator="type"),
]


class MessageParam(OpenAIBaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(OpenAIBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class CountTokensRequest(OpenAIBaseModel):
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    # {"type": "enabled", "budget_tokens": N} | {"type": "disabled"}: a thinking model's
    # chat template told (Qwen3's enable_thinking, DeepSeek's thinking); no budget is kept
    thinking: dict[str, Any] | None = None


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages: the system prompt first; a user turn's
    ``tool_result`` blocks as ``tool`` messages (before its text), an assistant turn's
    ``tool_use`` blocks as its tool calls; thinking blocks dropped."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    for i, message in enumerate(req.messages):
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(
            message.content, str
        ) else message.content  # fmt: skip
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in blocks:
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ImageBlock):
                raise ParamError(f"messages.{i}.content", f"{block.type} content is not "
                                 "supported: this server's model reads text")  # fmt: skip
            elif isinstance(block, ToolUseBlock):
                if message.role != "assistant":
                    raise ParamError(f"messages.{i}.content", "tool_use blocks belong to "
                                     "assistant turns")  # fmt: skip
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input)}})  # fmt: skip
            elif isinstance(block, ToolResultBlock):
                if message.role != "user":
                    raise ParamError(f"messages.{i}.content", "tool_result blocks belong to "
                                     "user turns")  # fmt: skip
                result = _text(block.content)
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {result}" if block.is_error else result})  # fmt: skip
        if texts or calls or message.role == "assistant":
            turn: dict[str, Any] = {"role": message.role, "content": "\n".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    return out


def chat_tools(req: CountTokensRequest) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as a chat request's fields."""
    if not req.tools:
        return {}
    fields: dict[str, Any] = {"tools": [
        {"type": "function", "function": {"name": t.name, "description": t.description,
                                          "parameters": t.input_schema}}
        for t in req.tools
    ]}  # fmt: skip
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise ParamError("tool_choice.name", 'tool_choice "tool" needs a name')
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req),
        "max_tokens": req.max_tokens,
        "stream": req.stream,
        **chat_tools(req),
    }
    for name in ("temperature", "top_p", "top_k"):
        if (value := getattr(req, name)) is not None:
            body[name] = value
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    if req.thinking is not None and req.thinking.get("type") in ("enabled", "disabled"):
        on = req.thinking["type"] == "enabled"
        body["chat_template_kwargs"] = {"enable_thinking": on, "thinking": on}
    return parse_body(ChatCompletionRequest, body)


# ---- the answer

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}  # fmt: skip


def error_json(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}  # fmt: skip


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_json(status, message), status_code=status)


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _json.encode(data) + b"\n\n"


def _stop(state: ChoiceState, made_calls: bool) -> tuple[str | None, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a finished choice."""
    if made_calls:
        return "tool_use", None
    if state.finish_reason == "length":
        return "max_tokens", None
    if isinstance(state.stop_reason, str):
        return "stop_sequence", state.stop_reason
    return ("end_turn" if state.finish_reason else None), None


def _usage(state: ChoiceState) -> dict[str, int]:
    cached = state.num_cached_tokens
    return {
        "input_tokens": state.num_prompt_tokens - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": state.num_output_tokens,
    }


def _message_id(ctx: ResponseContext) -> str:
    return "msg_" + ctx.id.removeprefix("msg-")


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def messages_full(
    ctx: ResponseContext, deltas: Deltas, tools: ToolCalling | None
) -> dict[str, Any]:
    state = ChoiceState()
    async for _, delta in deltas:
        check_error(delta)
        state.update(delta, delta.text)
    text = "".join(state.text)
    content: list[dict[str, Any]] = []
    calls = []
    if tools is not None:
        stream = tools.stream()
        stream.feed(text)
        stream.finish()
        text = tools.content(stream) or ""
        calls = tools.calls(stream)
    if state.reasoning:  # a thinking model's (--reasoning-parser): Anthropic's thinking block
        content.append({"type": "thinking", "thinking": "".join(state.reasoning),
                        "signature": ""})  # fmt: skip
    if text:
        content.append({"type": "text", "text": text})
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)}
                for c in calls]  # fmt: skip
    stop_reason, stop_sequence = _stop(state, bool(calls))
    return {
        "id": _message_id(ctx), "type": "message", "role": "assistant", "model": ctx.model,
        "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "usage": _usage(state),
    }  # fmt: skip


async def messages_stream(
    ctx: ResponseContext, deltas: Deltas, tools: ToolCalling | None
) -> AsyncIterator[bytes]:
    """Anthropic's event stream: the message, then each content block (opened by its first
    text or tool call, closed by the next block or the end), then the stop reason."""
    state = ChoiceState()
    stream = tools.stream() if tools is not None else None
    open_block: str | None = None  # "thinking" | "text" | "tool_use"
    index = -1
    started = False

    def close() -> list[bytes]:
        nonlocal open_block
        if open_block is None:
            return []
        open_block = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": index})]

    def open_(block: dict[str, Any]) -> list[bytes]:
        nonlocal open_block, index
        out = close()
        index += 1
        open_block = block["type"]
        out.append(_event("content_block_start", {"type": "content_block_start",
                                                  "index": index, "content_block": block}))  # fmt: skip
        return out

    def render(events: list[Event]) -> list[bytes]:
        out: list[bytes] = []
        for e in events:
            if isinstance(e, Content):
                if not e.text:
                    continue
                if open_block != "text":
                    out += open_({"type": "text", "text": ""})
                delta = {"type": "text_delta", "text": e.text}
            elif tools is not None and not tools.parallel and e.index > 0:
                continue
            elif isinstance(e, CallStart):
                out += open_({"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
                continue
            else:
                assert isinstance(e, CallArguments)
                delta = {"type": "input_json_delta", "partial_json": e.text}
            out.append(_event("content_block_delta", {"type": "content_block_delta",
                                                      "index": index, "delta": delta}))  # fmt: skip
        return out

    try:
        async for _, delta in deltas:
            check_error(delta)
            state.update(delta, delta.text)
            if not started:
                started = True
                usage = {**_usage(state), "output_tokens": 0}
                yield _event("message_start", {"type": "message_start", "message": {
                    "id": _message_id(ctx), "type": "message", "role": "assistant",
                    "model": ctx.model, "content": [], "stop_reason": None,
                    "stop_sequence": None, "usage": usage}})  # fmt: skip
                yield _event("ping", {"type": "ping"})
            if delta.reasoning:
                if open_block != "thinking":
                    for piece in open_({"type": "thinking", "thinking": "", "signature": ""}):
                        yield piece
                thinking = {"type": "thinking_delta", "thinking": delta.reasoning}
                yield _event("content_block_delta", {"type": "content_block_delta",
                                                     "index": index, "delta": thinking})  # fmt: skip
            if stream is None:
                events: list[Event] = [Content(delta.text)]
            else:
                events = stream.feed(delta.text)
                if delta.finish_reason is not None:
                    events += stream.finish()
            for piece in render(events):
                yield piece
        for piece in close():
            yield piece
        stop_reason, stop_sequence = _stop(state, bool(stream is not None and stream.calls))
        yield _event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": stop_reason,
                                                 "stop_sequence": stop_sequence},
                                       "usage": {"output_tokens": state.num_output_tokens}})  # fmt: skip
        yield _event("message_stop", {"type": "message_stop"})
    except EngineRequestError as e:
        yield _event("error", error_json(e.status, e.message))
    except Exception as e:  # a bug here must end the stream in an error, not cut it
        logger.exception("messages stream %s failed", ctx.id)
        yield _event("error", error_json(500, f"the server failed: {type(e).__name__}"))


class MessagesServing(ChatServing):
    """Serves ``/v1/messages`` and ``/v1/messages/count_tokens``; every failure answers in
    Anthropic's error shape."""

    async def create_message(
        self, request: Request, read: Callable[[], Awaitable[Any]]
    ) -> Response:
        """``read``: the request's JSON body (its errors answered here too)."""
        try:
            req = chat_request(parse_body(MessagesRequest, await read()))
            ctx, deltas, tools = self.start(req, request, "msg")
            return await self.respond(
                request,
                req.stream,
                deltas,
                lambda d: messages_stream(ctx, d, tools),
                lambda d: messages_full(ctx, d, tools),
            )
        except (APIError, EngineRequestError) as e:
            return error_response(e.status, e.message)
        except ParamError as e:
            return error_response(400, str(e))

    async def count_tokens(self, read: Callable[[], Awaitable[Any]]) -> Response:
        try:
            req = parse_body(CountTokensRequest, await read())
            self.check_model(req.model)
            tools = chat_tools(req).get("tools")
            chat = parse_body(TokenizeChatRequest, {"messages": chat_messages(req),
                                                    **({"tools": tools} if tools else {})})  # fmt: skip
            check_template_trust(None, chat.chat_template_kwargs, self.settings.limits)
            self.check_admission()
            result = await self.frontend.tokenize(TokenizeRequest(
                f"tok-{uuid.uuid4().hex}", messages=[m.to_template() for m in chat.messages],
                add_generation_prompt=True, chat_template_kwargs=chat.template_kwargs(),
            ))  # fmt: skip
        except (APIError, EngineRequestError) as e:
            return error_response(e.status, e.message)
        except ParamError as e:
            return error_response(400, str(e))
        return JSONResponse({"input_tokens": len(result.token_ids)})
