"""The offline engine end to end on the default model, against HF transformers' greedy tokens.

A tiny KV pool forces preemption (requests are evicted and recomputed); the
outputs must not change. Prefix caching on and off must not change them either.
The block pool's integrity is checked after every step.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from launch.llm import LLM, SamplingParams
from tests.conftest import NUM_GREEDY_TOKENS


def _engine(**kwargs) -> LLM:
    llm = LLM(max_model_len=512, **kwargs)
    llm.step_hook = llm.scheduler.check_integrity
    return llm


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def roomy_engine() -> LLM:
    return _engine(num_gpu_blocks_override=256)


def _tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def test_batch_equals_hf(roomy_engine, greedy_prompts, hf_greedy_tokens):
    assert _tokens(roomy_engine.generate(greedy_prompts, GREEDY)) == hf_greedy_tokens


@pytest.mark.parametrize(
    "prefix_caching",
    [True, pytest.param(False, marks=pytest.mark.slow)],  # make test: with the prefix cache
    ids=["prefix-cache", "no-prefix-cache"],
)
def test_heavy_preemption_equals_hf(prefix_caching, greedy_prompts, hf_greedy_tokens):
    # 40 usable blocks of 16 = 640 tokens for ~700 tokens of prompts plus 256 of outputs:
    # requests must be preempted and recomputed to finish.
    llm = _engine(
        num_gpu_blocks_override=41,
        block_size=16,
        enable_prefix_caching=prefix_caching,
        max_num_batched_tokens=256,
    )
    assert _tokens(llm.generate(greedy_prompts, GREEDY)) == hf_greedy_tokens
    assert llm.scheduler.num_preemptions > 0
    assert not llm.scheduler.has_unfinished_requests()
    pool = llm.scheduler.kv_cache_manager.block_pool
    assert pool.get_usage() == 0.0  # every block back in the pool
    if prefix_caching:
        # The long prompt again: it finished last, so its blocks are freed but not evicted.
        before = pool.prefix_cache_stats.hits
        assert _tokens(llm.generate(greedy_prompts[-1:], GREEDY)) == hf_greedy_tokens[-1:]
        assert pool.prefix_cache_stats.hits > before


def test_fully_cached_prompt_recomputes_only_last_token(
    roomy_engine, greedy_prompts, hf_greedy_tokens
):
    prompt = greedy_prompts[-1]  # the long prompt, a multiple of no particular block size
    first = roomy_engine.generate([prompt], GREEDY)[0]
    again = roomy_engine.generate([prompt], GREEDY)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == hf_greedy_tokens[-1]
    block = roomy_engine.config.cache.block_size
    assert again.num_cached_tokens == (len(prompt) - 1) // block * block


def test_stop_strings_and_max_tokens(roomy_engine):
    out = roomy_engine.generate(
        ["The capital of France is"], SamplingParams(temperature=0, max_tokens=20, stop=["."])
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "."
    assert "." not in out.text and out.text.strip()
    out = roomy_engine.generate(
        ["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].outputs[0].finish_reason == "length"


def test_seeded_n_is_reproducible_and_varied(roomy_engine):
    params = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=7, ignore_eos=True)
    a = roomy_engine.generate(["Write a word:"], params)[0]
    b = roomy_engine.generate(["Write a word:", "Other prompt in the batch"], [params, params])[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # seed + i per choice


def test_prompt_too_long_is_a_clear_error(roomy_engine):
    with pytest.raises(ValueError, match="maximum context length is 512"):
        roomy_engine.generate([[100] * 600], SamplingParams(max_tokens=1))
    # The engine still serves after the rejected request.
    assert roomy_engine.generate(["Hi"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cli_generate_chat():
    res = _cli(
        "generate",
        "What is the capital of France?",
        "--chat",
        "--max-tokens",
        "16",
        "--kv-cache-memory-bytes",
        "64MiB",
        "--max-model-len",
        "1024",
    )
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model.gguf"], "does not exist"),
        (["--block-size", "12"], "--block-size must be a power of two"),
        (["--kv-cache-memory-bytes", "1MiB"], "--max-model-len"),
    ],
)
def test_cli_errors_are_one_line(args, message):
    res = _cli("generate", "Hi", *args)
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if not line.startswith("INFO")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr


def test_allowed_token_ids_and_logit_bias_offline(roomy_engine, greedy_prompts):
    allowed = [11, 220, 1536]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=allowed)
    (out,) = roomy_engine.generate(greedy_prompts[1], params)
    assert set(out.outputs[0].token_ids) <= set(allowed)
    biased = SamplingParams(temperature=0, max_tokens=4, logit_bias={1536: 100.0})
    assert roomy_engine.generate(greedy_prompts[1], biased)[0].outputs[0].token_ids == [1536] * 4
    with pytest.raises(ValueError, match="out of vocabulary"):
        roomy_engine.generate("x", SamplingParams(logit_bias={10**7: 1.0}))


def test_bad_words_offline(roomy_engine, greedy_prompts):
    """Banning the first word of the greedy continuation changes it, and the word never
    appears as generated tokens."""
    tok = roomy_engine.tokenizer
    prompt = greedy_prompts[4]  # "Once upon a time, in a small village by the sea, there lived"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (plain,) = roomy_engine.generate(prompt, params)
    word = plain.outputs[0].text.split()[0]
    banned = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word])
    (out,) = roomy_engine.generate(prompt, banned)
    assert out.outputs[0].token_ids != plain.outputs[0].token_ids
    ids = out.outputs[0].token_ids
    for seq in tok.bad_words_token_ids([word]):
        assert not any(ids[i : i + len(seq)] == seq for i in range(len(ids)))
    assert tok.bad_words_token_ids([" Paris"]) == [
        tok.encode("Paris", add_special_tokens=False),
        tok.encode(" Paris", add_special_tokens=False),
    ]
