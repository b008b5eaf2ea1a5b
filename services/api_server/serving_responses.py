"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel``), built on chat as vLLM builds it: the request's
``instructions`` and ``input`` items (messages, ``function_call`` and
``function_call_output`` items) become chat messages, ``tools``/``tool_choice``/
``parallel_tool_calls`` and ``text.format`` (``json_schema``, ``json_object``) become the chat
request's, and the answer comes back as output items (a ``message`` with ``output_text``,
``function_call`` items) with usage, whole or as the Responses event stream
(``response.created``, ``response.output_item.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ... ``response.completed``).

State (``ResponseStore``): with ``store`` (the default, as OpenAI's) a response and its
conversation (input and output, as chat messages; not its ``instructions``, which OpenAI does
not carry over) are kept in this server's memory, so ``previous_response_id`` continues a
conversation without resending it, and its prompt prefix is found in the prefix cache for the
next turn. Kept: at most ``ACTORSERVE_RESPONSES_STORE_MAX`` responses (default 1,024), each at
most ``ACTORSERVE_RESPONSES_STORE_TTL_S`` seconds (default 3,600); past either the oldest are
dropped, and a request naming one gets a 404. An answer in progress can be cancelled
(``/cancel``, for an answer that is not streamed: its engine request is aborted, its
status ``cancelled``; a stream ends when its client closes it).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from services import clock
from services.api_server.choices import ChoiceState
from services.api_server.frontend import EngineRequestError
from services.api_server.http_io import APIError, ClientGone, parse_body, until_disconnect
from services.api_server.protocol import ChatCompletionRequest, ParamError
from services.api_server.response_store import ResponseStore, Stored
from services.api_server.serving import Deltas, ResponseContext, check_error
from services.api_server.serving_chat import ChatServing
from services.api_server.tool_calls import CallArguments, CallStart, Content, Event, ToolCalling
from services.http.errors import client_closed, error_body, error_response
from services.http.streaming import BoundedStreamingResponse

_json = msgspec.json.Encoder()
_ECHOED = ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls",
           "previous_response_id", "temperature", "tool_choice", "tools", "top_p")  # fmt: skip


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the request


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ParamError(where, "content must be a string or a list of content parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            texts.append(str(part.get("text", "")))
        else:
            raise ParamError(where, f"content part type {kind!r} is not supported here "
                             "(text only: input_text, output_text)")  # fmt: skip
    return "\n".join(texts)


def input_messages(items: Any) -> list[dict[str, Any]]:
    """The request's ``input`` as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ParamError("input", "input must be a string or a list of input items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise ParamError(where, "each input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ParamError(where, f"role must be user, system, developer or assistant, "
                                 f"not {role!r}")  # fmt: skip
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": str(item.get("name", "")),
                                 "arguments": str(item.get("arguments", ""))}}  # fmt: skip
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            text = output if isinstance(output, str) else _text_of(output, where)
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": text})  # fmt: skip
        elif kind == "reasoning":
            continue  # a model's own thinking: not given back to the template
        else:
            raise ParamError(where, f"input item type {kind!r} is not supported")
    return out


def chat_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request's fields for ``tools``, ``tool_choice``, ``parallel_tool_calls``,
    ``text.format`` and the sampling parameters."""
    fields: dict[str, Any] = {}
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise ParamError("tools", "tools must be a list")
    chat_tools = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise ParamError(f"tools.{i}", f"tool type {kind!r} is not supported (function only)")
        chat_tools.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}})  # fmt: skip
    if chat_tools:
        fields["tools"] = chat_tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        fields["tool_choice"] = choice
    if (parallel := body.get("parallel_tool_calls")) is not None:
        fields["parallel_tool_calls"] = parallel
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema"),
            "strict": fmt.get("strict")}}  # fmt: skip
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        fields["response_format"] = {"type": "json_object"}
    # OpenAI's sampling fields, and vLLM's extras a client sends as ``extra_body``
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "repetition_penalty",
                 "structured_outputs", "cache_salt", "priority"):  # fmt: skip
        if body.get(name) is not None:
            fields[name] = body[name]
    if body.get("max_output_tokens") is not None:
        fields["max_tokens"] = body["max_output_tokens"]
    return fields


# ---- the answer


@dataclass
class Output:
    """The output items as they form (text and calls, in order)."""

    items: list[dict[str, Any]] = field(default_factory=list)

    def history(self) -> list[dict[str, Any]]:
        """The items as the chat messages they continue a conversation with."""
        messages: list[dict[str, Any]] = []
        for item in self.items:
            if item["type"] == "reasoning":
                continue  # a model's own thinking: not given back to the template
            if item["type"] == "message":
                text = "".join(p["text"] for p in item["content"])
                messages.append({"role": "assistant", "content": text})
            else:
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
                if messages and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)
                elif messages and messages[-1]["role"] == "assistant":
                    messages[-1]["tool_calls"] = [call]
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        return messages


def _usage(state: ChoiceState) -> dict[str, Any]:
    return {
        "input_tokens": state.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": state.num_cached_tokens},
        "output_tokens": state.num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": state.num_reasoning_tokens},
        "total_tokens": state.num_prompt_tokens + state.num_output_tokens,
    }


class ResponsesServing(ChatServing):
    """Serves the Responses routes (OpenAI's error shape, as the other OpenAI routes)."""

    def __init__(self, *args: Any, store: ResponseStore | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.store = store or ResponseStore()

    def _base(self, body: dict[str, Any], rid: str, model: str) -> dict[str, Any]:
        fmt = body.get("text") if isinstance(body.get("text"), dict) else None
        out: dict[str, Any] = {"id": rid, "object": "response", "created_at": int(clock.wall()),
               "status": "in_progress", "error": None, "incomplete_details": None,
               "model": model, "output": [], "usage": None,
               "store": body.get("store", True) is not False,
               "text": fmt or {"format": {"type": "text"}}}  # fmt: skip
        for name in _ECHOED:
            out[name] = body.get(name)
        out["tools"] = body.get("tools") or []
        out["tool_choice"] = body.get("tool_choice") or "auto"
        out["parallel_tool_calls"] = body.get("parallel_tool_calls", True) is not False
        return out

    async def create(self, request: Request, read: Callable[[], Awaitable[Any]]) -> Response:
        body = await read()
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        previous: list[dict[str, Any]] = []
        if (prev_id := body.get("previous_response_id")) is not None:
            stored = self.store.get(str(prev_id))
            if stored is None:
                raise APIError(404, f"Response with id '{prev_id}' not found.",
                               "previous_response_id")  # fmt: skip
            previous = stored.history
        if "input" not in body:
            raise APIError(400, "input: Field required", "input")
        turn = input_messages(body["input"])
        system = []
        if body.get("instructions"):
            system = [{"role": "system", "content": str(body["instructions"])}]
        chat = parse_body(ChatCompletionRequest, {
            "model": body.get("model"), "messages": system + previous + turn,
            "stream": bool(body.get("stream")), **chat_fields(body)})  # fmt: skip
        ctx, deltas, tools = self.start(chat, request, "resp")
        rid = "resp_" + ctx.id.removeprefix("resp-")
        response = self._base(body, rid, ctx.model)
        answer = _Answer(response, tools, ctx)

        def remember() -> None:
            if response["store"]:
                self.store.put(rid, Stored(response, previous + turn + answer.output.history()))

        if response["store"]:
            self.store.put(rid, Stored(response, previous + turn))
        if not chat.stream:
            task = asyncio.ensure_future(answer.whole(deltas))
            entry = self.store.get(rid)
            if entry is not None:
                entry.task = task
            try:
                await until_disconnect(request, asyncio.shield(task))
            except (ClientGone, asyncio.CancelledError):
                if entry is None or not entry.cancelled:  # the client left (or we stop)
                    task.cancel()
                    if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                        raise
                    return client_closed()
                response["status"] = "cancelled"  # by ``/cancel``: the client still waits
            except EngineRequestError as e:
                response["status"] = "failed"
                response["error"] = {"code": str(e.status), "message": e.message}
                raise
            finally:
                remember()
            return JSONResponse(response)
        try:
            first = await until_disconnect(request, anext(deltas))
        except ClientGone:
            return client_closed()

        async def events() -> AsyncIterator[bytes]:
            try:
                async for piece in answer.stream(first, deltas):
                    yield piece
            finally:
                if response["status"] == "in_progress":  # the client closed the stream
                    response["status"] = "cancelled"
                remember()

        return BoundedStreamingResponse(events(), self.settings.limits.stream_send_timeout)

    def get(self, rid: str) -> JSONResponse:
        stored = self.store.get(rid)
        if stored is None:
            return error_response(404, f"Response with id '{rid}' not found.", param="response_id")
        return JSONResponse(stored.response)

    def delete(self, rid: str) -> JSONResponse:
        if self.store.pop(rid) is None:
            return error_response(404, f"Response with id '{rid}' not found.", param="response_id")
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    async def cancel(self, rid: str) -> JSONResponse:
        stored = self.store.get(rid)
        if stored is None:
            return error_response(404, f"Response with id '{rid}' not found.", param="response_id")
        if stored.response["status"] != "in_progress" or stored.task is None:
            return error_response(400, f"Response '{rid}' is {stored.response['status']}: only "
                                  "a response in progress can be cancelled.")  # fmt: skip
        stored.cancelled = True
        stored.task.cancel()  # its deltas' iterator closes: the engine aborts the request
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await stored.task
        stored.response["status"] = "cancelled"
        return JSONResponse(stored.response)


class _Answer:
    """One response's output as its deltas come: the items, the status, the usage, and (for
    a stream) the events."""

    def __init__(self, response: dict[str, Any], tools: ToolCalling | None,
                 ctx: ResponseContext) -> None:  # fmt: skip
        self.response, self.tools, self.ctx = response, tools, ctx
        self.state = ChoiceState()
        self.output = Output()
        self.calls = tools.stream() if tools is not None else None
        self.seq = 0
        self.open: dict[str, Any] | None = None  # the item being written

    def _events(self, text: str, finished: bool) -> list[Event]:
        if self.calls is None:
            return [Content(text)]
        events = self.calls.feed(text)
        return events + self.calls.finish() if finished else events

    def _finish(self) -> None:
        state, response = self.state, self.response
        response["output"] = self.output.items
        response["usage"] = _usage(state)
        if state.finish_reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            response["status"] = "completed"

    async def whole(self, deltas: Deltas) -> None:
        async for _, delta in deltas:
            check_error(delta)
            self.state.update(delta, delta.text)
            self._think(delta.reasoning)
            for event in self._events(delta.text, delta.finish_reason is not None):
                self._apply(event)
        self._close()
        self._finish()

    # ---- items

    def _think(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        """Take a thinking model's reasoning text (``--reasoning-parser``) into a reasoning
        item; the stream events it makes."""
        out: list[tuple[str, dict[str, Any]]] = []
        if not text:
            return out
        if self.open is None or self.open["type"] != "reasoning":
            out += self._close()
            item: dict[str, Any] = {"type": "reasoning", "id": _new_id("rs"), "summary": [],
                                    "content": [], "status": "in_progress"}  # fmt: skip
            out += self._add(item)
            part = {"type": "reasoning_text", "text": ""}
            item["content"].append(part)
            out.append(("response.content_part.added", {**self._where(), "content_index": 0,
                                                        "part": dict(part)}))  # fmt: skip
        self.open["content"][0]["text"] += text  # type: ignore[index]
        out.append(("response.reasoning_text.delta", {**self._where(), "content_index": 0,
                                                      "delta": text}))  # fmt: skip
        return out

    def _apply(self, e: Event) -> list[tuple[str, dict[str, Any]]]:
        """Take one event into the output; the stream events it makes."""
        out: list[tuple[str, dict[str, Any]]] = []
        if isinstance(e, Content):
            if not e.text:
                return out
            if self.open is None or self.open["type"] != "message":
                out += self._close()
                item: dict[str, Any] = {"type": "message", "id": _new_id("msg"),
                                        "status": "in_progress", "role": "assistant",
                                        "content": []}  # fmt: skip
                out += self._add(item)
                part = {"type": "output_text", "text": "", "annotations": []}
                item["content"].append(part)
                out.append(("response.content_part.added", {**self._where(), "content_index": 0,
                                                            "part": dict(part)}))  # fmt: skip
            self.open["content"][0]["text"] += e.text  # type: ignore[index]
            out.append(("response.output_text.delta", {**self._where(), "content_index": 0,
                                                       "delta": e.text, "logprobs": []}))  # fmt: skip
        elif self.tools is not None and not self.tools.parallel and e.index > 0:
            return out
        elif isinstance(e, CallStart):
            out += self._close()
            out += self._add({"type": "function_call", "id": _new_id("fc"), "call_id": e.id,
                              "name": e.name, "arguments": "", "status": "in_progress"})  # fmt: skip
        else:
            assert isinstance(e, CallArguments) and self.open is not None
            self.open["arguments"] += e.text
            out.append(("response.function_call_arguments.delta", {**self._where(),
                                                                   "delta": e.text}))  # fmt: skip
        return out

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output.items) - 1}

    def _add(self, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        self.output.items.append(item)
        self.open = item
        added = {**item, "content": []} if "content" in item else dict(item)
        return [("response.output_item.added",
                 {"output_index": len(self.output.items) - 1, "item": added})]  # fmt: skip

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        item = self.open
        if item is None:
            return []
        where = self._where()
        out: list[tuple[str, dict[str, Any]]] = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            done = {**where, "content_index": 0, "text": part["text"]}
            if item["type"] == "message":
                out.append(("response.output_text.done", {**done, "logprobs": []}))
            else:
                out.append(("response.reasoning_text.done", done))
            out.append(("response.content_part.done", {**where, "content_index": 0,
                                                       "part": dict(part)}))  # fmt: skip
        else:
            out.append(("response.function_call_arguments.done",
                        {**where, "name": item["name"], "arguments": item["arguments"]}))  # fmt: skip
        item["status"] = "completed"
        out.append(("response.output_item.done", {"output_index": where["output_index"],
                                                  "item": item}))  # fmt: skip
        self.open = None
        return out

    # ---- the stream

    def _sse(self, kind: str, data: dict[str, Any]) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json.encode(payload) + b"\n\n"

    async def stream(self, first: tuple[int, Any], deltas: Deltas) -> AsyncIterator[bytes]:
        yield self._sse("response.created", {"response": dict(self.response)})
        yield self._sse("response.in_progress", {"response": dict(self.response)})
        try:
            pending = [first]
            while True:
                for _, delta in pending:
                    check_error(delta)
                    self.state.update(delta, delta.text)
                    for kind, data in self._think(delta.reasoning):
                        yield self._sse(kind, data)
                    for event in self._events(delta.text, delta.finish_reason is not None):
                        for kind, data in self._apply(event):
                            yield self._sse(kind, data)
                try:
                    pending = [await anext(deltas)]
                except StopAsyncIteration:
                    break
            for kind, data in self._close():
                yield self._sse(kind, data)
            self._finish()
            done = "response.incomplete" if self.response["status"] == "incomplete" else (
                "response.completed")  # fmt: skip
            yield self._sse(done, {"response": self.response})
        except EngineRequestError as e:
            self.response["status"] = "failed"
            self.response["error"] = {"code": str(e.status), "message": e.message}
            yield self._sse("error", {**error_body(e.status, e.message, e.error_type, e.param)})
