"""Property test: random workloads on a tiny KV pool give the outputs of unlimited memory.

The simulated worker's token is a pure function of (request id, position), so
whatever the scheduler does (chunking, preemption, prefix hits, aborts), a
request that finishes must have produced exactly the tokens and finish reason
that plain autoregression gives; ``reference`` computes those by brute force.
The worker also re-reads each request's whole KV prefix every step, so a wrong
prefix hit or a block reused while still held fails the run.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from services.config import CacheConfig, EngineConfig, SchedulerConfig
from services.protocol import SamplingParams, StepPlan, StepResult
from services.request import Request
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor import Executor
from tests.test_scheduler import EOS, Run, SimWorker, token_fn

MAX_MODEL_LEN = 32
PREFIXES = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [5, 6, 7, 8, 20, 21, 22, 23]]


@dataclass
class Spec:
    req_id: str
    arrival_step: int
    prompt: list[int]
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: list[int]
    priority: int
    cache_salt: str | None
    abort_step: int | None


def reference(spec: Spec) -> tuple[list[int], str]:
    """Plain autoregression with vLLM's stop rules, one token at a time."""
    out: list[int] = []
    while True:
        token = token_fn(spec.req_id, len(spec.prompt) + len(out))
        out.append(token)
        if len(out) >= spec.min_tokens and (
            (token == EOS and not spec.ignore_eos) or token in spec.stop_token_ids
        ):
            return out, "stop"
        if len(spec.prompt) + len(out) >= MAX_MODEL_LEN or (
            spec.max_tokens is not None and len(out) >= spec.max_tokens
        ):
            return out, "length"


@st.composite
def request_specs(draw, index: int) -> Spec:
    prefix = draw(st.sampled_from(PREFIXES + [[]]))
    prefix = prefix[: draw(st.integers(0, len(prefix)))]
    suffix = draw(st.lists(st.integers(1, 49), max_size=12))
    prompt = (prefix + suffix)[: MAX_MODEL_LEN - 1] or [1]
    room = MAX_MODEL_LEN - len(prompt)
    max_tokens = draw(st.none() | st.integers(1, room + 2))
    return Spec(
        req_id=f"r{index}",
        arrival_step=draw(st.integers(0, 12)),
        prompt=prompt,
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, min(3, max_tokens or 3))),
        ignore_eos=draw(st.booleans()),
        stop_token_ids=draw(st.lists(st.integers(0, 49), max_size=2)),
        priority=draw(st.integers(0, 2)),
        cache_salt=draw(st.sampled_from([None, None, "s"])),
        abort_step=draw(st.none() | st.none() | st.integers(0, 30)),
    )


@st.composite
def workloads(draw) -> tuple[SchedulerConfig, CacheConfig, int, list[Spec]]:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    chunked = draw(st.booleans())
    sched_cfg = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(MAX_MODEL_LEN if not chunked else 1, 48)),
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 7])),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        max_model_len=MAX_MODEL_LEN,
    )
    cache_cfg = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=draw(st.booleans() | st.just(True)),
        prefix_caching_hash_algo=draw(st.sampled_from(["sha256", "sha256_cbor", "builtin"])),
        kv_cache_metrics=draw(st.booleans()),
        kv_cache_metrics_sample=1.0,
    )
    # Just enough for one request of MAX_MODEL_LEN (plus the null block), and a little more.
    num_blocks = -(-MAX_MODEL_LEN // block_size) + 1 + draw(st.integers(0, 24 // block_size))
    n = draw(st.integers(1, 10))
    specs = [draw(request_specs(i)) for i in range(n)]
    return sched_cfg, cache_cfg, num_blocks, specs


class SimExecutor(Executor):
    """The workers of a pipeline of stages, run in plan order as real stages do: the last
    samples (``sampler``), an earlier one follows the sampled tokens from the plans."""

    def __init__(self, num_blocks: int, block_size: int, depth: int) -> None:
        self.num_blocks = num_blocks
        self.sampler = SimWorker(num_blocks, block_size)
        self.follower = SimWorker(num_blocks, block_size, samples=False) if depth > 1 else None
        self.results: dict[int, StepResult] = {}

    def submit(self, plan: StepPlan) -> None:
        self.results[plan.step_id] = self.sampler.execute(plan)
        if self.follower is not None:
            self.follower.execute(plan)
            for req_id, state in self.follower.reqs.items():
                # The follower lacks at most the token the sampler has just drawn.
                sampled = self.sampler.reqs[req_id].token_ids
                assert state.token_ids == sampled[: len(state.token_ids)], req_id
                assert len(sampled) - len(state.token_ids) <= 1, req_id

    def collect(self, step_id: int) -> StepResult:
        return self.results.pop(step_id)


def _one_token_prompts(n: int, abort: dict[int, int]) -> list[Spec]:
    return [Spec(f"r{i}", 0, [1], None, 0, False, [], 0, None, abort.get(i)) for i in range(n)]


# Found by this test: with 3 plans in flight, a request preempted and resumed while its
# old plan was still out got that plan's token (the scheduler's admitted_step_id check).
_STALE_RESULT_AFTER_RESUME = (
    SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, enable_chunked_prefill=False,
                    max_model_len=MAX_MODEL_LEN),
    CacheConfig(block_size=1),
    42,
    _one_token_prompts(7, abort={1: 0}),
)  # fmt: skip


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from([1, 1, 2, 3, "async", "async"]))
@example(_STALE_RESULT_AFTER_RESUME, 3)
@example(_STALE_RESULT_AFTER_RESUME, "async")
def test_random_workloads_match_unlimited_memory(workload, depth):
    """Also with a pipeline of ``depth`` stages (plans in flight while the next are made),
    and with async scheduling (the next plan builds on tokens still being sampled)."""
    sched_cfg, cache_cfg, num_blocks, specs = workload
    sched_cfg.async_scheduling = depth == "async"
    depth = 1 if depth == "async" else depth
    config = EngineConfig(scheduler=sched_cfg, cache=cache_cfg)
    config.parallel.pipeline_parallel_size = depth
    core = EngineCore(
        config, SimExecutor(num_blocks, cache_cfg.block_size, depth), enable_kv_cache_events=True
    )
    sched = core.scheduler
    run = Run()
    pending = sorted(specs, key=lambda s: s.arrival_step)
    step_no = 0
    while pending or core.has_work():
        while pending and pending[0].arrival_step <= step_no:
            spec = pending.pop(0)
            params = SamplingParams(
                max_tokens=spec.max_tokens,
                min_tokens=spec.min_tokens,
                ignore_eos=spec.ignore_eos,
                stop_token_ids=spec.stop_token_ids,
            )
            sched.add_request(
                Request(
                    spec.req_id,
                    list(spec.prompt),
                    params,
                    eos_token_id=EOS,
                    arrival_time=step_no + int(spec.req_id[1:]) * 1e-3,
                    priority=spec.priority,
                    cache_salt=spec.cache_salt,
                )
            )
        sched.abort_requests([s.req_id for s in specs if s.abort_step == step_no])
        plan, outputs = core.step()
        assert plan.total_num_scheduled_tokens <= sched_cfg.token_budget
        assert len(plan.num_scheduled_tokens) <= sched_cfg.max_num_seqs
        for out in outputs:
            assert out.req_id not in run.finish, f"{out.req_id}: output after its finish"
            run.outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                run.finish[out.req_id] = out.finish_reason
        sched.check_integrity()
        sched.take_events()
        step_no += 1
        assert step_no < 3000, "no progress"

    for spec in specs:
        want_tokens, want_reason = reference(spec)
        got_reason = run.finish[spec.req_id]  # every request is reported finished, once
        got_tokens = run.outputs.get(spec.req_id, [])
        if got_reason == "abort":
            assert spec.abort_step is not None
            assert got_tokens == want_tokens[: len(got_tokens)]
        else:
            assert (got_tokens, got_reason) == (want_tokens, want_reason)
    kv = sched.kv_cache_manager
    assert not kv.req_to_blocks and not sched.requests
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_usable_blocks
    sched.check_integrity()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_scheduling_plans_on_tokens_in_flight(async_scheduling: bool) -> None:
    """With --async-scheduling the next plan goes out before the last one's tokens came
    back (the worker feeds them in), and no plan computes a token past max_tokens."""
    events: list[str] = []

    class Recording(SimExecutor):
        def submit(self, plan: StepPlan) -> None:
            events.append(f"submit {plan.step_id}" + (" (drops only)" if plan.is_empty else ""))
            super().submit(plan)

        def collect(self, step_id: int) -> StepResult:
            events.append(f"collect {step_id}")
            return super().collect(step_id)

    sched_cfg = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32,
                                async_scheduling=async_scheduling)  # fmt: skip
    config = EngineConfig(scheduler=sched_cfg, cache=CacheConfig(block_size=4))
    core = EngineCore(config, Recording(num_blocks=20, block_size=4, depth=1))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    core.scheduler.add_request(Request("r0", [1, 2, 3], params, eos_token_id=EOS))
    tokens: list[int] = []
    while core.has_work():
        _, outputs = core.step()
        tokens += [t for out in outputs for t in out.new_token_ids]
    assert tokens == [token_fn("r0", 3 + i) for i in range(6)]
    submits = [e for e in events if e.startswith("submit") and "drops" not in e]
    assert len(submits) == 6  # the prefill (its first token) and five decodes, no seventh
    if async_scheduling:
        assert events[:4] == ["submit 0", "submit 1", "collect 0", "submit 2"]
    else:
        assert events[:4] == ["submit 0", "collect 0", "submit 1", "collect 1"]
