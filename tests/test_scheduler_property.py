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

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.config import CacheConfig, SchedulerConfig
from services.protocol import SamplingParams
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from tests.test_scheduler import EOS, Run, SimWorker, step, token_fn

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


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_match_unlimited_memory(workload):
    sched_cfg, cache_cfg, num_blocks, specs = workload
    sched = Scheduler(sched_cfg, cache_cfg, num_blocks, enable_kv_cache_events=True)
    worker = SimWorker(num_blocks, cache_cfg.block_size)
    run = Run()
    pending = sorted(specs, key=lambda s: s.arrival_step)
    step_no = 0
    while pending or sched.has_unfinished_requests() or sched.has_finished_requests():
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
        step(sched, worker, run)  # checks budget, max_num_seqs and integrity every step
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
