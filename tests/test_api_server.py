"""The OpenAI HTTP server against a fake scheduler, with the real tokenizer and detokenizer loops.

Every process of the serve path runs as a thread here and they talk over real
ipc:// sockets; only the scheduler is fake: it "generates" a fixed script of
tokens (shifted by the seed), one token per 2 ms step. The app runs on uvicorn
on 127.0.0.1 and is driven with the official ``openai`` client and httpx.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from services.api_server.app import ServerSettings, build_app
from services.api_server.frontend import EngineFrontend, FrontendEndpoints
from services.detokenizer.service import DetokenizerEndpoints, serve_detokenizer
from services.ipc import PullSocket, PushSocket, ipc_dir
from services.protocol import (
    Abort,
    ApiServerInput,
    EngineCoreInput,
    EngineDead,
    FinishRequest,
    RequestTokens,
    TokenBatch,
    TokenizedRequest,
    TokenLogprobs,
)
from services.tokenizer.loader import load_serving_tokenizer
from services.tokenizer.processor import RequestProcessor
from services.tokenizer.service import TokenizerEndpoints, serve_tokenizer

MODEL = "smollm2-test"
MAX_LEN = 2048
SCRIPT = "Hello! 你好，世界 🎉 The quick brown fox jumps over the lazy dog. " * 40


class FakeScheduler:
    """Answers TokenizedRequests with SCRIPT's tokens (from offset seed % 5), one per step."""

    def __init__(self, core_ep: str, batches_ep: str, tok) -> None:
        self.script = tok.encode(SCRIPT, add_special_tokens=False).ids
        self.inbox = PullSocket[EngineCoreInput](core_ep, EngineCoreInput, bind=True)
        self.out = PushSocket[TokenBatch](batches_ep, TokenBatch)
        self.received: list[EngineCoreInput] = []
        self.running: dict[str, tuple[TokenizedRequest, int]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            while (msg := self.inbox.recv(timeout_ms=0 if self.running else 20)) is not None:
                self.received.append(msg)
                if isinstance(msg, TokenizedRequest):
                    self.running[msg.req_id] = (msg, 0)
                else:
                    ids = msg.req_ids if isinstance(msg, Abort) else [msg.req_id]
                    items = [
                        RequestTokens(i, [], "abort") for i in ids if self.running.pop(i, None)
                    ]
                    self.out.send(TokenBatch(items))
            items = [self.step(req, k) for req, k in list(self.running.values())]
            if items:
                self.out.send(TokenBatch(items))
                time.sleep(0.002)
        self.inbox.close()
        self.out.close()

    def step(self, req: TokenizedRequest, k: int) -> RequestTokens:
        s = req.sampling
        token = self.script[(k + (s.seed or 0) % 5) % len(self.script)]
        finish, stop_reason = None, None
        if token in s.stop_token_ids:
            finish, stop_reason = "stop", token
        elif k + 1 >= s.max_tokens:
            finish = "length"
        if finish:
            del self.running[req.req_id]
        else:
            self.running[req.req_id] = (req, k + 1)
        lps = []
        if s.logprobs is not None:
            top = [token + j for j in range(s.logprobs)]
            lps = [TokenLogprobs(token, -0.25, 1, top, [-0.25 - j for j in range(s.logprobs)])]
        return RequestTokens(
            req.req_id,
            [token],
            finish,
            stop_reason,
            lps,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_cached_tokens=2,
        )

    def ids_of(self, kind: type) -> list:
        return [m for m in self.received if isinstance(m, kind)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    info = load_serving_tokenizer()
    d = ipc_dir()
    fe = FrontendEndpoints(d.endpoint("tok_req"), d.endpoint("api_out"), d.endpoint("core"))
    te = TokenizerEndpoints(fe.tokenizer_requests, fe.engine_core, d.endpoint("specs"), fe.outputs)
    de = DetokenizerEndpoints(
        d.endpoint("batches"), te.detokenizer_specs, fe.engine_core, fe.outputs
    )
    sched = FakeScheduler(fe.engine_core, de.token_batches, info.tokenizer)
    stop = threading.Event()
    threads = [
        sched.thread,
        threading.Thread(target=serve_tokenizer, args=(RequestProcessor(info, MAX_LEN), te, stop)),
        threading.Thread(target=serve_detokenizer, args=(info.tokenizer, de, stop)),
    ]
    frontend = EngineFrontend(fe, max_model_len=MAX_LEN)
    settings = ServerSettings(
        [MODEL], max_request_body_bytes=1 << 20, enable_request_id_headers=True
    )
    port = _free_port()
    uv = uvicorn.Server(
        uvicorn.Config(
            build_app(frontend, settings),
            host="127.0.0.1",
            port=port,
            loop="uvloop",
            log_level="warning",
        )
    )
    threads.append(threading.Thread(target=uv.run))
    for t in threads:
        t.daemon = True
        t.start()
    deadline = time.monotonic() + 20
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    base = f"http://127.0.0.1:{port}"
    yield base, sched, frontend, settings, info.tokenizer
    uv.should_exit = True
    sched.stop.set()
    stop.set()
    for t in threads:
        t.join(5)
    d.cleanup()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=20)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server[0], timeout=20) as c:
        yield c


def script_text(tok, n: int, seed: int = 0) -> str:
    ids = tok.encode(SCRIPT, add_special_tokens=False).ids
    return tok.decode(ids[seed % 5 : seed % 5 + n])


def test_completion_usage_and_text(server, client):
    tok = server[4]
    r = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=12)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    assert r.choices[0].text == script_text(tok, 12)
    assert r.choices[0].finish_reason == "length"
    n_prompt = len(tok.encode("Say hi").ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 12)
    assert r.usage.total_tokens == n_prompt + 12
    assert r.usage.prompt_tokens_details.cached_tokens == 2


def test_completion_stream_chunks_and_usage(server, client):
    tok = server[4]
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=[1, 2, 3],
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == script_text(tok, 20)
    assert len([c for c in chunks if c.choices]) > 3  # really streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_role_first_then_content(server, client):
    tok = server[4]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=8,
            stream=True,
        )
    )
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == script_text(tok, 8)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_n2_seeded_choices_differ(server, client):
    tok = server[4]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, seed=1, max_tokens=6
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == [
        script_text(tok, 6, 1),
        script_text(tok, 6, 2),
    ]
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 12
    ids = [m.req_id for m in server[1].ids_of(TokenizedRequest) if m.req_id.startswith(r.id)]
    assert sorted(ids) == [f"{r.id}-0", f"{r.id}-1"]


def test_sampling_fields_reach_the_scheduler(server, http):
    sched = server[1]
    seen = len(sched.received)
    body = {
        "model": MODEL,
        "prompt": [[5, 6, 7], [8, 9]],
        "max_tokens": 3,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.1,
        "seed": 11,
        "stop": "zz",
        "stop_token_ids": [3],
        "ignore_eos": True,
        "min_tokens": 1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "cache_salt": "salt",
        "priority": -3,
        "logit_bias": {"5": 200, "6": -1.5},
        "allowed_token_ids": [5, 6, 7],
        "prompt_logprobs": 2,
        "bad_words": ["hello world"],
        "unknown_field": "ignored",
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    reqs = sorted(
        (m for m in sched.received[seen:] if isinstance(m, TokenizedRequest)),
        key=lambda m: m.req_id,
    )
    assert [m.prompt_token_ids for m in reqs] == [[5, 6, 7], [8, 9]]
    s, m = reqs[0].sampling, reqs[0]
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.5, 0.9, 7, 0.1, 11)
    assert (s.stop, s.stop_token_ids, s.ignore_eos, s.min_tokens) == (["zz"], [3], True, 1)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (s.skip_special_tokens, s.include_stop_str_in_output, s.max_tokens, s.n) == (
        False,
        True,
        3,
        1,
    )
    tok = server[4]
    assert s.bad_words_token_ids == [
        tok.encode("hello world", add_special_tokens=False).ids,
        tok.encode(" hello world", add_special_tokens=False).ids,
    ]
    assert (s.logit_bias, s.allowed_token_ids, s.prompt_logprobs) == (
        {5: 100.0, 6: -1.5},  # clamped to OpenAI's range
        [5, 6, 7],
        2,
    )
    assert (m.cache_salt, m.priority, m.eos_token_id) == (
        "salt",
        -3,
        server[4].token_to_id("<|im_end|>"),
    )


def test_chat_stream_n2_with_usage(server, client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            n=2,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == [0, 1]
    finished = sorted(
        c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason
    )
    assert finished == [0, 1]
    assert chunks[-1].usage.completion_tokens == 10


def test_completion_batch_prompts_and_n(server, client):
    r = client.completions.create(model=MODEL, prompt=["a", "b c d"], n=2, max_tokens=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 1 + 3 and r.usage.completion_tokens == 12


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_truncates_and_finishes_engine_request(server, client, stream):
    tok = server[4]
    full = script_text(tok, 40)
    kw = dict(model=MODEL, prompt="x", max_tokens=40, stop=["fox"], stream=stream)
    if stream:
        chunks = list(client.completions.create(**kw))
        text = "".join(c.choices[0].text for c in chunks)
        last = chunks[-1].choices[0]
    else:
        r = client.completions.create(**kw)
        text, last = r.choices[0].text, r.choices[0]
    assert text == full[: full.index("fox")]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == "fox"
    deadline = time.monotonic() + 5
    while not server[1].ids_of(FinishRequest) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any(f.stop_reason == "fox" for f in server[1].ids_of(FinishRequest))


def test_stop_token_id_and_include_stop_str(server, client):
    tok = server[4]
    script = tok.encode(SCRIPT, add_special_tokens=False).ids
    stop_id = script[4]
    r = client.completions.create(
        model=MODEL, prompt="x", max_tokens=30, extra_body={"stop_token_ids": [stop_id]}
    )
    assert r.choices[0].text == tok.decode(script[:4])
    assert r.choices[0].model_extra["stop_reason"] == stop_id
    r = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=40,
        stop=["fox"],
        extra_body={"include_stop_str_in_output": True},
    )
    assert r.choices[0].text.endswith("fox")


def test_logprobs_shapes(server, client):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.token_logprobs == [-0.25] * 4 and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == r.choices[0].text
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 2
    assert content[0].bytes == list(content[0].token.encode())


def test_echo_prompt_tokens(server, client):
    tok = server[4]
    ids = tok.encode("Echo me").ids
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, echo=True)
    assert r.choices[0].text == "Echo me" + script_text(tok, 2)


def test_client_disconnect_aborts(server):
    base, sched = server[0], server[1]
    body = {"model": MODEL, "prompt": "long", "max_tokens": 1500, "stream": True}
    with (
        httpx.Client(base_url=base, timeout=20) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        first = json.loads(next(line for line in r.iter_lines() if line)[len("data: ") :])
    engine_id = f"{first['id']}-0"
    deadline = time.monotonic() + 5
    while engine_id not in {i for a in sched.ids_of(Abort) for i in a.req_ids}:
        assert time.monotonic() < deadline, "no Abort reached the scheduler"
        time.sleep(0.02)
    assert engine_id not in sched.running


def test_client_disconnect_aborts_non_streaming(server):
    base, sched = server[0], server[1]
    seen = len(sched.received)
    body = {"model": MODEL, "prompt": "long", "max_tokens": 1500}
    with httpx.Client(base_url=base, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=body)
    (req,) = [m for m in sched.received[seen:] if isinstance(m, TokenizedRequest)]
    deadline = time.monotonic() + 5
    while req.req_id not in {i for a in sched.ids_of(Abort) for i in a.req_ids}:
        assert time.monotonic() < deadline, "no Abort reached the scheduler"
        time.sleep(0.02)


def test_models_health_version_metrics_tokenize(server, http):
    tok = server[4]
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == MAX_LEN
    assert http.get("/health").status_code == 200
    assert "version" in http.get("/version").json()
    assert http.get("/metrics").status_code == 200
    t = http.post("/tokenize", json={"prompt": "你好 world"}).json()
    assert t["tokens"] == tok.encode("你好 world").ids and t["count"] == len(t["tokens"])
    assert http.post("/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "你好 world"}
    t = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert tok.decode(t["tokens"], skip_special_tokens=False).endswith("<|im_start|>assistant\n")


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
    ("/v1/chat/completions", _chat(tools=[_TOOL]), 400, "tool_choice"),
    ("/v1/chat/completions", _chat(tools=[_TOOL], tool_choice="required"), 400, "tool_choice"),
    ("/v1/chat/completions", _chat(tool_choice="auto"), 400, "tool_choice"),
    (
        "/v1/chat/completions",
        _chat(response_format={"type": "json_object"}),
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
        while frontend.num_running == 0 and time.monotonic() < deadline:
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
    app = build_app(EngineFrontend(FrontendEndpoints("a", "b", "c"), max_model_len=8), settings)
    transport = httpx.ASGITransport(app=app)

    async def go():
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r1 = await c.get("/v1/models")
            r2 = await c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
            r3 = await c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
            r4 = await c.get("/version")
            return r1, r2, r3, r4

    r1, r2, r3, r4 = asyncio.run(go())
    assert r1.status_code == r2.status_code == 401
    assert r1.json()["error"]["code"] == 401
    assert r3.status_code == 200 and r4.status_code == 200
    assert r3.json()["data"][0]["id"] == MODEL


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
