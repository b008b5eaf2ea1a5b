"""The OpenAI HTTP server against a fake scheduler (tests/fake_engine.py): bad input and its
OpenAI errors, limits, auth, engine death, request ids, unsupported fields, and groups of
requests accepted or refused whole.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import socket
import time

import httpx
import pytest

from services.api_server.app import ServerSettings, build_app
from services.api_server.frontend import EngineFrontend, FrontendEndpoints
from services.ipc import PushSocket
from services.protocol import (
    Abort,
    ApiServerInput,
    EngineDead,
    TokenizedRequest,
)
from tests.fake_engine import MAX_LEN, MODEL


def _chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

BAD = [
    ("/v1/completions", b'{"model": "smollm2-test", "prompt": ', 400, None),
    ("/v1/completions", b'{"model": "smollm2-test", "prompt": "\xff\xfe"}', 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2], [-1]]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": MAX_LEN}, 400, "max_tokens"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": MAX_LEN, "stream": True},
        400,
        "max_tokens",
    ),
    ("/v1/chat/completions", _chat(messages=[]), 400, "messages"),
    ("/v1/chat/completions", _chat(messages="hi"), 400, "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages"),
    ("/v1/chat/completions", _chat(top_logprobs=2), 400, "top_logprobs"),
    ("/v1/chat/completions", _chat(stop=[""]), 400, "stop"),
    ("/v1/chat/completions", [1, 2], 400, None),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", _chat(logit_bias={"99999999": 5}), 400, "logit_bias"),
    ("/v1/chat/completions", _chat(allowed_token_ids=[]), 400, "allowed_token_ids"),
    ("/v1/chat/completions", _chat(logit_bias={str(10**22): 5}), 400, "logit_bias"),
    ("/v1/chat/completions", _chat(allowed_token_ids=[10**22]), 400, "allowed_token_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**22]}, 400, "prompt"),
    ("/v1/chat/completions", _chat(tools=[_TOOL]), 400, "tool_choice"),  # auto: no parser here
    ("/v1/chat/completions", _chat(tool_choice="auto"), 400, "tool_choice"),
    ("/v1/chat/completions", _chat(tool_choice="required"), 400, "tool_choice"),
    ("/v1/chat/completions", _chat(tools=[]), 400, "tools"),
    ("/v1/chat/completions", _chat(tools=[{"type": "function"}]), 400, "tools"),
    ("/v1/chat/completions", _chat(tools=[_TOOL], tool_choice="sometimes"), 400, "tool_choice"),
    (
        "/v1/chat/completions",
        _chat(tools=[_TOOL], tool_choice={"function": "f"}),
        400,
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        _chat(tools=[_TOOL], tool_choice={"function": {}}),
        400,
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        _chat(tools=[_TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        _chat(tools=[_TOOL], tool_choice="required", structured_outputs={"regex": "a"}),
        400,
        "structured_outputs",
    ),
    (
        "/v1/chat/completions",
        _chat(
            messages=[
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}],
                }
            ]
        ),
        400,
        "messages",
    ),
    (
        "/v1/chat/completions",
        _chat(response_format={"type": "yaml"}),
        400,
        "response_format",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "allowed_token_ids": [-1]}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "prompt_logprobs": 21}, 400, None),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "prompt_logprobs": 1, "stream": True},
        400,
        "prompt_logprobs",
    ),
    # Hostile input: deep nesting, numbers past int64 in every integer field, non-JSON
    # numbers, too many stop strings or bad words, a request's own chat template.
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"1" + b"]" * 5000 + b"}", 400, None),
    ("/v1/completions", b'{"prompt": ' + b"[" * 900 + b"1" + b"]" * 900 + b"}", 400, "prompt"),
    *[
        ("/v1/completions", {"model": MODEL, "prompt": "x", field: value}, 400, field)
        for field in (
            "seed",
            "max_tokens",
            "min_tokens",
            "priority",
            "top_k",
            "n",
            "logprobs",
            "prompt_logprobs",
            "stop_token_ids",
        )
        for value in ([2**70] if field == "stop_token_ids" else 2**70, -(2**70))
    ],  # fmt: skip
    *[
        ("/v1/chat/completions", _chat(**{field: 2**64}), 400, field)
        for field in ("max_completion_tokens", "top_logprobs", "seed")
    ],
    *[
        ("/v1/completions", f'{{"prompt": "x", "{field}": {value}}}'.encode(), 400, None)
        for field, value in (("temperature", "NaN"), ("top_p", "Infinity"), ("seed", "-Infinity"))
    ],
    ("/v1/completions", b'{"prompt": "\\ud800"}', 400, None),
    ("/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(129)]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["w"] * 129}, 400, "bad_words"),
    ("/v1/completions", {"prompt": "x", "n": 129}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", _chat(chat_template="{{ 'x' * 10**10 }}"), 400, "chat_template"),
    (
        "/v1/chat/completions",
        _chat(chat_template_kwargs={"chat_template": "{{ messages }}"}),
        400,
        "chat_template",
    ),
    ("/v1/chat/completions", _chat(chat_template_kwargs={"messages": []}), 400, "messages"),
    # Integers past 64 bits where the schema takes anything: still a 400 naming the field.
    ("/v1/chat/completions", _chat(chat_template_kwargs={"x": 2**64}), 400, "chat_template_kwargs"),
    (
        "/v1/chat/completions",
        _chat(
            tools=[{**_TOOL, "function": {"name": "f", "parameters": {"maximum": -(2**64)}}}],
            tool_choice="none",
        ),
        400,
        "tools",
    ),  # fmt: skip
    (
        "/v1/completions",
        {"prompt": "x", "kv_transfer_params": {"a": [2**70]}},
        400,
        "kv_transfer_params",
    ),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"x": 2**64}},
        400,
        "chat_template_kwargs",
    ),  # fmt: skip
    ("/v1/completions", {"prompt": ["a"] * 300, "n": 4, "max_tokens": 1}, 400, "prompt"),
    (
        "/tokenize",
        {
            "messages": [{"role": "user", "content": "x"}],
            "chat_template_kwargs": {"chat_template": "x"},
        },
        400,
        "chat_template",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_input_gets_openai_error_and_server_keeps_serving(
    server, http, path, body, status, param
):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param
    assert (
        http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2}
        ).status_code
        == 200
    )


def test_an_internal_error_is_a_500_and_the_connection_keeps_serving(server, http, monkeypatch):
    """A bug in a route is a 500 in OpenAI's shape, and the client's keep-alive connection
    serves its next request (Starlette's last-resort handler would have uvicorn drop it)."""
    frontend = server[2]

    async def broken(_):
        raise RuntimeError("a bug")

    monkeypatch.setattr(frontend, "tokenize", broken)
    r = http.post("/tokenize", json={"prompt": "x"})
    assert r.status_code == 500, r.text
    assert r.json()["error"] == {
        "message": "Internal server error: RuntimeError",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    monkeypatch.undo()
    ok = http.post("/tokenize", json={"prompt": "x"})  # the same connection, reused
    assert ok.status_code == 200 and ok.json()["count"] >= 1


def test_a_client_gone_mid_upload_is_no_internal_error(server, http, caplog):
    host, port = server[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")  # fmt: skip
        time.sleep(0.3)
    time.sleep(0.5)
    assert not [r for r in caplog.records if "internal error" in r.getMessage()]
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_limits_are_the_servers(server, http):
    """--max-n, --max-logprobs and --max-stop-strings move the bounds."""
    settings = server[3]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    before = settings.limits
    settings.limits = dataclasses.replace(before, max_n=2, max_logprobs=30, max_stop_strings=1)
    try:
        assert http.post("/v1/completions", json={**body, "n": 3}).json()["error"]["param"] == "n"
        assert http.post("/v1/completions", json={**body, "n": 2}).status_code == 200
        assert http.post("/v1/completions", json={**body, "logprobs": 30}).status_code == 200
        r = http.post("/v1/completions", json={**body, "stop": ["a", "b"]})
        assert r.status_code == 400 and "--max-stop-strings" in r.json()["error"]["message"]
        settings.limits = dataclasses.replace(before, max_logprobs=-1, max_sequences_per_request=3)
        assert http.post("/v1/completions", json={**body, "logprobs": 40}).status_code == 200
        r = http.post("/v1/completions", json={**body, "logprobs": 10**6})  # past the vocabulary
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
        r = http.post("/v1/completions", json={**body, "prompt": ["a", "b"], "n": 2})
        assert "--max-sequences-per-request" in r.json()["error"]["message"]
    finally:
        settings.limits = before


def test_a_client_that_stops_reading_loses_its_stream_not_the_engine(server, http):
    """A streaming client that reads nothing: once the socket buffers are full, a chunk
    waits --stream-send-timeout, then the stream ends, the engine request is aborted long
    before its max_tokens, and the connection is closed."""
    base, sched, frontend, settings, _ = server
    before = settings.limits
    settings.limits = dataclasses.replace(before, stream_send_timeout=1.0)
    aborts = len(sched.ids_of(Abort))
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": MAX_LEN - 16, "n": 4,
                       "logprobs": 20, "stream": True}).encode()  # fmt: skip
    host, port = base.removeprefix("http://").split(":")
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((host, int(port)))
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            deadline = time.monotonic() + 60
            while len(sched.ids_of(Abort)) == aborts and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(sched.ids_of(Abort)) > aborts, "the request was not aborted"
            assert frontend.num_live == 0
            s.settimeout(10)
            received = b""
            while chunk := s.recv(1 << 16):  # now read: what was buffered, then the close
                received += chunk
    finally:
        settings.limits = before
    assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
    assert received.count(b'"finish_reason":"length"') == 0
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_prompt_too_long_reports_both_numbers(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 2000, "max_tokens": 100})
    assert r.status_code == 400
    assert (
        "you requested 2100 tokens (2000 in the messages, 100 in the completion)"
        in r.json()["error"]["message"]
    )


def test_huge_body_is_rejected(http):
    r = http.post(
        "/v1/completions",
        content=b'{"prompt": "' + b"a" * (10 << 20) + b'"}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_draining_dead_and_queue_full(server, http):
    _, _, frontend, settings, _ = server
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    frontend.draining = True
    try:
        assert http.post("/v1/completions", json=ok).status_code == 503
    finally:
        frontend.draining = False
    settings.max_num_queued_reqs = 0
    try:
        r = http.post("/v1/completions", json=ok)
        assert r.status_code == 429 and r.json()["error"]["code"] == 429
    finally:
        settings.max_num_queued_reqs = None
    assert http.post("/v1/completions", json=ok).status_code == 200


def test_engine_death_fails_live_requests(server, http):
    """EngineDead ends live requests with 503 and /health reports it until reset."""
    _, _, frontend, _, _ = server

    body = {"model": MODEL, "prompt": "x", "max_tokens": 1500}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(http.post, "/v1/completions", json=body)
        deadline = time.monotonic() + 5
        while frontend.num_live == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        # The launcher's notice travels on the api_server's own input socket.
        with PushSocket[ApiServerInput](frontend.endpoints.outputs, ApiServerInput) as launcher:
            launcher.send(EngineDead("engine died"))
            r = fut.result(20)
    assert r.status_code == 503 and r.json()["error"]["message"] == "engine died"
    assert http.get("/health").status_code == 503
    assert http.post("/v1/completions", json=body).status_code == 503
    frontend.errored = False


def test_api_key():
    settings = ServerSettings([MODEL], api_key="s3cret")
    app = build_app(EngineFrontend(FrontendEndpoints("a", "b", ("c",)), max_model_len=8), settings)
    transport = httpx.ASGITransport(app=app)

    async def go():
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r1 = await c.get("/v1/models")
            r2 = await c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
            r3 = await c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
            r4 = await c.get("/version")
            r5 = await c.get("/v1/models", headers={"x-api-key": "s3cret"})  # Anthropic's
            r6 = await c.get("/v1/models", headers={"x-api-key": "Bearer s3cret"})
            return r1, r2, r3, r4, r5, r6

    r1, r2, r3, r4, r5, r6 = asyncio.run(go())
    assert r1.status_code == r2.status_code == r6.status_code == 401
    assert r1.json()["error"]["code"] == 401
    assert r3.status_code == 200 and r4.status_code == 200 and r5.status_code == 200
    assert r3.json()["data"][0]["id"] == MODEL

    # Every /v1 route of the app, whatever its method, is refused without the key.
    routes = [(r.path, m) for r in app.routes if r.path.startswith("/v1") for m in r.methods]

    async def unauthorized():
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [(await c.request(m, p, json={})).status_code for p, m in routes]

    assert len(routes) >= 3 and set(asyncio.run(unauthorized())) == {401}


def test_request_ids_from_header_or_body(server, http):
    """vLLM's rule: the response id is ``cmpl-{X-Request-Id | request_id | random}``; with
    --enable-request-id-headers every response carries the X-Request-Id header."""
    sched = server[1]
    body = {"prompt": "hi", "max_tokens": 2}
    r = http.post("/v1/completions", json=body, headers={"X-Request-Id": "abc-1"})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-abc-1"
    assert r.headers["x-request-id"] == "abc-1"
    r = http.post("/v1/chat/completions", json=_chat_body("xyz"))
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-xyz"
    r = http.post("/v1/completions", json=body)
    assert r.json()["id"].startswith("cmpl-") and len(r.headers["x-request-id"]) == 32
    assert http.get("/v1/models", headers={"X-Request-Id": "m"}).headers["x-request-id"] == "m"

    # A client's id need not be unique: two requests in flight with one id both complete.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        same = [
            pool.submit(
                http.post,
                "/v1/completions",
                json={"prompt": "hi", "max_tokens": 20},
                headers={"X-Request-Id": "dup"},
            )
            for _ in range(2)
        ]
        results = [f.result() for f in same]
    assert [x.status_code for x in results] == [200, 200]
    assert [x.json()["id"] for x in results] == ["cmpl-dup", "cmpl-dup"]
    engine_ids = [m.req_id for m in sched.received if isinstance(m, TokenizedRequest)]
    dup_ids = [i for i in engine_ids if i.startswith("cmpl-dup-")]
    assert len(dup_ids) == len(set(dup_ids)) == 2


def _chat_body(request_id: str) -> dict:
    return {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "request_id": request_id,
    }


def test_tools_shown_only_and_text_format_are_accepted(http):
    for body in (
        _chat(tools=[_TOOL], tool_choice="none"),
        _chat(tools=[_TOOL], tool_choice=None),  # an explicit null is "none" (vLLM)
        _chat(response_format={"type": "text"}),
    ):
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]


def test_a_group_is_accepted_or_refused_whole(server, http):
    """Streaming two prompts, the second too long: always a 400 (the answer waits for the
    first delta, and no prompt of a refused group reaches the scheduler)."""
    sched = server[1]
    seen = len(sched.received)
    body = {"model": MODEL, "prompt": ["x", "word " * 4000], "max_tokens": 5, "stream": True}
    for _ in range(8):
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        assert "maximum context length" in r.json()["error"]["message"]
    assert not [m for m in sched.received[seen:] if isinstance(m, TokenizedRequest)]
