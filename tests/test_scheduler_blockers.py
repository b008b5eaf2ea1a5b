"""Blocking predicates: a condition that holds running requests back is registered, not
written into ``Scheduler.schedule``."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.config import EngineConfig
from services.protocol import SamplingParams, StepPlan
from services.request import Request, RequestStatus
from services.scheduler.engine_core import EngineCore
from tests.test_scheduler import (
    EOS,
    Run,
    make_request,
    make_scheduler,
    run_to_completion,
    scheduled,
    step,
    token_fn,
)
from tests.test_scheduler_property import SimExecutor, reference, workloads


def test_a_registered_blocker_holds_running_requests_until_it_lifts():
    sched, worker = make_scheduler(max_num_batched_tokens=8)
    lifted = False
    sched.add_blocker("held", lambda r: r.req_id.startswith("held-") and not lifted)
    sched.add_request(make_request("held-a", 4, max_tokens=3))
    sched.add_request(make_request("free", 4, max_tokens=3))
    sched.add_request(make_request("held-b", 12, max_tokens=3))
    run = Run()
    # Admission is not the running pass's: both prompts fit; held-b waits for the budget.
    assert scheduled(step(sched, worker, run)) == {"held-a": 4, "free": 4}
    # held-a sits out; held-b is admitted with a first chunk of its prompt.
    assert scheduled(step(sched, worker, run)) == {"held-b": 7, "free": 1}
    assert scheduled(step(sched, worker, run)) == {"free": 1}  # held-b mid-prefill sits out
    assert run.finish == {"free": "length"}
    for _ in range(3):  # only blocked requests are left: the steps are empty, nothing is lost
        assert step(sched, worker, run).is_empty
        a, b = sched.requests["held-a"], sched.requests["held-b"]
        assert (a.num_computed_tokens, b.num_computed_tokens) == (4, 7)
        assert a.status == b.status == RequestStatus.RUNNING
        assert sched.has_unfinished_requests()
    assert run.outputs["held-a"] == [token_fn("held-a", 4)]  # its prefill's token only

    lifted = True
    first = step(sched, worker, run)
    assert scheduled(first) == {"held-a": 1, "held-b": 5}  # the decode first, then the chunk
    rest = run_to_completion(sched, worker)
    for req_id, prompt_len in (("held-a", 4), ("held-b", 12)):
        tokens = run.outputs.get(req_id, []) + rest.outputs.get(req_id, [])
        assert tokens == [token_fn(req_id, prompt_len + i) for i in range(3)]
        assert rest.finish[req_id] == "length"
    assert not sched.requests and sched.kv_cache_manager.block_pool.get_usage() == 0


def test_removing_a_blocker_lifts_it_and_names_are_unique():
    sched, worker = make_scheduler()
    sched.add_blocker("all", lambda r: True)
    with pytest.raises(ValueError, match="already registered"):
        sched.add_blocker("all", lambda r: False)
    sched.add_request(make_request("a", 5, max_tokens=2))
    assert scheduled(step(sched, worker)) == {"a": 5}
    assert step(sched, worker).is_empty
    sched.remove_blocker("all")
    assert scheduled(step(sched, worker)) == {"a": 1}


def test_features_register_their_blockers_by_configuration():
    sched, _ = make_scheduler()
    assert "token_in_flight" in sched.blockers
    assert "ends_in_flight" not in sched.blockers
    assert "grammar_needs_token_in_flight" not in sched.blockers
    sched.async_scheduling = True
    assert "ends_in_flight" in sched.blockers
    sched.async_scheduling = False
    assert "ends_in_flight" not in sched.blockers


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from([1, 2, "async"]), st.integers(0, 2**32 - 1))
def test_a_blocker_at_random_steps_never_changes_the_tokens(workload, depth, seed):
    """Holding running requests back at arbitrary steps (with preemption, prefix hits,
    chunking, plans in flight) only delays them: every request still produces exactly
    the tokens plain autoregression gives."""
    sched_cfg, cache_cfg, num_blocks, specs = workload
    sched_cfg.async_scheduling = depth == "async"
    depth = 1 if depth == "async" else depth
    config = EngineConfig(scheduler=sched_cfg, cache=cache_cfg)
    config.parallel.pipeline_parallel_size = depth
    executor = SimExecutor(num_blocks, cache_cfg.block_size, depth)
    core = EngineCore(config, executor, enable_kv_cache_events=True)
    sched = core.scheduler
    step_no = 0

    def held(request: Request) -> bool:  # a quarter of the (request, step) pairs
        return zlib.crc32(f"{seed}:{request.req_id}:{step_no}".encode()) % 4 == 0

    sched.add_blocker("random", held)
    schedule = sched.schedule

    def checked_schedule() -> StepPlan:  # the engine core may plan more than once a step
        blocked = {r.req_id for r in sched.running if held(r)}
        plan = schedule()
        assert not blocked & {r.req_id for r in plan.running}, "a blocked request ran"
        return plan

    sched.schedule = checked_schedule  # type: ignore[method-assign]
    for spec in specs:
        params = SamplingParams(
            max_tokens=spec.max_tokens,
            min_tokens=spec.min_tokens,
            ignore_eos=spec.ignore_eos,
            stop_token_ids=spec.stop_token_ids,
        )
        sched.add_request(Request(spec.req_id, list(spec.prompt), params, eos_token_id=EOS))
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    while core.has_work():
        _, outs = core.step()
        for out in outs:
            outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finish[out.req_id] = out.finish_reason
        sched.check_integrity()
        step_no += 1
        assert step_no < 5000, "no progress"
    for spec in specs:
        assert (outputs.get(spec.req_id, []), finish[spec.req_id]) == reference(spec)
    assert not sched.requests and not sched.kv_cache_manager.req_to_blocks
