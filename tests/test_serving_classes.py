"""``CompletionServing`` and ``ChatServing`` driven directly: no FastAPI app, no HTTP, no
engine. A scripted frontend answers each engine request with fixed ``TextDelta``s; the
tests check the OpenAI response shapes, whole and streamed, and the errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.api_server.frontend import EngineRequestError
from services.api_server.http_io import APIError
from services.api_server.protocol import ChatCompletionRequest, CompletionRequest
from services.api_server.serving_base import ServerSettings
from services.api_server.serving_chat import ChatServing
from services.api_server.serving_completion import CompletionServing
from services.protocol import GenerateRequest, TextDelta

MODEL = "m"


class ScriptedFrontend:
    """``EngineFrontend``'s serving interface: ``script(choice index, request)`` gives each
    engine request's deltas; the group's deltas come interleaved, as from the engine."""

    def __init__(self, script: Callable[[int, GenerateRequest], list[TextDelta]]) -> None:
        self.script = script
        self.unavailable: str | None = None
        self.sent: list[GenerateRequest] = []
        self.max_waiting: int | None = None

    async def generate(
        self,
        reqs: list[GenerateRequest],
        *,
        max_waiting: int | None = None,
        on_sent: Callable[[int], object] | None = None,
    ) -> AsyncIterator[tuple[int, TextDelta]]:
        self.max_waiting = max_waiting
        if max_waiting == 0:
            raise EngineRequestError(429, "Too many queued requests (limit 0).", "RateLimitError")
        self.sent += reqs
        if on_sent is not None:
            on_sent(len(reqs))
        scripts = [self.script(i, r) for i, r in enumerate(reqs)]
        for step in range(max(map(len, scripts))):
            for i, deltas in enumerate(scripts):
                if step < len(deltas):
                    yield i, deltas[step]


def two_words(i: int, req: GenerateRequest) -> list[TextDelta]:
    """Choice ``i`` says "a{i} b{i}" over two deltas, from a 3-token prompt (1 cached)."""
    counts = {"num_prompt_tokens": 3, "num_cached_tokens": 1}
    return [
        TextDelta(req.req_id, f"a{i}", [10 + i], num_output_tokens=1, **counts),
        TextDelta(req.req_id, f" b{i}", [20 + i], "length", num_output_tokens=2, **counts),
    ]


def http_request(headers: dict[str, str] | None = None) -> Request:
    """A request whose client never leaves (the disconnect watch waits forever)."""

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw}, receive)


def full(response: Any) -> dict[str, Any]:
    assert isinstance(response, JSONResponse) and response.status_code == 200
    return json.loads(bytes(response.body))  # type: ignore[no-any-return]


def events(respond: Awaitable[Any]) -> list[Any]:
    """The SSE events of the streamed response ``respond`` gives, decoded; ``[DONE]`` as the
    string. One event loop for the response and its stream, as under uvicorn."""
    return asyncio.run(_events(respond))


async def _events(respond: Awaitable[Any]) -> list[Any]:
    response = await respond
    assert isinstance(response, StreamingResponse)
    assert response.media_type == "text/event-stream"
    body = b"".join([c async for c in response.body_iterator])  # type: ignore[misc]
    out: list[Any] = []
    for event in body.decode().split("\n\n")[:-1]:
        assert event.startswith("data: ")
        data = event[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def servings(
    script: Callable[[int, GenerateRequest], list[TextDelta]] = two_words,
) -> tuple[CompletionServing, ChatServing, ScriptedFrontend, list[int]]:
    frontend = ScriptedFrontend(script)
    settings = ServerSettings([MODEL], max_num_queued_reqs=5)
    sent: list[int] = []
    completion = CompletionServing(frontend, settings, on_sent=sent.append)  # type: ignore[arg-type]
    chat = ChatServing(frontend, settings, on_sent=sent.append)  # type: ignore[arg-type]
    return completion, chat, frontend, sent


def completion_request(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": MODEL, "prompt": "hi", **kw})


def chat_request(**kw: Any) -> ChatCompletionRequest:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}
    return ChatCompletionRequest.model_validate(body)


USAGE_N2 = {
    "prompt_tokens": 3,  # the prompt counted once for its n choices
    "total_tokens": 7,
    "completion_tokens": 4,
    "prompt_tokens_details": {"cached_tokens": 1},
}


def test_a_whole_completion_has_every_choice_in_order_and_usage():
    completion, _, frontend, sent = servings()
    req = completion_request(n=2, seed=7, request_id="abc")
    body = full(asyncio.run(completion.create_completion(req, http_request())))
    assert body["id"] == "cmpl-abc" and body["object"] == "text_completion"
    assert body["model"] == MODEL
    assert [
        (c["index"], c["text"], c["finish_reason"], c["stop_reason"], c["logprobs"])
        for c in body["choices"]
    ] == [(0, "a0 b0", "length", None, None), (1, "a1 b1", "length", None, None)]
    assert body["usage"] == USAGE_N2
    assert "kv_transfer_params" not in body
    # One engine request per choice, ``{base}-{index}``, seeded ``seed + i``; counted as sent.
    assert [r.req_id.rsplit("-", 1)[1] for r in frontend.sent] == ["0", "1"]
    assert all(r.req_id.startswith("cmpl-abc-") for r in frontend.sent)
    assert [r.sampling.seed for r in frontend.sent] == [7, 8]
    assert [r.prompt for r in frontend.sent] == ["hi", "hi"]
    assert sent == [2] and frontend.max_waiting == 5


def test_a_streamed_completion_sends_each_delta_then_usage_then_done():
    completion, _, frontend, _ = servings()
    req = completion_request(n=2, stream=True, stream_options={"include_usage": True})
    out = events(completion.create_completion(req, http_request()))
    assert out[-1] == "[DONE]"
    chunks, usage = out[:-2], out[-2]
    assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks] == [
        (0, "a0"), (1, "a1"), (0, " b0"), (1, " b1")
    ]  # fmt: skip
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length", "length"]
    assert {c["id"] for c in chunks} == {usage["id"]} and usage["id"].startswith("cmpl-")
    assert usage["choices"] == [] and usage["usage"] == USAGE_N2


def test_the_x_request_id_and_data_parallel_rank_headers_reach_the_engine_requests():
    completion, _, frontend, _ = servings()
    request = http_request({"X-Request-Id": "hdr", "X-data-parallel-rank": "1"})
    body = full(asyncio.run(completion.create_completion(completion_request(), request)))
    assert body["id"] == "cmpl-hdr"
    assert [r.data_parallel_rank for r in frontend.sent] == [1]
    with pytest.raises(APIError) as e:
        bad = http_request({"X-data-parallel-rank": "one"})
        asyncio.run(completion.create_completion(completion_request(), bad))
    assert (e.value.status, e.value.param) == (400, "X-data-parallel-rank")


def test_a_whole_chat_completion_has_messages_usage_and_token_ids():
    _, chat, frontend, sent = servings()
    req = chat_request(n=2, return_token_ids=True)
    body = full(asyncio.run(chat.create_chat_completion(req, http_request())))
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert [(c["index"], c["message"], c["finish_reason"]) for c in body["choices"]] == [
        (0, {"role": "assistant", "content": "a0 b0", "tool_calls": []}, "length"),
        (1, {"role": "assistant", "content": "a1 b1", "tool_calls": []}, "length"),
    ]
    assert [c["token_ids"] for c in body["choices"]] == [[10, 20], [11, 21]]
    assert body["usage"] == USAGE_N2 and body["prompt_logprobs"] is None
    assert [r.messages for r in frontend.sent] == [[{"role": "user", "content": "hi"}]] * 2
    assert sent == [2]


def test_a_streamed_chat_sends_the_roles_first_then_deltas_usage_and_done():
    _, chat, _, _ = servings()
    req = chat_request(n=2, stream=True, stream_options={"include_usage": True})
    out = events(chat.create_chat_completion(req, http_request()))
    assert out[-1] == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" for c in out[:-1])
    choices = [c["choices"][0] for c in out[:-2]]
    assert [(c["index"], c["delta"]) for c in choices] == [
        (0, {"role": "assistant", "content": ""}),
        (1, {"role": "assistant", "content": ""}),
        (0, {"content": "a0"}),
        (1, {"content": "a1"}),
        (0, {"content": " b0"}),
        (1, {"content": " b1"}),
    ]
    assert [c["finish_reason"] for c in choices] == [None] * 4 + ["length"] * 2
    assert [c.get("stop_reason", "absent") for c in choices[-2:]] == [None, None]
    assert out[-2]["choices"] == [] and out[-2]["usage"] == USAGE_N2


def failing(i: int, req: GenerateRequest) -> list[TextDelta]:
    """The engine fails the request after its first token: the grammar's fault."""
    return [
        TextDelta(req.req_id, "x"),
        TextDelta(req.req_id, "", finish_reason="error", error="the grammar failed"),
    ]


def test_an_engine_error_is_a_400_whole_and_an_error_event_streamed():
    completion, chat, _, _ = servings(failing)
    with pytest.raises(EngineRequestError) as e:
        asyncio.run(chat.create_chat_completion(chat_request(), http_request()))
    assert (e.value.status, e.value.message, e.value.error_type) == (
        400, "the grammar failed", "BadRequestError"
    )  # fmt: skip
    streamed = completion.create_completion(completion_request(stream=True), http_request())
    out = events(streamed)
    assert out[0]["choices"][0]["text"] == "x"
    assert out[1:] == [
        {
            "error": {
                "message": "the grammar failed",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        },
        "[DONE]",
    ]


def test_checks_refuse_before_the_engine_sees_anything():
    completion, chat, frontend, sent = servings()
    with pytest.raises(APIError) as e:
        asyncio.run(completion.create_completion(completion_request(model="other"), http_request()))
    assert (e.value.status, e.value.param) == (404, "model")
    frontend.unavailable = "The server is shutting down."
    with pytest.raises(APIError) as e:
        asyncio.run(chat.create_chat_completion(chat_request(), http_request()))
    assert (e.value.status, e.value.message) == (503, "The server is shutting down.")
    assert frontend.sent == [] and sent == []


def test_a_rejected_stream_raises_its_status_before_any_event():
    completion, _, frontend, _ = servings()
    completion.settings.max_num_queued_reqs = 0  # the frontend's 429
    with pytest.raises(EngineRequestError) as e:
        asyncio.run(completion.create_completion(completion_request(stream=True), http_request()))
    assert e.value.status == 429 and frontend.sent == []


class TokenizingFrontend(ScriptedFrontend):
    """Answers tokenize requests with one id per character and detokenize with the ids'
    characters, recording what reached it."""

    def __init__(self) -> None:
        super().__init__(two_words)
        self.tokenized: list[Any] = []

    async def tokenize(self, req: Any) -> Any:
        from services.protocol import TokenizeResult

        self.tokenized.append(req)
        text = req.prompt if req.prompt is not None else "".join(m["content"] for m in req.messages)
        strs = list(text) if req.return_token_strs else None
        return TokenizeResult(req.req_id, [ord(c) for c in text], 2048, strs)

    async def detokenize(self, req: Any) -> Any:
        from services.protocol import DetokenizeResult

        return DetokenizeResult(req.req_id, "".join(map(chr, req.token_ids)))


def test_tokenize_and_detokenize_go_to_the_tokenizers_in_vllms_shapes():
    from services.api_server.protocol import DetokenizeRequest
    from services.api_server.serving_tokenize import TokenizeServing

    frontend = TokenizingFrontend()
    serving = TokenizeServing(frontend, ServerSettings([MODEL]))  # type: ignore[arg-type]
    plain = asyncio.run(
        serving.tokenize({"model": MODEL, "prompt": "hi", "return_token_strs": True})
    )
    assert full(plain) == {"count": 2, "max_model_len": 2048, "tokens": [104, 105],
                           "token_strs": ["h", "i"]}  # fmt: skip
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "yo"}]}
    assert full(asyncio.run(serving.tokenize(chat)))["tokens"] == [121, 111]
    assert frontend.tokenized[1].messages[0]["content"] == "yo"
    assert frontend.tokenized[1].add_generation_prompt  # vLLM's default for chat
    back = DetokenizeRequest.model_validate({"model": MODEL, "tokens": [104, 105]})
    assert full(asyncio.run(serving.detokenize(back))) == {"prompt": "hi"}
    with pytest.raises(APIError) as e:  # an unknown model: refused before any tokenizer
        asyncio.run(serving.tokenize({"model": "other", "prompt": "hi"}))
    assert e.value.status == 404 and len(frontend.tokenized) == 2
