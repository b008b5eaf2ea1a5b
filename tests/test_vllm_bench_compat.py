"""`vllm bench serve` against a real ``actorserve serve``: its exact requests, the shapes it parses.

Request bodies are copied from vLLM 0.33.0:
- ``vllm/benchmarks/lib/endpoint_request_func.py::async_request_openai_completions``
  (``--backend vllm`` and ``--backend openai``), with ``_update_payload_common`` adding
  ``ignore_eos`` and the ``extra_body`` that ``serve.py::main_async`` builds from the
  sampling flags (``--temperature 0`` -> ``"temperature": 0.0``);
- ``vllm/benchmarks/serve.py::get_first_model_from_server`` (``GET /v1/models``: ``id`` is
  sent as the model, ``root`` is loaded as the tokenizer when ``--model`` is not given) and
  ``_align_prompts_to_server_tokenizer`` (``/tokenize`` and ``/detokenize`` with
  ``model=root`` in that case).

``vllm_messages`` mirrors that client's ``StreamedResponseHandler``: SSE messages split on
blank lines, ``data: `` stripped; text comes from ``choices[0].text`` of chunks with choices,
and usage is read only from a chunk whose ``choices`` is empty.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from tests.server_utils import RemoteServer

MAX_TOKENS = 8  # the CPU engine is slow on a shared machine: keep every generation short
# Greedy SmolLM2 answers this in 7 tokens and then emits EOS (checked by the control request).
EARLY_EOS_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with RemoteServer() as s:
        s.wait_ready()
        yield s


@pytest.fixture(scope="module")
def model_card(server: RemoteServer) -> dict[str, Any]:
    data = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    return dict(data[0])


@pytest.fixture(scope="module")
def tokenizer(model_card: dict[str, Any]) -> Any:
    """The tokenizer `vllm bench serve` loads when not given --tokenizer: ``root``'s folder."""
    return AutoTokenizer.from_pretrained(model_card["root"])


def random_prompt(tok: Any, num_tokens: int, seed: int) -> str:
    """A prompt as vLLM's ``random`` dataset makes one: random non-special ids, decoded."""
    special = set(tok.all_special_ids)
    allowed = [i for i in range(tok.vocab_size) if i not in special]
    rng = random.Random(seed)
    return str(tok.decode([rng.choice(allowed) for _ in range(num_tokens)]))


def bench_payload(model: str, prompt: str, *, logprobs: int | None = None) -> dict[str, Any]:
    """``async_request_openai_completions``' body under ``--ignore-eos --temperature 0``."""
    return {
        "model": model,
        "prompt": prompt,
        "repetition_penalty": 1.0,
        "max_tokens": MAX_TOKENS,
        "logprobs": logprobs,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }


def vllm_messages(body: str) -> list[str]:
    """The SSE payloads vLLM's client sees, in order (comments dropped)."""
    messages = [m.strip() for m in body.split("\n\n")]
    return [m.removeprefix("data: ") for m in messages if m and not m.startswith(":")]


async def post_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], i: int) -> str:
    headers = {"x-request-id": f"bench-0123abcd-{i}"}  # --request-id-prefix's header
    async with client.stream("POST", url, json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        return "".join([part async for part in r.aiter_text()])


def check_stream(body: str) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """Assert the shape vLLM's client parses; return (text, chunks with choices, usage)."""
    messages = vllm_messages(body)
    assert messages[-1] == "[DONE]" and "[DONE]" not in messages[:-1]
    datas = [json.loads(m) for m in messages[:-1]]
    chunks = [d for d in datas if d.get("choices")]
    assert chunks, "no chunk with choices: vLLM marks the request failed (no TTFT)"
    assert all(isinstance(c["choices"][0]["text"], str) for c in chunks)
    final = datas[-1]
    assert final["choices"] == [], "usage must ride on a chunk without choices"
    assert final["usage"] is not None
    return "".join(c["choices"][0]["text"] for c in chunks), chunks, final["usage"]


def test_model_card_and_tokenize_as_vllm_bench(
    server: RemoteServer, model_card: dict[str, Any], tokenizer: Any
) -> None:
    prompt = random_prompt(tokenizer, 64, seed=0)
    expected = tokenizer.encode(prompt, add_special_tokens=False)
    # With --model, vLLM sends the served name; without, the card's root (a folder path).
    for model in (model_card["id"], model_card["root"]):
        r = httpx.post(
            f"{server.url}/tokenize",
            json={"model": model, "prompt": prompt, "add_special_tokens": False},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == expected
        r = httpx.post(
            f"{server.url}/detokenize",
            json={"model": model, "tokens": expected[:32]},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["prompt"] == tokenizer.decode(expected[:32])
    r = httpx.post(f"{server.url}/tokenize", json={"model": "nope", "prompt": "x"}, timeout=60)
    assert r.status_code == 404


@pytest.mark.parametrize("logprobs", [None, 1])
def test_concurrent_bench_streams(
    server: RemoteServer, model_card: dict[str, Any], tokenizer: Any, logprobs: int | None
) -> None:
    prompts = [random_prompt(tokenizer, 48, seed=s) for s in range(4)]
    url = f"{server.url}/v1/completions"

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *[
                    post_stream(
                        client, url, bench_payload(model_card["id"], p, logprobs=logprobs), i
                    )
                    for i, p in enumerate(prompts)
                ]
            )

    for prompt, body in zip(prompts, asyncio.run(run()), strict=True):
        text, chunks, usage = check_stream(body)
        # vLLM replaces its own prompt length and output count with these.
        assert usage["prompt_tokens"] == len(tokenizer.encode(prompt, add_special_tokens=False))
        assert usage["completion_tokens"] == MAX_TOKENS
        assert usage["total_tokens"] == usage["prompt_tokens"] + MAX_TOKENS
        assert len(chunks) <= MAX_TOKENS
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        lps = [c["choices"][0]["logprobs"] for c in chunks]
        if logprobs is None:
            assert lps == [None] * len(chunks)
        else:  # --logprobs 1: the sampled token's logprob, one entry per generated token
            assert sum(len(lp["tokens"]) for lp in lps) == MAX_TOKENS
            assert all(x <= 0.0 for lp in lps for x in lp["token_logprobs"])
            assert all(len(top) >= 1 for lp in lps for top in lp["top_logprobs"])
        # The same request unstreamed gives the same greedy text.
        full = httpx.post(
            url,
            json={
                **bench_payload(model_card["id"], prompt),
                "stream": False,
                "stream_options": None,
            },
            timeout=120,
        ).json()
        assert full["choices"][0]["text"] == text


def test_ignore_eos_generates_max_tokens(server: RemoteServer, model_card: dict[str, Any]) -> None:
    url = f"{server.url}/v1/completions"
    payload = bench_payload(model_card["id"], EARLY_EOS_PROMPT)
    unstreamed = {k: v for k, v in payload.items() if k != "stream_options"}
    control = httpx.post(
        url, json={**unstreamed, "ignore_eos": False, "stream": False}, timeout=120
    ).json()
    assert control["choices"][0]["finish_reason"] == "stop", "the control must hit EOS early"
    assert control["usage"]["completion_tokens"] < MAX_TOKENS

    async def run() -> str:
        async with httpx.AsyncClient(timeout=120) as client:
            return await post_stream(client, url, payload, 0)

    text, chunks, usage = check_stream(asyncio.run(run()))
    assert usage["completion_tokens"] == MAX_TOKENS
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert text.startswith(control["choices"][0]["text"])


def test_one_chunk_per_generated_token(server: RemoteServer, model_card: dict[str, Any]) -> None:
    async def run() -> str:
        async with httpx.AsyncClient(timeout=120) as client:
            payload = bench_payload(model_card["id"], EARLY_EOS_PROMPT)
            return await post_stream(client, f"{server.url}/v1/completions", payload, 0)

    _, chunks, usage = check_stream(asyncio.run(run()))
    assert len(chunks) == usage["completion_tokens"] == MAX_TOKENS
