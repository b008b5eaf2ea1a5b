"""The OpenAI HTTP server against a fake scheduler (tests/fake_engine.py): completions and
chat, streamed or not, sampling fields, stops, logprobs, echo and client disconnects.

Driven with the official ``openai`` client and httpx.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from services.protocol import (
    Abort,
    FinishRequest,
    TokenizedRequest,
)
from tests.fake_engine import MAX_LEN, MODEL, SCRIPT, script_text


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


def test_load_counts_requests_in_flight(server, http):
    """/load: vLLM's ``server_load`` and the waiting/running split, as the front end sees it."""
    assert http.get("/load").json() == {
        "server_load": 0,
        "num_requests_waiting": 0,
        "num_requests_running": 0,
    }
    body = {"model": MODEL, "prompt": "long", "max_tokens": 1500, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)  # past the first token: running, not waiting
        assert http.get("/load").json() == {
            "server_load": 1,
            "num_requests_waiting": 0,
            "num_requests_running": 1,
        }
    deadline = time.monotonic() + 5
    while http.get("/load").json()["server_load"]:
        assert time.monotonic() < deadline, "the closed stream still counts"
        time.sleep(0.02)
