"""Pooling (embeddings) through the real engine: the tokenizer's ``RequestProcessor``, the
scheduler and the model runner of the offline engine, against HF transformers'
``AutoModel(...).last_hidden_state`` on the default model (fp32, same weights).

Also the pooling math alone (``services/gpu_worker/pooler.py``: chunked accumulation equals
pooling the whole prompt at once) and ``--pooler-config`` parsing.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from launch.llm import LLM
from services.config import ConfigError, EngineConfig
from services.config.pooling import PoolerConfig
from services.gpu_worker.pooler import Pooler, from_bytes, pool_whole
from services.protocol import GenerateRequest, NewRequest, PoolingParams, SamplingParams

ATOL = 2e-4  # fp32 both sides; differences come from kernel summation order only

LAST = PoolingParams("LAST", normalize=True)
MEAN = PoolingParams("MEAN", normalize=True)


@pytest.fixture(scope="module")
def hf_base(hf_reference):
    """HF's ``AutoModel`` (the base ``LlamaModel``: final norm, no LM head) with the weights
    of the session's reference."""
    from transformers import AutoModel

    model = AutoModel.from_config(hf_reference.model.config).to(torch.float32)
    base = {
        k.removeprefix("model."): v
        for k, v in hf_reference.state_dict.items()
        if k.startswith("model.")
    }
    missing, unexpected = model.load_state_dict(base, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
    return model.eval()


def hf_vector(hf_base, ids: list[int], params: PoolingParams) -> np.ndarray:
    with torch.inference_mode():
        hidden = hf_base(input_ids=torch.tensor([ids])).last_hidden_state[0]
    if params.pooling_type == "MEAN":
        vec = hidden.mean(dim=0)
    else:
        vec = hidden[0 if params.pooling_type == "CLS" else -1]
    if params.dimensions is not None:
        vec = vec[: params.dimensions]
    if params.normalize:
        vec = vec / vec.norm()
    return vec.numpy()


def embed(
    llm: LLM,
    prompts: list[list[int]],
    params: PoolingParams,
    others: dict[str, list[int]] | None = None,
) -> list[np.ndarray]:
    """Each prompt as one pooling request, all in the engine at once; steps until every
    one finished (and the engine is idle); the vectors in prompt order. The tokens of
    other requests running meanwhile go to ``others``."""
    ids = []
    for p in prompts:
        req_id = f"emb-{next(llm._ids)}"
        out = llm.processor.process(
            GenerateRequest(
                req_id, SamplingParams(max_tokens=1), prompt_token_ids=p, pooling=params
            )
        )
        assert isinstance(out, tuple), out
        llm.core.add_request(out[0])
        ids.append(req_id)
    vectors: dict[str, bytes] = {}
    steps = 0
    while llm.core.has_work():  # until the workers heard of the last finishes too
        _, outputs = llm.core.step()
        llm.scheduler.check_integrity()
        steps += 1
        assert steps < 10_000
        for item in outputs:
            if item.req_id not in ids:
                assert others is not None
                others[item.req_id] += item.new_token_ids
                continue
            assert item.finish_reason in (None, "stop"), item
            assert not item.new_token_ids  # a pooling request samples nothing
            if item.finish_reason == "stop":
                vectors[item.req_id] = item.pooled
    assert len(vectors) == len(ids)
    return [from_bytes(vectors[r]) for r in ids]


@pytest.fixture(scope="module")
def engine() -> LLM:
    return LLM(max_model_len=1024, num_gpu_blocks_override=256, block_size=16)


@pytest.fixture(scope="module")
def chunked_engine() -> LLM:
    """One prompt spans several steps: 48 tokens a step."""
    return LLM(
        max_model_len=1024, num_gpu_blocks_override=256, block_size=16, max_num_batched_tokens=48
    )


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "raw"])
def test_batch_matches_hf(engine, hf_base, greedy_prompts, kind, normalize):
    params = PoolingParams(kind, normalize=normalize)
    got = embed(engine, greedy_prompts, params)
    for prompt, vec in zip(greedy_prompts, got, strict=True):
        want = hf_vector(hf_base, prompt, params)
        assert vec.shape == (engine.arch.hidden_size,)
        np.testing.assert_allclose(vec, want, atol=ATOL, rtol=1e-3)
        if normalize:
            assert np.linalg.norm(vec) == pytest.approx(1.0, abs=1e-5)
    assert engine.scheduler.kv_cache_manager.block_pool.get_usage() == 0.0  # all freed


def test_offline_embed_matches_hf(engine, hf_base, greedy_prompts):
    """``LLM.embed`` (vLLM's offline call): ``--pooler-config``'s pooling by default, a
    request's ``PoolingParams`` over it; text prompts tokenized as the server's."""
    llm = LLM(runner="pooling", max_model_len=1024, num_gpu_blocks_override=256,
              pooler_config='{"pooling_type": "MEAN"}')  # fmt: skip
    outs = llm.embed(greedy_prompts, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == greedy_prompts
    for prompt, out in zip(greedy_prompts, outs, strict=True):
        want = hf_vector(hf_base, prompt, MEAN)
        np.testing.assert_allclose(out.outputs.embedding, want, atol=ATOL, rtol=1e-3)
    (text,) = llm.embed("The capital of France is", PoolingParams("LAST", dimensions=16),
                        use_tqdm=False)  # fmt: skip
    ids = llm.tokenizer.encode("The capital of France is")
    assert text.prompt_token_ids == ids
    want = hf_vector(hf_base, ids, PoolingParams("LAST", dimensions=16))
    np.testing.assert_allclose(text.outputs.embedding, want, atol=ATOL, rtol=1e-3)
    assert llm.scheduler.kv_cache_manager.block_pool.get_usage() == 0.0
    with pytest.raises(ValueError, match="only supported for pooling models"):
        engine.embed([[1, 2, 3]])  # a generate runner, as vLLM's


@pytest.mark.parametrize("params", [LAST, MEAN], ids=["last", "mean"])
def test_chunked_prefill_matches_hf(chunked_engine, hf_base, long_prompt, params):
    assert len(long_prompt) > 3 * 48  # several steps
    [vec] = embed(chunked_engine, [long_prompt], params)
    np.testing.assert_allclose(vec, hf_vector(hf_base, long_prompt, params), atol=ATOL, rtol=1e-3)
    assert chunked_engine.scheduler.kv_cache_manager.block_pool.get_usage() == 0.0


def test_dimensions_cut_before_normalizing(engine, hf_base, greedy_prompts):
    params = PoolingParams("MEAN", normalize=True, dimensions=64)
    [vec] = embed(engine, greedy_prompts[:1], params)
    assert vec.shape == (64,)
    np.testing.assert_allclose(vec, hf_vector(hf_base, greedy_prompts[0], params), atol=ATOL)


def test_prefix_cache(engine, hf_base, long_prompt):
    """LAST reads the prefix cache (the last token is computed anyway); MEAN must not (it
    needs every token's hidden state) and still matches HF after a cached run."""
    pool = engine.scheduler.kv_cache_manager.block_pool
    embed(engine, [long_prompt], LAST)
    hits = pool.prefix_cache_stats.hits
    [last] = embed(engine, [long_prompt], LAST)
    assert pool.prefix_cache_stats.hits > hits
    np.testing.assert_allclose(last, hf_vector(hf_base, long_prompt, LAST), atol=ATOL, rtol=1e-3)
    [mean] = embed(engine, [long_prompt], MEAN)
    np.testing.assert_allclose(mean, hf_vector(hf_base, long_prompt, MEAN), atol=ATOL, rtol=1e-3)


def test_mixed_with_generation(engine, greedy_prompts, hf_greedy_tokens, hf_base):
    """Embeddings and generation share steps; neither changes the other's result."""
    from tests.conftest import NUM_GREEDY_TOKENS

    sampling = SamplingParams(temperature=0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    gen_ids = []
    for p in greedy_prompts:
        out = engine.processor.process(
            GenerateRequest(f"gen-{next(engine._ids)}", sampling, prompt_token_ids=p)
        )
        assert isinstance(out, tuple)
        engine.core.add_request(out[0])
        gen_ids.append(out[0].req_id)
    tokens: dict[str, list[int]] = {r: [] for r in gen_ids}
    vectors = embed(engine, greedy_prompts, MEAN, others=tokens)
    assert [tokens[r] for r in gen_ids] == hf_greedy_tokens
    for p, vec in zip(greedy_prompts, vectors, strict=True):
        np.testing.assert_allclose(vec, hf_vector(hf_base, p, MEAN), atol=ATOL, rtol=1e-3)
    assert engine.scheduler.kv_cache_manager.block_pool.get_usage() == 0.0


def test_preemption_and_async_scheduling(hf_base, long_prompt):
    """A KV pool that holds one long prompt at a time: pooling requests are preempted
    mid-prefill and recomputed from 0 (the worker's running mean starts over); with
    async scheduling (a plan in flight while the next is made) the vectors are the same."""
    prompts = [long_prompt[i * 7 :] for i in range(3)]
    want = [hf_vector(hf_base, p, MEAN) for p in prompts]
    assert max(len(p) for p in prompts) < 400
    for kwargs in (
        {"num_gpu_blocks_override": 27},  # 26 usable blocks, 416 tokens: one prompt at a time
        {"num_gpu_blocks_override": 256, "async_scheduling": True},
    ):
        llm = LLM(
            max_model_len=400,
            block_size=16,
            max_num_batched_tokens=64,
            long_prefill_token_threshold=32,  # two prompts in each step, each 32 tokens on
            **kwargs,
        )
        got = embed(llm, prompts, MEAN)
        for vec, ref in zip(got, want, strict=True):
            np.testing.assert_allclose(vec, ref, atol=ATOL, rtol=1e-3)
        if not kwargs.get("async_scheduling"):
            assert llm.scheduler.num_preemptions > 0
        assert llm.scheduler.kv_cache_manager.block_pool.get_usage() == 0.0
        assert len(llm.core.executor.worker.pooler) == 0  # no state left in the worker


def test_truncate_and_length_errors(engine):
    long = list(range(1, 1100))
    out = engine.processor.process(
        GenerateRequest("t1", SamplingParams(), prompt_token_ids=long, pooling=LAST)
    )
    assert not isinstance(out, tuple) and out.status == 400
    assert "embedding generation" in out.message
    keep = PoolingParams("LAST", truncate_prompt_tokens=10)
    out = engine.processor.process(
        GenerateRequest("t2", SamplingParams(), prompt_token_ids=long, pooling=keep)
    )
    assert isinstance(out, tuple) and out[0].prompt_token_ids == long[-10:]
    too_many = PoolingParams("LAST", truncate_prompt_tokens=5000)
    out = engine.processor.process(
        GenerateRequest("t3", SamplingParams(), prompt_token_ids=long, pooling=too_many)
    )
    assert not isinstance(out, tuple) and out.param == "truncate_prompt_tokens"


# ---------------------------------------------------------------- the pooling math alone


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_chunked_pooler_equals_whole(kind):
    """Random chunkings of random prompts, several requests a step, equal pooling each
    prompt's hidden states in one piece."""
    rng = random.Random(kind)
    torch.manual_seed(0)
    hidden_size = 24
    params = PoolingParams(kind, normalize=kind != "CLS", dimensions=16 if kind == "MEAN" else None)
    prompts = {f"r{i}": torch.randn(rng.randint(1, 40), hidden_size) for i in range(5)}
    pooler = Pooler()
    for req_id, h in prompts.items():
        pooler.add(
            NewRequest(req_id, [0] * len(h), len(h), SamplingParams(), [], 0, pooling=params)
        )
    done = {r: 0 for r in prompts}
    got: dict[str, np.ndarray] = {}
    while len(got) < len(prompts):
        live = [r for r in prompts if r not in got]
        take = {r: min(rng.randint(1, 9), len(prompts[r]) - done[r]) for r in live}
        rows = torch.cat([prompts[r][done[r] : done[r] + n] for r, n in take.items()])
        out = pooler.step(
            rows,
            list(take),
            np.array([done[r] for r in take]),
            np.array(list(take.values())),
            np.array([len(prompts[r]) for r in take]),
        )
        for r, n in take.items():
            done[r] += n
        for p in out:
            assert done[p.req_id] == len(prompts[p.req_id])  # only once its prompt ended
            got[p.req_id] = from_bytes(p.data)
    assert len(pooler) == 0  # no state left behind
    for req_id, h in prompts.items():
        want = pool_whole(h, params).numpy()
        np.testing.assert_allclose(got[req_id], want, atol=1e-5, rtol=1e-5)


def test_normalize_and_dimensions_math():
    h = torch.tensor([[3.0, 4.0, 12.0], [1.0, 0.0, 0.0]])
    np.testing.assert_allclose(pool_whole(h, PoolingParams("CLS")), [3 / 13, 4 / 13, 12 / 13])
    np.testing.assert_allclose(
        pool_whole(h, PoolingParams("CLS", dimensions=2)), [0.6, 0.8], rtol=1e-6
    )
    np.testing.assert_allclose(pool_whole(h, PoolingParams("MEAN", normalize=False)), [2, 2, 6])
    np.testing.assert_allclose(pool_whole(h, PoolingParams("LAST")), [1, 0, 0])


def test_mean_pooler_refuses_a_prefix_hit():
    pooler = Pooler()
    with pytest.raises(ValueError, match="prefix cache"):
        pooler.add(NewRequest("x", [1] * 40, 40, SamplingParams(), [0, 1, 2], 32, pooling=MEAN))
    pooler.add(NewRequest("y", [1] * 40, 40, SamplingParams(), [0, 1, 2], 32, pooling=LAST))


# ---------------------------------------------------------------- flags


def test_pooler_config_flags():
    cfg = EngineConfig.from_kwargs(runner="pooling")
    assert cfg.model.resolved_runner == "pooling"
    assert cfg.model.pooler == PoolerConfig("LAST", True, None)  # vLLM's embed defaults
    assert EngineConfig.from_kwargs().model.resolved_runner == "generate"
    assert EngineConfig.from_kwargs(convert="embed").model.resolved_runner == "pooling"
    cfg = EngineConfig.from_kwargs(
        runner="pooling", pooler_config='{"pooling_type": "MEAN", "normalize": false}'
    )
    assert cfg.model.pooler == PoolerConfig("MEAN", False, None)
    cfg = EngineConfig.from_kwargs(runner="pooling", pooler_config='{"use_activation": false}')
    assert not cfg.model.pooler.normalize
    bad = {
        '{"pooling_type": "ALL"}': "--pooler-config",
        '{"pooling_type": "max"}': "--pooler-config",
        '{"dimensions": 0}': "--pooler-config",
        '{"normalize": "yes"}': "--pooler-config",
        '{"enable_chunked_processing": true}': "--pooler-config",
        '{"nope": 1}': "--pooler-config",
        "[1]": "--pooler-config",
    }
    for text, flag in bad.items():
        with pytest.raises(ConfigError, match=flag):
            EngineConfig.from_kwargs(runner="pooling", pooler_config=text)
    for kwargs, flag in [
        ({"pooler_config": "{}"}, "--pooler-config"),
        ({"runner": "generate", "convert": "embed"}, "--convert"),
        ({"runner": "pooling", "convert": "none"}, "--convert"),
        ({"runner": "pooling", "convert": "classify"}, "--convert"),
        ({"runner": "pooling", "worker_backend": "sim"}, "--runner"),
        ({"runner": "draft"}, "--runner"),
    ]:
        with pytest.raises(ConfigError, match=flag):
            EngineConfig.from_kwargs(**kwargs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel", [{"pipeline_parallel_size": 2}, {"tensor_parallel_size": 3}], ids=["pp2", "tp3"]
)
def test_parallel_ranks_pool_as_one(engine, parallel):
    """Hidden states live on the last pipeline stage, and every TP rank of it holds them:
    the output rank's vectors equal one rank's (chunked over steps as well)."""
    prompts = [list(range(1000, 1100)), list(range(2000, 2013))]
    with LLM(
        max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=48, **parallel
    ) as llm:
        _same_vectors(llm, engine, prompts)


def _same_vectors(llm: LLM, engine: LLM, prompts: list[list[int]]) -> None:
    for params in (LAST, MEAN):
        for got, want in zip(
            embed(llm, prompts, params), embed(engine, prompts, params), strict=True
        ):
            np.testing.assert_allclose(got, want, atol=1e-5)
