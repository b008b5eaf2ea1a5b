"""Prompt logprobs (vLLM's ``prompt_logprobs``) on the default model, against HF transformers.

Each prompt token after the first gets its log-probability given the tokens
before it, its rank in the vocabulary, and the top-N alternatives. Prompts are
split into prefill chunks, shared with the prefix cache, and preempted; none of
it may change the numbers.
"""

from __future__ import annotations

import pytest
import torch

from launch.llm import LLM, SamplingParams
from services.detokenizer.output_processor import OutputProcessor
from services.protocol import (
    PromptLogprobs,
    RequestOutputSpec,
    RequestTokens,
    TokenBatch,
    TokenLogprobs,
)
from services.request import Request
from services.scheduler.scheduler import Scheduler
from services.tokenizer.loader import load_serving_tokenizer

TOP = 3
ATOL = 2e-3  # our fp32 forward vs HF's fp32 forward, summed in another order


def _hf_prompt_logprobs(hf_reference, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_reference.model(input_ids=torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)  # row p scores token p + 1


def _check(got: list[TokenLogprobs | None] | None, ref: torch.Tensor, prompt: list[int]) -> None:
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    for p, item in enumerate(got[1:], start=1):
        assert item is not None
        row = ref[p - 1]
        assert item.token_id == prompt[p]
        assert abs(item.logprob - float(row[prompt[p]])) < ATOL, p
        # Rank 1 = most likely; tokens within tolerance of this one may fall either side.
        lp = float(row[prompt[p]])
        assert int((row > lp + ATOL).sum()) + 1 <= item.rank <= int((row >= lp - ATOL).sum()), p
        top = row.topk(TOP)
        assert len(item.top_token_ids) == TOP
        torch.testing.assert_close(torch.tensor(item.top_logprobs), top.values, atol=ATOL, rtol=0)
        # Top ids agree unless two of them are within tolerance of each other.
        for tid, ref_id in zip(item.top_token_ids, top.indices.tolist(), strict=True):
            if tid != ref_id:
                assert abs(float(row[tid]) - float(row[ref_id])) < ATOL


@pytest.fixture(scope="module")
def chunky_engine() -> LLM:
    """Small prefill chunks so one prompt's logprobs come from several steps."""
    llm = LLM(max_model_len=512, num_gpu_blocks_override=128, max_num_batched_tokens=48)
    llm.step_hook = llm.scheduler.check_integrity
    return llm


def test_prompt_logprobs_equal_hf_across_chunks(chunky_engine, hf_reference, greedy_prompts):
    prompts = [greedy_prompts[0], greedy_prompts[4], greedy_prompts[-1]]  # 1, ~15, 300+ tokens
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP, logprobs=1)
    results = chunky_engine.generate(prompts, params)
    for prompt, result in zip(prompts, results, strict=True):
        _check(result.prompt_logprobs, _hf_prompt_logprobs(hf_reference, prompt), prompt)
        assert result.outputs[0].logprobs is not None and len(result.outputs[0].logprobs) == 2


def test_prompt_logprobs_ignore_the_prefix_cache(chunky_engine, hf_reference, long_prompt):
    pool = chunky_engine.scheduler.kv_cache_manager.block_pool
    plain = SamplingParams(temperature=0, max_tokens=1)
    chunky_engine.generate([long_prompt], plain)  # warm the cache with this prompt
    hits = pool.prefix_cache_stats.hits
    chunky_engine.generate([long_prompt], plain)
    assert pool.prefix_cache_stats.hits > hits  # a plain request does hit it
    hits, queries = pool.prefix_cache_stats.hits, pool.prefix_cache_stats.queries
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    (result,) = chunky_engine.generate([long_prompt], params)
    # No hit taken (nor a query counted, as vLLM): every position is computed and scored.
    assert (pool.prefix_cache_stats.hits, pool.prefix_cache_stats.queries) == (hits, queries)
    assert result.num_cached_tokens == 0
    ref = _hf_prompt_logprobs(hf_reference, long_prompt)
    got = result.prompt_logprobs
    assert got is not None and len(got) == len(long_prompt) and got[0] is None
    for p, item in enumerate(got[1:], start=1):
        assert item is not None and item.top_token_ids == []
        assert abs(item.logprob - float(ref[p - 1][long_prompt[p]])) < ATOL


def test_prompt_logprobs_survive_preemption(hf_reference, greedy_prompts):
    # 24 usable blocks of 16 for ~400 prompt tokens in flight: requests are preempted.
    llm = LLM(
        max_model_len=384,
        num_gpu_blocks_override=25,
        block_size=16,
        max_num_batched_tokens=64,
    )
    llm.step_hook = llm.scheduler.check_integrity
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    prompts = greedy_prompts[4:]
    results = llm.generate(prompts, params)
    assert llm.scheduler.num_preemptions > 0
    for prompt, result in zip(prompts, results, strict=True):
        got = result.prompt_logprobs
        ref = _hf_prompt_logprobs(hf_reference, prompt)
        assert got is not None and len(got) == len(prompt)
        for p, item in enumerate(got[1:], start=1):
            assert item is not None and item.token_id == prompt[p]
            assert abs(item.logprob - float(ref[p - 1][prompt[p]])) < ATOL


# ---------------------------------------------------------------- pieces, without a model


def _lp(token_id: int) -> TokenLogprobs:
    return TokenLogprobs(token_id=token_id, logprob=-float(token_id), rank=token_id)


def test_request_keeps_one_copy_of_each_position_and_sends_once():
    request = Request("r", list(range(10, 20)), SamplingParams(prompt_logprobs=0))
    assert request.skip_reading_prefix_cache
    request.add_prompt_logprobs(PromptLogprobs("r", 1, [_lp(11), _lp(12), _lp(13)]))
    request.add_prompt_logprobs(PromptLogprobs("r", 4, [_lp(14), _lp(15)]))
    # Preempted and recomputed from the start: the new chunk replaces what it covers.
    request.add_prompt_logprobs(PromptLogprobs("r", 1, [_lp(11), _lp(12)]))
    assert [x.token_id for x in request.prompt_logprobs] == [11, 12]
    request.add_prompt_logprobs(PromptLogprobs("r", 3, [_lp(t) for t in range(13, 20)]))
    assert [x.token_id for x in request.prompt_logprobs] == list(range(11, 20))

    request.append_output_token_ids([7])
    out = Scheduler._output(request, [7], None)
    assert [x.token_id for x in out.prompt_logprobs] == list(range(11, 20))
    assert not request.skip_reading_prefix_cache  # sent: a later resume may hit the cache
    request.append_output_token_ids([8])
    assert Scheduler._output(request, [8], None).prompt_logprobs == []
    request.add_prompt_logprobs(PromptLogprobs("r", 1, [_lp(11)]))  # recomputed after sending
    assert request.prompt_logprobs == []
    # ... which a resumed request does not ask the worker for again.
    assert request.worker_sampling_params.prompt_logprobs is None
    assert request.sampling_params.prompt_logprobs == 0
    assert not Request("p", [1, 2], SamplingParams()).skip_reading_prefix_cache


def test_detokenizer_puts_decoded_prompt_logprobs_on_the_first_delta():
    tok = load_serving_tokenizer().tokenizer
    ids = tok.encode("The capital of France is", add_special_tokens=False).ids
    sampling = SamplingParams(prompt_logprobs=1)
    proc = OutputProcessor(tok)
    spec = RequestOutputSpec("r", sampling, len(ids), ids[-4:], first_prompt_token_id=ids[0])
    proc.add_request(spec)
    items = [
        TokenLogprobs(t, -1.0, 2, top_token_ids=[ids[0]], top_logprobs=[-0.5]) for t in ids[1:]
    ]
    (first,), _ = proc.process(TokenBatch([RequestTokens("r", [ids[0]], prompt_logprobs=items)]))
    plp = first.prompt_logprobs
    assert plp is not None and plp.first_token_id == ids[0]
    assert plp.first_token == tok.decode([ids[0]])
    assert [x.token for x in plp.items] == [tok.decode([t]) for t in ids[1:]]
    assert all(x.top_tokens == [tok.decode([ids[0]])] for x in plp.items)
    assert "".join([plp.first_token, *(x.token for x in plp.items)]) == "The capital of France is"
    (second,), _ = proc.process(TokenBatch([RequestTokens("r", [ids[1]], "length")]))
    assert second.prompt_logprobs is None
