"""ModelRunner end to end on the default model, driven by hand-built StepPlans,
against HF transformers' greedy output (fp32)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from services.config import EngineConfig, ModelArchConfig
from services.gpu_worker.model_runner import ModelRunner
from services.model_loader import dummy_weights, load_hf_config, prepare_model
from services.protocol import (
    NewRequest,
    RunningRequestDelta,
    SamplingParams,
    StepPlan,
    StepResult,
)
from tests.conftest import NUM_GREEDY_TOKENS

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY_TOKENS)


@dataclass
class _Req:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    max_new: int
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False
    output: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new


class Driver:
    """A minimal stand-in for the scheduler: sequential block allocation, explicit
    per-step token counts, StepPlans built as the protocol describes."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.next_block = 0
        self.step_id = 0
        self.reqs: dict[str, _Req] = {}
        self.finished: list[str] = []

    def add(self, req_id: str, prompt: list[int], sampling: SamplingParams = GREEDY,
            max_new: int = NUM_GREEDY_TOKENS, shared_blocks: list[int] | None = None) -> _Req:  # fmt: skip
        req = _Req(req_id, list(prompt), len(prompt), sampling, max_new)
        if shared_blocks:  # prefix-cache hit: these blocks already hold the prefix's K/V
            req.block_ids = list(shared_blocks)
            req.num_computed = len(shared_blocks) * BLOCK_SIZE
        self.reqs[req_id] = req
        return req

    def step(self, schedule: dict[str, int]) -> StepResult:
        new, running, counts = [], [], []
        for req_id, n in schedule.items():
            req = self.reqs[req_id]
            need = -(-(req.num_computed + n) // BLOCK_SIZE) - len(req.block_ids)
            fresh = list(range(self.next_block, self.next_block + max(need, 0)))
            self.next_block += len(fresh)
            req.block_ids += fresh
            if not req.sent:
                new.append(NewRequest(req_id, list(req.token_ids), req.num_prompt_tokens,
                                      req.sampling, list(req.block_ids), req.num_computed, 2))  # fmt: skip
                req.sent = True
            else:
                running.append(RunningRequestDelta(req_id, fresh, req.num_computed))
            counts.append(n)
        # StepPlan orders requests as new_requests + running.
        order = [r.req_id for r in new] + [r.req_id for r in running]
        counts = [schedule[r] for r in order]
        plan = StepPlan(self.step_id, new, running, counts, self.finished)
        self.step_id, self.finished = self.step_id + 1, []
        result = self.runner.execute(plan)
        for req_id in order:
            self.reqs[req_id].num_computed += schedule[req_id]
        for req_id, tok in zip(result.req_ids, result.sampled_token_ids, strict=True):
            req = self.reqs[req_id]
            req.output.append(tok)
            req.token_ids.append(tok)
            if req.done:
                self.finished.append(req_id)
        return result

    def run(self, chunk: int | None = None, rng: random.Random | None = None,
            admit_per_step: int | None = None) -> None:  # fmt: skip
        """Step until every request is done. Prefill chunks are ``chunk`` tokens, or
        random in [1, 48] with ``rng``; ``admit_per_step`` staggers admission."""
        pending = [r for r in self.reqs.values() if not r.sent]
        active = [r for r in self.reqs.values() if r.sent and not r.done]
        while pending or active:
            take = len(pending) if admit_per_step is None else admit_per_step
            active += pending[:take]
            pending = pending[take:]
            schedule = {}
            for r in active:
                left = len(r.token_ids) - r.num_computed
                size = chunk or (rng.randint(1, 48) if rng else left)
                schedule[r.req_id] = min(left, size)
            self.step(schedule)
            active = [r for r in active if not r.done]
        self.step({})  # tell the runner about the last finished requests


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    """The real loading path (our GGUF loader); HF transformers is the independent reference."""
    folder = prepare_model(None)
    config = EngineConfig.from_kwargs(num_threads=1, block_size=BLOCK_SIZE, max_model_len=1024)
    config.finalize(ModelArchConfig.from_hf_config(load_hf_config(folder)))
    runner = ModelRunner(config, folder)
    runner.initialize_kv_cache(512)
    return runner


def test_greedy_each_alone_matches_hf(runner, greedy_prompts, hf_greedy_tokens):
    for i, prompt in enumerate(greedy_prompts):
        driver = Driver(runner)
        req = driver.add(f"alone-{i}", prompt)
        driver.run()
        assert req.output == hf_greedy_tokens[i], f"prompt {i}"
    assert len(runner.input_batch) == 0  # finished requests were dropped


def test_greedy_batched_matches_hf(runner, greedy_prompts, hf_greedy_tokens):
    driver = Driver(runner)
    reqs = [driver.add(f"batch-{i}", p) for i, p in enumerate(greedy_prompts)]
    driver.run()
    assert [r.output for r in reqs] == hf_greedy_tokens


def test_chunked_prefill_mixed_with_decode_matches_hf(runner, greedy_prompts, hf_greedy_tokens):
    driver = Driver(runner)
    reqs = [driver.add(f"chunk-{i}", p) for i, p in enumerate(greedy_prompts)]
    # One admission per step and random chunks: most steps carry prefill chunks of
    # some requests beside decode tokens of others.
    driver.run(rng=random.Random(0), admit_per_step=1)
    assert [r.output for r in reqs] == hf_greedy_tokens


def test_shared_prefix_blocks(runner, greedy_prompts, hf_greedy_tokens):
    long_prompt, expected = greedy_prompts[-1], hf_greedy_tokens[-1]
    driver = Driver(runner)
    owner = driver.add("owner", long_prompt[:200] + [28, 29, 30], max_new=1)
    driver.run()
    shared = owner.block_ids[: 192 // BLOCK_SIZE]  # the owner's full blocks of the common prefix
    reader = driver.add("reader", long_prompt, shared_blocks=shared, max_new=8)
    driver.step({"reader": len(long_prompt) - reader.num_computed})
    driver.run()
    assert not set(shared) & set(reader.block_ids[len(shared) :])
    assert reader.output == expected[:8]


def test_logprobs_are_raw_model_logprobs(runner, hf_reference, greedy_prompts):
    prompt = greedy_prompts[0]
    params = SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.5)
    driver = Driver(runner)
    driver.add("lp", prompt, params, max_new=1)
    driver.add("nolp", prompt, GREEDY, max_new=1)
    result = driver.step({"lp": len(prompt), "nolp": len(prompt)})
    assert result.logprobs[1] is None
    lp = result.logprobs[0]
    with torch.inference_mode():
        expected = hf_reference.model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    top = expected.topk(5)
    assert lp.top_token_ids == top.indices.tolist()
    torch.testing.assert_close(torch.tensor(lp.top_logprobs), top.values, atol=1e-3, rtol=0)
    assert lp.token_id == result.sampled_token_ids[0]
    assert lp.rank == int((expected >= expected[lp.token_id]).sum())
    torch.testing.assert_close(torch.tensor(lp.logprob), expected[lp.token_id], atol=1e-3, rtol=0)
    driver.step({})  # drop the finished requests
    assert len(runner.input_batch) == 0


def test_bad_plans_are_rejected(runner):
    with pytest.raises(ValueError, match="not in the batch"):
        runner.execute(
            StepPlan(0, running=[RunningRequestDelta("ghost", [], 0)], num_scheduled_tokens=[1])
        )
    new = NewRequest("over", [1, 2, 3], 3, GREEDY, [500], 0)
    with pytest.raises(ValueError, match="past a request's known tokens"):
        runner.execute(StepPlan(1, new_requests=[new], num_scheduled_tokens=[4]))
    runner.execute(StepPlan(2, finished_req_ids=["over"]))
    assert "over" not in runner.input_batch.requests


def test_determine_num_blocks(runner):
    cache = runner.config.cache
    a = runner.arch
    per_block = 2 * a.num_hidden_layers * BLOCK_SIZE * a.num_key_value_heads * a.head_dim * 4
    try:
        cache.kv_cache_memory_bytes = 10 << 20
        assert runner.determine_num_blocks() == (10 << 20) // per_block
        cache.num_gpu_blocks_override = 7
        assert runner.determine_num_blocks() == 7
        cache.num_gpu_blocks_override = cache.kv_cache_memory_bytes = None
        with open("/proc/meminfo") as f:
            avail = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
        expected = avail * cache.cpu_kv_cache_fraction / per_block
        assert abs(runner.determine_num_blocks() - expected) < 0.05 * expected
    finally:
        cache.num_gpu_blocks_override = cache.kv_cache_memory_bytes = None


def test_dummy_load_format():
    arch = ModelArchConfig.from_hf_config(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": 50,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
        }  # fmt: skip
    )
    config = EngineConfig.from_kwargs(num_threads=1, load_format="dummy", seed=3, block_size=4)
    config.finalize(arch)
    runner = ModelRunner(config, None, arch=arch)
    expected = dict(dummy_weights(arch, torch.float32, 3))
    torch.testing.assert_close(
        runner.model.model.layers[1].self_attn.qkv_proj.bias[-16:],
        expected["model.layers.1.self_attn.v_proj.bias"],
    )
    runner.initialize_kv_cache(8)
    driver = Driver(runner)
    req = driver.add("d", [1, 2, 3], max_new=3)
    driver.run()
    assert len(req.output) == 3 and all(0 <= t < 50 for t in req.output)


def test_resume_after_preemption(runner, greedy_prompts, hf_greedy_tokens):
    """A preempted request comes back as a NewRequest whose token_ids hold prompt and
    outputs so far, recomputed into fresh blocks; it continues where it stopped."""
    prompt, expected = greedy_prompts[4], hf_greedy_tokens[4]
    driver = Driver(runner)
    first = driver.add("victim", prompt, max_new=10)
    driver.run()
    resumed = driver.add("victim", first.token_ids, max_new=12)  # same req_id, new blocks
    resumed.num_prompt_tokens = len(prompt)
    driver.run(chunk=7)
    assert first.output + resumed.output == expected[:22]


def test_seeded_sampling_independent_of_batch(runner, greedy_prompts):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=42)

    def generate(with_others: bool) -> list[int]:
        driver = Driver(runner)
        req = driver.add(f"seeded-{with_others}", greedy_prompts[2], seeded, max_new=8)
        if with_others:
            driver.add("other-a", greedy_prompts[0], SamplingParams(temperature=1.0), max_new=8)
            driver.add("other-b", greedy_prompts[3], SamplingParams(seed=7), max_new=8)
        driver.run()
        return req.output

    assert generate(False) == generate(True)
