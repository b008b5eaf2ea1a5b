"""``/v1/embeddings`` and vLLM's ``/pooling`` on a real ``--runner pooling`` server, with the
official ``openai`` client, against HF transformers' ``AutoModel`` hidden states.

The server pools MEAN (``--pooler-config``) with a 64-token step budget, so every prompt
longer than that is computed over several steps (chunked prefill) and every hidden state
must be in the mean; LAST and CLS pooling, and the pooling math alone, are checked against
HF in ``tests/test_pooling.py``.
"""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest

from services.protocol import PoolingParams
from tests.server_utils import RemoteServer, wait_metric
from tests.test_pooling import ATOL, hf_base, hf_vector  # noqa: F401 (hf_base: a fixture)

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
MEAN = PoolingParams("MEAN", normalize=True)
POOLER = json.dumps({"pooling_type": "MEAN", "normalize": True})


@pytest.fixture(scope="module")
def server():
    with RemoteServer(
        "--runner", "pooling", "--pooler-config", POOLER, "--max-num-batched-tokens", "64"
    ) as s:
        s.wait_ready()
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _check(vec, want) -> None:
    np.testing.assert_allclose(np.asarray(vec, dtype=np.float32), want, atol=ATOL, rtol=1e-3)


def test_openai_client_batch_of_strings(client, hf_base, hf_reference, greedy_prompts):  # noqa: F811
    texts = ["The capital of France is Paris.", "def add(a, b):\n    return a + b", "Hi"]
    out = client.embeddings.create(model=MODEL, input=texts)
    assert out.object == "list" and out.model == MODEL
    assert [d.index for d in out.data] == [0, 1, 2]
    ids = [hf_reference.tokenizer(t).input_ids for t in texts]
    for d, prompt in zip(out.data, ids, strict=True):
        assert d.object == "embedding"
        assert len(d.embedding) == hf_reference.model.config.hidden_size
        _check(d.embedding, hf_vector(hf_base, prompt, MEAN))
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(len(p) for p in ids)


def test_token_ids_and_chunked_prefill(client, hf_base, long_prompt, greedy_prompts):  # noqa: F811
    assert len(long_prompt) > 4 * 64  # five steps or more at --max-num-batched-tokens 64
    out = client.embeddings.create(model=MODEL, input=long_prompt)  # one list of ids
    _check(out.data[0].embedding, hf_vector(hf_base, long_prompt, MEAN))
    prompts = greedy_prompts[:4]
    out = client.embeddings.create(model=MODEL, input=prompts)  # a list of lists of ids
    for d, prompt in zip(out.data, prompts, strict=True):
        _check(d.embedding, hf_vector(hf_base, prompt, MEAN))
    assert out.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_base64_dimensions_and_normalize(client, server, hf_base, greedy_prompts):  # noqa: F811
    prompt = greedy_prompts[1]
    plain = client.embeddings.create(model=MODEL, input=[prompt]).data[0].embedding
    b64 = client.embeddings.create(model=MODEL, input=[prompt], encoding_format="base64")
    raw = b64.data[0].embedding
    if isinstance(raw, str):  # the client hands back what the server sent when asked
        raw = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    np.testing.assert_array_equal(np.asarray(raw, dtype=np.float32), np.float32(plain))
    cut = client.embeddings.create(model=MODEL, input=[prompt], dimensions=32).data[0].embedding
    assert len(cut) == 32
    _check(cut, hf_vector(hf_base, prompt, PoolingParams("MEAN", dimensions=32)))
    assert np.linalg.norm(cut) == pytest.approx(1.0, abs=1e-5)
    raw_vec = (
        client.embeddings.create(model=MODEL, input=[prompt], extra_body={"normalize": False})
        .data[0]
        .embedding
    )
    _check(raw_vec, hf_vector(hf_base, prompt, PoolingParams("MEAN", normalize=False)))


def test_pooling_route(server, hf_base, greedy_prompts):  # noqa: F811
    r = httpx.post(
        f"{server.url}/pooling", json={"model": MODEL, "input": greedy_prompts[:2]}, timeout=120
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("pool-") and body["object"] == "list"
    assert [d["object"] for d in body["data"]] == ["pooling", "pooling"]
    for d, prompt in zip(body["data"], greedy_prompts[:2], strict=True):
        _check(d["data"], hf_vector(hf_base, prompt, MEAN))
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in greedy_prompts[:2])
    r = httpx.post(f"{server.url}/pooling", json={"input": "x", "task": "encode"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "task"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions"),
        ("/v1/embeddings", {"input": "hi", "dimensions": 100_000}, "dimensions"),
        ("/v1/embeddings", {"input": "hi", "encoding_format": "bytes_le"}, "encoding_format"),
        ("/v1/embeddings", {"input": [[1, 2, 10**9]]}, "prompt"),
        ("/v1/embeddings", {"input": "word " * 3000}, "input"),
        (
            "/v1/embeddings",
            {"input": "hi", "truncate_prompt_tokens": 5000},
            "truncate_prompt_tokens",
        ),
        ("/v1/embeddings", {"input": "hi", "model": "nope"}, "model"),
        ("/v1/completions", {"prompt": "hi", "model": MODEL}, None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, None),
    ],
)
def test_errors(server, path, body, param):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["message"] and error["param"] == param, error
    if param is None:
        assert "does not support" in error["message"]


def test_messages_on_a_pooling_server_is_an_anthropic_error(server):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 400
    assert r.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "The model does not support Messages API",
        },
    }


def test_truncate_prompt_tokens(client, hf_base, long_prompt):  # noqa: F811
    out = client.embeddings.create(
        model=MODEL, input=long_prompt, extra_body={"truncate_prompt_tokens": 20}
    )
    assert out.usage.prompt_tokens == 20
    _check(out.data[0].embedding, hf_vector(hf_base, long_prompt[-20:], MEAN))


def test_kv_blocks_freed_and_still_serving(server, client):
    """Last: after every request above (errors included), no KV block is held and the
    server still answers."""
    assert wait_metric(server, "vllm:kv_cache_usage_perc", 0.0, timeout_s=30)
    assert wait_metric(server, "vllm:num_requests_running", 0.0, timeout_s=30)
    assert len(client.embeddings.create(model=MODEL, input="still here").data) == 1
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_generate_server_refuses_embeddings():
    with RemoteServer("--max-model-len", "256") as gen:
        gen.wait_ready()
        r = httpx.post(f"{gen.url}/v1/embeddings", json={"input": "hi"}, timeout=30)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "The model does not support Embeddings API"
        r = httpx.post(f"{gen.url}/pooling", json={"input": "hi"}, timeout=30)
        assert r.status_code == 400
        r = httpx.post(
            f"{gen.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200, r.text
