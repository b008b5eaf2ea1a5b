"""End-to-end: the official ``openai`` client against a real ``actorserve serve``.

One server for the module (CPU, the default model, fp32). Greedy outputs are
checked against the offline engine (``LLM``) run in this process on the same
prompts: the two share the model runner and scheduler but none of the
processes, sockets, tokenizer service, detokenizer service or HTTP layer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from launch.llm import LLM, SamplingParams
from tests.server_utils import RemoteServer, metric, sse_chunks, wait_metric

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]
CHAT = [{"role": "user", "content": "Name three colors."}]
MAX_TOKENS = 6  # the CPU engine is slow on a shared machine: keep every generation short


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with RemoteServer() as s:
        s.wait_ready()
        yield s
        leftovers = s.processes()
        s.popen.terminate()  # a clean drain, then nothing of ours may be left
        code = s.wait_exit(60)
        left = s.wait_all_gone(10)
    assert code == 0, f"launcher exited with {code} after SIGTERM:\n{s.log}"
    assert not left, f"processes left after shutdown: {left} (before: {leftovers})"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=2048, kv_cache_memory_bytes=96 << 20)


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(max_tokens: int = MAX_TOKENS, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- completions


def test_completions_greedy_equals_offline(client: openai.OpenAI, llm: LLM) -> None:
    expected = llm.generate(PROMPTS, greedy())
    resp = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [e.outputs[0].text for e in expected]
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert resp.usage.completion_tokens == sum(len(e.outputs[0].token_ids) for e in expected)

    # Streamed: the same text, chunk by chunk, and the usage chunk last.
    stream = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=PROMPTS[0],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected[0].outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == len(expected[0].outputs[0].token_ids)
    assert chunks[-1].usage.prompt_tokens == len(expected[0].prompt_token_ids)


def test_chat_greedy_equals_offline(client: openai.OpenAI, llm: LLM) -> None:
    (expected,) = llm.chat(CHAT, greedy())
    want = expected.outputs[0].text
    resp = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,  # type: ignore[arg-type]
    )
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == want
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)

    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=CHAT,
        max_completion_tokens=MAX_TOKENS,  # type: ignore[arg-type]
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n2_seeded_is_reproducible(client: openai.OpenAI, llm: LLM) -> None:
    def sample() -> list[str]:
        resp = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=PROMPTS[2],
            n=2,
            seed=1234,
            temperature=1.0,
            max_tokens=4,
        )
        assert sorted(c.index for c in resp.choices) == [0, 1]
        assert resp.usage is not None and resp.usage.completion_tokens == 2 * 4
        return [c.text for c in sorted(resp.choices, key=lambda c: c.index)]

    first = sample()
    assert sample() == first
    # Choice i is seeded with seed + i, as in vLLM and in the offline engine.
    (offline,) = llm.generate(
        PROMPTS[2], SamplingParams(n=2, seed=1234, temperature=1.0, max_tokens=4)
    )
    assert [o.text for o in offline.outputs] == first


def test_stop_string(client: openai.OpenAI, llm: LLM) -> None:
    (full,) = llm.generate(PROMPTS[1], greedy(10))
    text = full.outputs[0].text
    stop = text.strip()[len(text.strip()) // 2 :][:3]  # something the greedy text reaches
    want = text[: text.index(stop)]
    resp = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPTS[1], max_tokens=10, temperature=0, stop=stop
    )
    assert resp.choices[0].text == want
    assert resp.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=PROMPTS[1],
        max_tokens=10,
        temperature=0,
        stop=[stop],
        stream=True,
    )
    chunks = [c for c in streamed if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_equal_offline(client: openai.OpenAI, llm: LLM) -> None:
    (expected,) = llm.generate(PROMPTS[0], greedy(4, logprobs=2))
    lps = expected.outputs[0].logprobs
    assert lps is not None
    resp = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2
    )
    got = resp.choices[0].logprobs
    assert got is not None and got.token_logprobs is not None and got.top_logprobs is not None
    assert len(got.token_logprobs) == len(lps) == 4
    for value, top, ref in zip(got.token_logprobs, got.top_logprobs, lps, strict=True):
        assert value == pytest.approx(ref.logprob, abs=1e-3)
        assert 2 <= len(top) <= 3  # the top 2, plus the sampled token if not among them
        assert value == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the best token
        assert all(v <= 0.0 for v in top.values())

    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=CHAT,
        max_tokens=4,
        temperature=0,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0.0 for t in content)


def test_echo_logprobs_score_the_prompt(
    server: RemoteServer, client: openai.OpenAI, llm: LLM
) -> None:
    """lm-evaluation-harness's loglikelihood request: echo + logprobs, one token or none."""
    prompt = PROMPTS[0]
    (expected,) = llm.generate(prompt, greedy(1, logprobs=1, prompt_logprobs=1))
    ref = expected.prompt_logprobs
    assert ref is not None and len(ref) == len(expected.prompt_token_ids) >= 4
    for max_tokens in (1, 0):
        resp = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            logprobs=1,
            echo=True,
        )
        choice = resp.choices[0]
        lps = choice.logprobs
        assert lps is not None and lps.token_logprobs is not None and lps.top_logprobs is not None
        assert lps.tokens is not None and lps.text_offset is not None
        n = len(ref) + max_tokens
        assert len(lps.tokens) == len(lps.token_logprobs) == len(lps.top_logprobs) == n
        assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
        prompt_part = zip(
            lps.token_logprobs[1 : len(ref)], lps.top_logprobs[1 : len(ref)], ref[1:], strict=True
        )
        for got, top, want in prompt_part:
            assert want is not None and got == pytest.approx(want.logprob, abs=1e-3)
            assert top is not None and got in top.values() and 1 <= len(top) <= 2
        assert "".join(lps.tokens[: len(ref)]) == prompt
        assert lps.text_offset[0] == 0 and lps.text_offset[1] == len(lps.tokens[0])
        generated = expected.outputs[0].text if max_tokens else ""
        assert choice.text == prompt + generated
        if max_tokens:
            assert lps.token_logprobs[-1] == pytest.approx(
                expected.outputs[0].logprobs[0].logprob,  # type: ignore[index]
                abs=1e-3,
            )

    # Streamed, the offsets run on across chunks by token length (vLLM's rule), even where a
    # token renders as part of a character.
    def offsets(stream: bool, **extra: object) -> tuple[list[int], list[int]]:
        body = {"prompt": "Hi 你好", "max_tokens": 3, "temperature": 0, "echo": True}
        body |= {"logprobs": 1, "stream": stream, **extra}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        if not stream:
            lp = r.json()["choices"][0]["logprobs"]
            return lp["text_offset"], [len(t or {}) for t in lp["top_logprobs"]]
        chunks = sse_chunks(r.text)
        lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
        tops = [len(t or {}) for lp in lps for t in lp["top_logprobs"]]
        return [o for lp in lps for o in lp["text_offset"]], tops

    streamed, _ = offsets(True)
    assert len(streamed) > 4 and streamed == offsets(False)[0] == sorted(streamed)
    # Each echoed prompt token shows the top `logprobs`, however many prompt_logprobs asked.
    assert max(offsets(False, prompt_logprobs=3)[1]) <= 2

    # prompt_logprobs (vLLM's extra): per prompt token, a map of token id -> logprob/rank/text.
    resp = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        extra_body={"prompt_logprobs": 2},
    )
    got = (resp.choices[0].model_extra or {})["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ref)
    for entry, want, token_id in zip(got[1:], ref[1:], expected.prompt_token_ids[1:], strict=True):
        assert want is not None and 2 <= len(entry) <= 3  # the prompt token, plus the top 2
        mine = entry[str(token_id)]
        assert mine["logprob"] == pytest.approx(want.logprob, abs=1e-3)
        assert mine["rank"] == want.rank
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2]

    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=CHAT,
        max_tokens=1,
        temperature=0,  # type: ignore[arg-type]
        extra_body={"prompt_logprobs": 0},
    )
    got = (chat.model_extra or {})["prompt_logprobs"]
    assert chat.usage is not None and len(got) == chat.usage.prompt_tokens
    assert got[0] is None and all(len(e) == 1 for e in got[1:])

    # Streaming cannot carry them (vLLM's rule): a 400 naming the parameter.
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=prompt,
            stream=True,
            extra_body={"prompt_logprobs": 1},
        )
    assert err.value.body["param"] == "prompt_logprobs"  # type: ignore[index]


def test_logit_bias_and_allowed_token_ids(server: RemoteServer, client: openai.OpenAI) -> None:
    (token_id,) = httpx.post(f"{server.url}/tokenize", json={"prompt": " banana"}).json()["tokens"]
    forced = httpx.post(f"{server.url}/detokenize", json={"tokens": [token_id] * 3}).json()
    for extra in ({"logit_bias": {str(token_id): 100}}, {"allowed_token_ids": [token_id]}):
        resp = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=PROMPTS[0],
            max_tokens=3,
            temperature=0.8,
            seed=5,
            extra_body=extra,
        )
        assert resp.choices[0].text == forced["prompt"], extra


def test_return_token_ids(server: RemoteServer, llm: LLM) -> None:
    """vLLM's return_token_ids: the prompt's and the output's token ids beside the text."""
    (expected,) = llm.generate(PROMPTS[1], greedy())
    body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0}
    body["return_token_ids"] = True
    full = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert full["prompt_token_ids"] == expected.prompt_token_ids
    assert full["token_ids"] == expected.outputs[0].token_ids

    r = httpx.post(f"{server.url}/v1/completions", json=body | {"stream": True}, timeout=60)
    chunks = sse_chunks(r.text)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[0]["prompt_token_ids"] == expected.prompt_token_ids
    assert all(c["prompt_token_ids"] is None for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == expected.outputs[0].token_ids

    chat = {"messages": CHAT, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json()
    assert len(resp["prompt_token_ids"]) == resp["usage"]["prompt_tokens"]
    assert len(resp["choices"][0]["token_ids"]) == resp["usage"]["completion_tokens"] == 3
    plain = httpx.post(
        f"{server.url}/v1/completions", json=body | {"return_token_ids": False}, timeout=60
    )
    assert "token_ids" not in plain.json()["choices"][0]


# ---------------------------------------------------------------- concurrency


def test_32_concurrent_streams(server: RemoteServer, llm: LLM) -> None:
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(4)]
    # The reference: each prompt alone, so no batching can hide a cross-request mix-up.
    alone = [llm.generate(p, greedy(6))[0] for p in prompts]

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, object]:
        stream = await aclient.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = [], None
        async for chunk in stream:
            text += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
        return "".join(text), usage

    async def run_all() -> list[tuple[str, object]]:
        aclient = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1",
            api_key="unused",
            max_retries=0,
            timeout=300,
            http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=64)),
        )
        async with aclient:
            return await asyncio.gather(*(one(aclient, prompts[i % 4]) for i in range(32)))

    results = asyncio.run(run_all())
    for i, (text, usage) in enumerate(results):
        ref = alone[i % 4]
        assert text == ref.outputs[0].text, f"request {i}"
        assert usage is not None
        assert usage.prompt_tokens == len(ref.prompt_token_ids)  # type: ignore[attr-defined]
        assert usage.completion_tokens == len(ref.outputs[0].token_ids)  # type: ignore[attr-defined]


def test_client_disconnect_mid_stream(server: RemoteServer, client: openai.OpenAI) -> None:
    # Long enough (2000 tokens) that it cannot end by itself within the wait below.
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        timeout=120,
        json={"prompt": PROMPTS[0], "max_tokens": 2000, "ignore_eos": True, "stream": True},
    ) as r:
        assert r.status_code == 200
        events = (line for line in r.iter_lines() if line)  # SSE: blank lines between
        assert next(events).startswith("data: ")  # generating; now hang up
    # The aborted request gives back its sequence slot and its KV blocks. With
    # the /metrics gauges exported, watch them drain; either way the server
    # serves on. (The pool-exhaustion probe is in test_server_faults.py.)
    if metric(server, "vllm:num_requests_running") is not None:
        assert wait_metric(server, "vllm:num_requests_running", 0.0, timeout_s=10)
        assert metric(server, "vllm:kv_cache_usage_perc") == pytest.approx(0.0, abs=1e-6)
    resp = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPTS[0], max_tokens=2, temperature=0
    )
    assert resp.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- bad inputs

BAD_BODIES: list[tuple[str, bytes | dict[str, object], int, str | None]] = [
    ("unknown model", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("prompt too long", {"prompt": [1] * 2100, "max_tokens": 1}, 400, None),
    ("temperature < 0", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("top_p = 0", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p > 1", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("malformed JSON", b'{"prompt": "hi",', 400, None),
    ("wrong type", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', 400, None),
    (
        "stream_options without stream",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("10 MB body", b'{"prompt": "' + b"a" * (10 << 20) + b'"}', 413, None),
]
BAD_CHAT: list[tuple[str, dict[str, object], int, str | None]] = [
    ("empty messages", {"messages": []}, 400, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("wrong content type", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
]


def _post(server: RemoteServer, path: str, body: bytes | dict[str, object]) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(f"{server.url}{path}", json=body, timeout=60)
    return httpx.post(
        f"{server.url}{path}",
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [pytest.param("/v1/completions", b, s, p, id=name) for name, b, s, p in BAD_BODIES]
    + [pytest.param("/v1/chat/completions", b, s, p, id=name) for name, b, s, p in BAD_CHAT],
)
def test_bad_input_gets_openai_error(
    server: RemoteServer,
    path: str,
    body: bytes | dict[str, object],
    status: int,
    param: str | None,
) -> None:
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == status and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error


def test_server_keeps_serving_after_bad_inputs(server: RemoteServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=CHAT,
            max_tokens=-3,  # type: ignore[arg-type]
        )
    assert e.value.status_code == 400
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    resp = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=2, temperature=0
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 2
