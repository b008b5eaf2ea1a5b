"""Scheduler unit tests against a simulated worker that keeps a fake, checkable KV cache."""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field

import pytest

from services.config import CacheConfig, SchedulerConfig
from services.protocol import (
    BlockStored,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenizedRequest,
)
from services.request import Request, RequestEventType, RequestStatus
from services.scheduler.scheduler import Scheduler

VOCAB = 50
EOS = 0


def token_fn(req_id: str, pos: int) -> int:
    """The simulated model: the token at ``pos`` depends only on the request and the position."""
    return zlib.crc32(f"{req_id}:{pos}".encode()) % VOCAB


@dataclass
class _WorkerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class SimWorker:
    """The worker's side of StepPlan, with a KV cache that stores what each slot was computed from.

    A slot holds (position, hash of the tokens up to it), which is what real KV
    depends on. After writing a step's KV (all requests first, as a batched
    kernel does per layer), every request re-reads its whole prefix through
    its block table: a wrong hit, a block evicted while in use, or a stale
    table shows up as a mismatch.
    """

    def __init__(self, num_blocks: int, block_size: int, samples: bool = True) -> None:
        # samples=False: a pipeline stage before the last, which learns the sampled
        # tokens from the running deltas instead of sampling them.
        self.samples = samples
        self.block_size = block_size
        self.kv: list[list[tuple[int, int] | None]] = [
            [None] * block_size for _ in range(num_blocks)
        ]
        self.reqs: dict[str, _WorkerRequest] = {}
        self.num_computed_tokens_total = 0

    def execute(self, plan: StepPlan) -> StepResult:
        bs = self.block_size
        for req_id in plan.finished_req_ids:
            self.reqs.pop(req_id, None)
        batch: list[tuple[str, _WorkerRequest]] = []
        for new in plan.new_requests:
            assert new.req_id not in self.reqs, f"{new.req_id}: stale state not dropped"
            assert 0 not in new.block_ids, "the null block was handed out"
            state = _WorkerRequest(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens
            )
            self.reqs[new.req_id] = state
            batch.append((new.req_id, state))
        for delta in plan.running:
            state = self.reqs[delta.req_id]
            assert state.num_computed_tokens == delta.num_computed_tokens
            assert 0 not in delta.new_block_ids
            state.block_ids.extend(delta.new_block_ids)
            if not self.samples:
                state.token_ids.extend(delta.new_token_ids)
            batch.append((delta.req_id, state))
        assert len(batch) == len(plan.num_scheduled_tokens)
        for (_, state), n in zip(batch, plan.num_scheduled_tokens, strict=True):
            end = state.num_computed_tokens + n
            assert n > 0 and end <= len(state.token_ids)
            assert len(state.block_ids) * bs >= end
            for pos in range(state.num_computed_tokens, end):
                self.kv[state.block_ids[pos // bs]][pos % bs] = self._slot(state.token_ids, pos)
            self.num_computed_tokens_total += n
        result = StepResult(step_id=plan.step_id)
        for (req_id, state), n in zip(batch, plan.num_scheduled_tokens, strict=True):
            state.num_computed_tokens += n
            for pos in range(state.num_computed_tokens):
                slot = self.kv[state.block_ids[pos // bs]][pos % bs]
                assert slot == self._slot(state.token_ids, pos), f"{req_id}: bad KV at {pos}"
            if self.samples and state.num_computed_tokens == len(state.token_ids):
                token = self.pick(plan, req_id, len(state.token_ids))
                state.token_ids.append(token)
                result.req_ids.append(req_id)
                result.sampled_token_ids.append(token)
        return result

    def pick(self, plan: StepPlan, req_id: str, pos: int) -> int:
        """The token ``req_id`` samples at ``pos`` in ``plan``."""
        return token_fn(req_id, pos)

    @staticmethod
    def _slot(token_ids: list[int], pos: int) -> tuple[int, int]:
        return pos, hash(tuple(token_ids[: pos + 1]))


@dataclass
class Run:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)
    plans: list[StepPlan] = field(default_factory=list)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 128,
    **sched_kwargs,
) -> tuple[Scheduler, SimWorker]:
    cache_kwargs = {k: sched_kwargs.pop(k) for k in list(sched_kwargs) if hasattr(CacheConfig, k)}
    sched = Scheduler(
        SchedulerConfig(
            max_model_len=max_model_len,
            **{"max_num_batched_tokens": 2048, **sched_kwargs},
        ),
        CacheConfig(block_size=block_size, **cache_kwargs),
        num_blocks,
        enable_kv_cache_events=True,
    )
    return sched, SimWorker(num_blocks, block_size)


def make_request(
    req_id: str, prompt: list[int] | int, max_tokens: int | None = 4, **kwargs
) -> Request:
    if isinstance(prompt, int):  # a prompt of that length, unlike any other request's
        prompt = [100 + zlib.crc32(f"{req_id}/{i}".encode()) % 10_000 for i in range(prompt)]
    params = SamplingParams(
        max_tokens=kwargs.pop("max_tokens_override", max_tokens),
        ignore_eos=kwargs.pop("ignore_eos", True),
        min_tokens=kwargs.pop("min_tokens", 0),
        stop_token_ids=kwargs.pop("stop_token_ids", []),
    )
    eos_token_id = kwargs.pop("eos_token_id", EOS)
    return Request(req_id, prompt, params, eos_token_id=eos_token_id, **kwargs)


def step(sched: Scheduler, worker: SimWorker, run: Run | None = None) -> StepPlan:
    plan = sched.schedule()
    cfg = sched.scheduler_config
    assert plan.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(plan.num_scheduled_tokens) <= cfg.max_num_seqs
    for out in sched.update_from_output(plan, worker.execute(plan)):
        if run is not None:
            assert out.req_id not in run.finish, f"{out.req_id}: output after its finish"
            run.outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                run.finish[out.req_id] = out.finish_reason
    sched.check_integrity()
    if run is not None:
        run.plans.append(plan)
    return plan


def run_to_completion(sched: Scheduler, worker: SimWorker, max_steps: int = 1000) -> Run:
    run = Run()
    for _ in range(max_steps):
        if not (sched.has_unfinished_requests() or sched.has_finished_requests()):
            return run
        step(sched, worker, run)
    raise AssertionError("requests did not finish")


def scheduled(plan: StepPlan) -> dict[str, int]:
    ids = [r.req_id for r in plan.new_requests] + [r.req_id for r in plan.running]
    return dict(zip(ids, plan.num_scheduled_tokens, strict=True))


# ---------------------------------------------------------------- budget and chunking


def test_decode_first_budget_accounting():
    sched, worker = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_request("a", 6, max_tokens=8))
    sched.add_request(make_request("b", 6, max_tokens=8))
    assert scheduled(step(sched, worker)) == {"a": 6, "b": 4}  # b chunked to what is left
    sched.add_request(make_request("c", 30, max_tokens=8))
    # a decodes first, then b's unfinished prefill, then c gets the rest of the budget.
    assert scheduled(step(sched, worker)) == {"a": 1, "b": 2, "c": 7}
    plan = step(sched, worker)
    assert scheduled(plan) == {"a": 1, "b": 1, "c": 8}
    assert plan.running[0].req_id == "a"  # decodes lead the running section


def test_chunk_sizes_cover_the_prompt_exactly():
    sched, worker = make_scheduler(max_num_batched_tokens=7, max_model_len=64)
    sched.add_request(make_request("a", 20, max_tokens=2))
    chunks = [scheduled(step(sched, worker))["a"] for _ in range(3)]
    assert chunks == [7, 7, 6]
    assert sched.requests["a"].num_output_tokens == 1  # only the last chunk sampled


def test_chunked_prefill_disabled_waits_for_budget():
    sched, worker = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 10, max_tokens=3))
    sched.add_request(make_request("b", 10, max_tokens=3))
    assert scheduled(step(sched, worker)) == {"a": 10}  # b does not fit the 6 left: it waits
    assert scheduled(step(sched, worker)) == {"a": 1, "b": 10}


def test_long_prefill_token_threshold_caps_one_request():
    sched, worker = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=5)
    sched.add_request(make_request("a", 12, max_tokens=2))
    sched.add_request(make_request("b", 3, max_tokens=2))
    assert scheduled(step(sched, worker)) == {"a": 5, "b": 3}
    assert scheduled(step(sched, worker)) == {"b": 1, "a": 5}
    assert scheduled(step(sched, worker)) == {"a": 2}


def test_max_num_seqs():
    sched, worker = make_scheduler(max_num_seqs=2)
    for name in "abc":
        sched.add_request(make_request(name, 4, max_tokens=3))
    run = Run()
    assert set(scheduled(step(sched, worker, run))) == {"a", "b"}
    assert sched.get_stats().num_waiting_by_reason == {"capacity": 1, "deferred": 0}
    while "a" not in run.finish:
        assert "c" not in scheduled(step(sched, worker, run))
    assert "c" in scheduled(step(sched, worker, run))


def test_no_decode_before_the_sampled_token_is_back():
    sched, worker = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=3))
    plan = sched.schedule()
    assert sched.schedule().is_empty  # the token a samples is not known yet
    sched.update_from_output(plan, worker.execute(plan))
    assert scheduled(sched.schedule()) == {"a": 1}


# ---------------------------------------------------------------- policies and preemption


def test_priority_policy_admits_lowest_value_first():
    sched, worker = make_scheduler(scheduling_policy="priority", max_num_seqs=1)
    sched.add_request(make_request("late", 4, max_tokens=1, priority=5, arrival_time=1.0))
    sched.add_request(make_request("urgent", 4, max_tokens=1, priority=-1, arrival_time=2.0))
    sched.add_request(make_request("early", 4, max_tokens=1, priority=5, arrival_time=0.5))
    order = [next(iter(scheduled(step(sched, worker)))) for _ in range(3)]
    assert order == ["urgent", "early", "late"]


def test_preemption_takes_the_newest_and_resumes_it_with_all_tokens(caplog):
    # 6 usable blocks of 4 tokens; a and b each grow to 12 tokens (3 blocks) and more.
    sched, worker = make_scheduler(num_blocks=7, max_model_len=24)
    sched.add_request(make_request("a", 8, max_tokens=12))
    sched.add_request(make_request("b", 8, max_tokens=12))
    run = Run()
    with caplog.at_level(logging.WARNING):
        while not any(plan.finished_req_ids for plan in run.plans):
            step(sched, worker, run)
    preempting = run.plans[-1]
    assert preempting.finished_req_ids == ["b"]  # the newest goes; the worker drops it
    assert "b" not in scheduled(preempting) and not preempting.new_requests
    assert "is preempted by PreemptionMode.RECOMPUTE" in caplog.text
    assert "total_cumulative_preemption_cnt=1" in caplog.text
    b = sched.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert sched.waiting.peek() is b
    outputs_before = list(b.output_token_ids)
    while not any(r.req_id == "b" for r in run.plans[-1].new_requests):
        step(sched, worker, run)
    resumed = next(r for r in run.plans[-1].new_requests if r.req_id == "b")
    assert resumed.token_ids == b.prompt_token_ids + outputs_before
    assert len(resumed.block_ids) * 4 >= resumed.num_computed_tokens + scheduled(run.plans[-1])["b"]
    run_rest = run_to_completion(sched, worker)
    assert {**run.finish, **run_rest.finish} == {"a": "length", "b": "length"}
    assert sched.get_stats().num_preemptions >= 1
    assert [e for e, _ in b.events].count(RequestEventType.PREEMPTED) == b.num_preemptions


def test_priority_policy_preempts_the_lowest_priority():
    sched, worker = make_scheduler(num_blocks=7, max_model_len=24, scheduling_policy="priority")
    sched.add_request(make_request("low", 8, max_tokens=12, priority=9, arrival_time=0.0))
    sched.add_request(make_request("high", 8, max_tokens=12, priority=0, arrival_time=1.0))
    run = Run()
    while not any(plan.finished_req_ids for plan in run.plans):
        step(sched, worker, run)
    assert run.plans[-1].finished_req_ids == ["low"]


def test_preemption_of_a_request_sharing_prefix_blocks():
    shared = list(range(1, 13))  # 3 full blocks
    sched, worker = make_scheduler(num_blocks=9, max_model_len=32)
    sched.add_request(make_request("a", shared + [20], max_tokens=16))
    step(sched, worker)
    sched.add_request(make_request("b", shared + [21], max_tokens=16))
    sched.add_request(make_request("c", shared + [22], max_tokens=16))
    plan = step(sched, worker)
    assert {r.req_id: r.num_computed_tokens for r in plan.new_requests} == {"b": 12, "c": 12}
    shared_blocks = sched.kv_cache_manager.req_to_blocks["a"][:3]
    assert [blk.ref_cnt for blk in shared_blocks] == [3, 3, 3]
    run = run_to_completion(sched, worker)
    assert sched.num_preemptions > 0
    assert run.finish == {"a": "length", "b": "length", "c": "length"}
    for name in "abc":  # the last of 16 outputs, whatever preemption did in between
        assert run.outputs[name][-1] == token_fn(name, len(shared) + 1 + 15)
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


def test_preempted_request_is_readmitted_with_a_prefix_hit():
    sched, worker = make_scheduler(num_blocks=7, max_model_len=24)
    sched.add_request(make_request("a", 8, max_tokens=12))
    sched.add_request(make_request("b", 8, max_tokens=12))
    run = Run()
    while not any(r.req_id == "b" for p in run.plans[1:] for r in p.new_requests):
        step(sched, worker, run)
    resumed = next(r for r in run.plans[-1].new_requests if r.req_id == "b")
    # b's blocks were freed tail first; its prompt blocks were still cached when it came back
    # (a's finishing freed room without evicting them).
    assert resumed.num_computed_tokens > 0
    stats = sched.get_stats().prefix_cache_stats
    assert stats.preempted_requests == 1 and stats.preempted_hits == resumed.num_computed_tokens
    rest = run_to_completion(sched, worker)
    assert rest.finish == {"b": "length"}


# ---------------------------------------------------------------- prefix cache in the scheduler


def test_fully_cached_prompt_computes_only_its_last_token():
    sched, worker = make_scheduler()
    prompt = list(range(1, 17))  # exactly 4 blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(sched, worker)
    sched.add_request(make_request("b", prompt, max_tokens=2))
    plan = step(sched, worker)
    assert plan.new_requests[0].num_computed_tokens == 15
    assert plan.num_scheduled_tokens == [1]
    assert len(plan.new_requests[0].block_ids) == 4  # the last hit block takes the last token
    run = run_to_completion(sched, worker)
    assert sched.take_finished_requests()[-1].num_cached_tokens == 15
    assert run.finish == {"b": "length"}


def test_same_new_prefix_twice_in_one_step():
    sched, worker = make_scheduler()
    prompt = list(range(1, 11))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    sched.add_request(make_request("b", prompt, max_tokens=1))
    plan = step(sched, worker)
    assert plan.num_scheduled_tokens == [10, 10]  # both compute: nothing is cached mid-step
    assert not set(plan.new_requests[0].block_ids) & set(plan.new_requests[1].block_ids)
    pool = sched.kv_cache_manager.block_pool
    cached = [b for b in pool.blocks if b.block_hash is not None]
    assert len(cached) == 2 and len({b.block_hash for b in cached}) == 2  # one block per hash
    sched.add_request(make_request("c", prompt, max_tokens=1))
    assert step(sched, worker).new_requests[0].num_computed_tokens == 8


def test_cache_salt_isolates_requests():
    sched, worker = make_scheduler()
    prompt = list(range(1, 11))
    sched.add_request(make_request("a", prompt, max_tokens=1, cache_salt="tenant-1"))
    run_to_completion(sched, worker)
    sched.add_request(make_request("b", prompt, max_tokens=1, cache_salt="tenant-2"))
    sched.add_request(make_request("c", prompt, max_tokens=1, cache_salt="tenant-1"))
    plan = step(sched, worker)
    assert {r.req_id: r.num_computed_tokens for r in plan.new_requests} == {"b": 0, "c": 8}


# ---------------------------------------------------------------- stop conditions


def test_stop_conditions():
    tokens = [token_fn("r", 4 + i) for i in range(12)]  # what the simulated model will say
    eos = tokens[5]
    first_eos = tokens.index(eos)

    def finish(**kwargs):
        sched, worker = make_scheduler()
        sched.add_request(make_request("r", 4, max_tokens=12, **kwargs))
        run = run_to_completion(sched, worker)
        done = sched.take_finished_requests()[0]
        assert done.finish_reason == run.finish["r"]
        return run.outputs["r"], run.finish["r"], done.stop_reason

    assert finish(eos_token_id=eos, ignore_eos=False) == (tokens[: first_eos + 1], "stop", None)
    assert finish(eos_token_id=eos, ignore_eos=True) == (tokens, "length", None)
    # min_tokens holds EOS back: the first EOS at or after the 7th token stops it.
    later = next((i for i in range(6, 12) if tokens[i] == eos), None)
    want = (tokens, "length") if later is None else (tokens[: later + 1], "stop")
    assert finish(eos_token_id=eos, ignore_eos=False, min_tokens=7)[:2] == want
    stop_id = tokens[3]
    first_stop = tokens.index(stop_id)
    assert finish(stop_token_ids=[stop_id]) == (tokens[: first_stop + 1], "stop", stop_id)
    assert finish(max_tokens_override=3) == (tokens[:3], "length", None)


def test_max_model_len_caps_output():
    sched, worker = make_scheduler(max_model_len=10)
    sched.add_request(make_request("r", 6, max_tokens=None))
    run = run_to_completion(sched, worker)
    assert len(run.outputs["r"]) == 4 and run.finish["r"] == "length"


def test_request_from_tokenized_message():
    msg = TokenizedRequest(
        "t",
        [1, 2, 3],
        SamplingParams(max_tokens=2),
        arrival_time=5.0,
        priority=2,
        cache_salt="s",
        eos_token_id=9,
    )
    req = Request.from_tokenized(msg)
    assert (req.req_id, req.prompt_token_ids, req.eos_token_id) == ("t", [1, 2, 3], 9)
    assert (req.arrival_time, req.priority, req.cache_salt) == (5.0, 2, "s")
    assert req.sampling_params.max_tokens == 2 and req.status == RequestStatus.WAITING


def test_bad_requests_are_rejected():
    sched, _ = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="prompt tokens"):
        sched.add_request(make_request("long", 9))
    with pytest.raises(ValueError, match="prompt tokens"):
        sched.add_request(make_request("empty", []))
    sched.add_request(make_request("x", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("x", 3))


# ---------------------------------------------------------------- abort and finish


@pytest.mark.parametrize(
    "state", ["waiting", "mid_prefill", "decode", "preempted", "finished", "unknown"]
)
def test_abort_in_every_state(state):
    sched, worker = make_scheduler(num_blocks=7, max_model_len=24, max_num_batched_tokens=6)
    run = Run()
    sched.add_request(make_request("a", 8, max_tokens=12))
    target = "a"
    if state == "waiting":
        sched.add_request(make_request("w", 4, max_tokens=2))
        target = "w"  # the budget is spent on a, w waits
        step(sched, worker, run)
        assert sched.requests["w"].status == RequestStatus.WAITING
    elif state == "mid_prefill":
        step(sched, worker, run)
        assert sched.requests["a"].num_computed_tokens == 6
    elif state == "decode":
        step(sched, worker, run)
        step(sched, worker, run)
        assert sched.requests["a"].num_output_tokens == 1
    elif state == "preempted":
        sched.add_request(make_request("b", 8, max_tokens=12))
        target = "b"
        while "b" not in sched.requests or sched.requests["b"].num_preemptions == 0:
            step(sched, worker, run)
    elif state == "finished":
        run = run_to_completion(sched, worker)
    else:
        target = "nope"
    was_running = (
        target in sched.requests and sched.requests[target].status == RequestStatus.RUNNING
    )
    reported_before = run.finish.get(target)
    sched.abort_requests([target])
    sched.abort_requests([target])  # twice: harmless
    assert target not in sched.requests
    plan = step(sched, worker, run)
    assert (target in plan.finished_req_ids) == was_running
    if state in ("finished", "unknown"):
        assert run.finish.get(target) == reported_before  # nothing new reported
    else:
        assert run.finish[target] == "abort"
    run_to_completion(sched, worker)
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


def test_finish_requests_frees_and_reports_once():
    sched, worker = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=10))
    run = Run()
    step(sched, worker, run)
    sched.finish_requests(["a"], "stop", stop_reason="\n\n")
    sched.finish_requests(["a", "zzz"], "stop")
    assert sched.has_finished_requests() and not sched.has_unfinished_requests()
    plan = sched.schedule()
    assert plan.is_empty and plan.finished_req_ids == ["a"]
    assert sched.update_from_output(plan, None)[0].finish_reason == "abort"
    done = sched.take_finished_requests()[0]
    assert done.finish_reason == "stop" and done.stop_reason == "\n\n"
    assert not sched.has_finished_requests()


# ---------------------------------------------------------------- stats


def test_stats_and_events():
    sched, worker = make_scheduler(max_num_batched_tokens=8)
    prompt = list(range(1, 11))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(sched, worker)
    sched.add_request(make_request("b", prompt, max_tokens=3))
    step(sched, worker)
    stats = sched.get_stats()
    assert stats.num_running_reqs == 1 and stats.num_waiting_reqs == 0
    assert stats.prefix_cache_stats.queries == 20 and stats.prefix_cache_stats.hits == 8
    assert stats.step_num_scheduled_tokens == 2
    assert 0 < stats.kv_cache_usage <= 1
    (stored,) = sched.take_events()  # a's first chunk filled 2 blocks; nothing else filled one
    assert isinstance(stored, BlockStored) and stored.parent_block_hash is None
    assert stored.token_ids == prompt[:8] and len(stored.block_hashes) == 2
    b = sched.requests["b"]
    assert [e for e, _ in b.events] == [
        RequestEventType.QUEUED,
        RequestEventType.SCHEDULED,
        RequestEventType.NEW_TOKENS,
    ]
