"""Structured outputs in the scheduler: grammars compile off the loop, bitmask rows go out
with the plans, sampled tokens advance the matchers (services/structured_output/manager.py).

A fake grammar engine (registered for these tests) allows exactly one token sequence, so
the expected output is known; the tests' simulated worker samples from the plan's bitmask
row when there is one, so a stale or misplaced row shows up as a token the grammar refuses.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
import pytest

from services.config import StructuredOutputsConfig
from services.protocol import SamplingParams, StepPlan, StructuredOutputsParams
from services.registry import GRAMMAR_BACKENDS
from services.request import Request, RequestStatus
from services.structured_output.backend import Constraint, GrammarError, VocabInfo
from services.structured_output.bitmask import bitmask_rows
from services.structured_output.manager import StructuredOutputManager
from tests.test_scheduler import EOS, VOCAB, SimWorker, make_request, make_scheduler, step

TARGET = [7, 8, 9, 10, 11]  # what the fake grammar allows, then EOS


class FakeMatcher:
    def __init__(self, target: list[int]) -> None:
        self.target, self.pos, self.done = target, 0, False

    def _next(self) -> int:
        return self.target[self.pos] if self.pos < len(self.target) else EOS

    def accept(self, token_id: int) -> bool:
        if self.done or token_id != self._next():
            return False
        self.done = token_id == EOS
        self.pos += 1
        return True

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row] = 0
        token = self._next()
        bitmask[row, token // 32] = np.int32(np.uint32(1 << (token % 32)).view(np.int32))

    def rollback(self, num_tokens: int) -> None:
        raise NotImplementedError

    def is_terminated(self) -> bool:
        return self.done


class FakeBackend:
    """``regex`` "a,b,c" allows tokens a, b, c then EOS; "bad" fails to compile. Compiles
    wait for ``gate``."""

    gate = threading.Event()
    compiled: list[str] = []

    def __init__(self, vocab: VocabInfo) -> None:
        self.vocab_size = vocab.vocab_size

    @staticmethod
    def check(constraint: Constraint) -> None:
        pass

    def matcher(self, constraint: Constraint) -> FakeMatcher:
        assert self.gate.wait(10)
        self.compiled.append(constraint.spec)
        if constraint.spec == "bad":
            raise GrammarError("Invalid regex for structured outputs: bad")
        return FakeMatcher([int(t) for t in constraint.spec.split(",")])


@pytest.fixture(autouse=True)
def fake_backend(monkeypatch: pytest.MonkeyPatch):
    """A grammar engine registered by name, as a real one is (services/registry.py)."""
    monkeypatch.setitem(GRAMMAR_BACKENDS, "fake", f"{__name__}:FakeBackend")
    FakeBackend.gate.set()
    FakeBackend.compiled.clear()


class GrammarWorker(SimWorker):
    """Samples what the plan's bitmask row allows (the lowest such token), as a real
    sampler under the mask; ``ignore_mask`` samples as if there were none."""

    ignore_mask = False

    def pick(self, plan: StepPlan, req_id: str, pos: int) -> int:
        if self.ignore_mask or req_id not in plan.grammar_req_ids:
            return super().pick(plan, req_id, pos)
        rows = bitmask_rows(plan.grammar_bitmask, len(plan.grammar_req_ids)).numpy()
        row = rows[plan.grammar_req_ids.index(req_id)]
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        return int(allowed[0])


def constrained(req_id: str, prompt: int | list[int], spec: str, **kw) -> Request:
    request = make_request(req_id, prompt, max_tokens=20, ignore_eos=False, **kw)
    request.sampling_params = SamplingParams(
        max_tokens=20, structured_outputs=StructuredOutputsParams(regex=spec)
    )
    return request


def setup(synchronous: bool = False, wake=None, **kw):
    manager = StructuredOutputManager(
        StructuredOutputsConfig(backend="fake"),
        lambda: VocabInfo(None, VOCAB, (EOS,)),  # type: ignore[arg-type]
        wake=wake,
        synchronous=synchronous,
    )
    sched, _ = make_scheduler(**kw)
    sched.structured_output = manager
    return sched, GrammarWorker(kw.get("num_blocks", 64), kw.get("block_size", 4))


def finish_all(sched, worker, run=None, max_steps: int = 200):
    from tests.test_scheduler import Run

    run = run or Run()
    for _ in range(max_steps):
        if not (sched.has_unfinished_requests() or sched.has_finished_requests()):
            return run
        step(sched, worker, run)
    raise AssertionError("requests did not finish")


def test_compiles_off_the_loop_and_joins_the_queue_when_ready():
    woken = threading.Event()
    sched, worker = setup(wake=woken.set)
    FakeBackend.gate.clear()  # the compile waits
    sched.add_request(constrained("g", 9, "7,8,9"))
    sched.add_request(make_request("free", 6, max_tokens=3))
    assert sched.requests["g"].status == RequestStatus.WAITING_FOR_GRAMMAR
    plan = step(sched, worker)
    assert "g" not in {r.req_id for r in plan.new_requests}  # the free one runs meanwhile
    stats = sched.get_stats()
    assert stats.num_waiting_reqs == 1 and stats.num_waiting_by_reason["deferred"] == 1
    run = finish_all(sched, worker)  # the free one finishes; the compiling one does not stop it
    assert run.finish == {"free": "length"}
    assert not sched.has_unfinished_requests()  # only a compile left: the loop may sleep
    FakeBackend.gate.set()
    assert woken.wait(5)  # the compile's end wakes the loop
    run = finish_all(sched, worker)
    assert run.outputs["g"] == [7, 8, 9, EOS] and run.finish["g"] == "stop"
    rows = [p for p in run.plans if p.grammar_req_ids]
    assert len(rows) == 4 and all(p.grammar_req_ids == ["g"] for p in rows)
    assert all(len(p.grammar_bitmask) == 4 * ((VOCAB + 31) // 32) for p in rows)
    assert not sched.requests and sched.kv_cache_manager.block_pool.get_usage() == 0


def test_constrained_and_free_requests_share_steps_and_rows_follow_the_samplers():
    """Several grammars and free requests in one batch, with chunked prefill: a bitmask row
    only for constrained requests that sample in the step, in plan order."""
    sched, worker = setup(synchronous=True, max_num_batched_tokens=12)
    specs = {"a": "7,8", "b": "9,10,11,12", "c": "13"}
    for req_id, spec in specs.items():
        sched.add_request(constrained(req_id, 10, spec))
    sched.add_request(make_request("free", 10, max_tokens=5))
    run = finish_all(sched, worker)
    for req_id, spec in specs.items():
        assert run.outputs[req_id] == [int(t) for t in spec.split(",")] + [EOS]
    assert len(run.outputs["free"]) == 5
    for plan in run.plans:
        sampling = [
            r.req_id
            for r, n in zip(
                [*plan.new_requests, *plan.running], plan.num_scheduled_tokens, strict=True
            )
            if r.num_computed_tokens + n >= 10 and r.req_id in specs  # prompt done: it samples
        ]
        assert plan.grammar_req_ids == sampling


def test_async_scheduling_never_plans_a_constrained_request_on_a_token_in_flight():
    """Two plans in flight: a row filled before the last token came back would allow the
    wrong token (and the grammar would refuse what the worker sampled)."""
    sched, worker = setup(synchronous=True, async_scheduling=True)
    sched.async_scheduling = True
    sched.add_request(constrained("g", 5, ",".join(map(str, TARGET))))
    sched.add_request(make_request("free", 5, max_tokens=8))
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    in_flight: deque = deque()
    for _ in range(100):
        if not (sched.has_unfinished_requests() or in_flight or sched.has_finished_requests()):
            break
        while len(in_flight) < 2:
            plan = sched.schedule()
            if plan.is_empty and in_flight:
                break
            in_flight.append((plan, worker.execute(plan)))
        plan, result = in_flight.popleft()
        for out in sched.update_from_output(plan, result):
            outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                finish[out.req_id] = out.finish_reason
        sched.check_integrity()
    assert outputs["g"] == [*TARGET, EOS] and finish["g"] == "stop"
    assert len(outputs["free"]) == 8


def test_preempted_constrained_request_resumes_in_its_grammar():
    sched, worker = setup(synchronous=True, num_blocks=8, block_size=4, max_model_len=24)
    long_spec = ",".join(str(7 + i % 20) for i in range(14))
    sched.add_request(constrained("g1", 6, long_spec))
    sched.add_request(constrained("g2", 6, long_spec))
    run = finish_all(sched, worker)
    assert sched.num_preemptions > 0
    for req_id in ("g1", "g2"):
        assert run.outputs[req_id] == [*map(int, long_spec.split(",")), EOS]


def test_abort_while_compiling_frees_everything():
    sched, worker = setup()
    FakeBackend.gate.clear()
    sched.add_request(constrained("g", 9, "7,8"))
    sched.abort_requests(["g"])
    FakeBackend.gate.set()
    run = finish_all(sched, worker)
    assert run.finish == {"g": "abort"} and not sched.requests
    assert "g" not in sched.structured_output


def test_a_grammar_that_fails_to_compile_ends_the_request_in_an_error():
    sched, worker = setup()
    sched.add_request(constrained("bad", 9, "bad"))
    sched.add_request(make_request("free", 6, max_tokens=2))
    run = finish_all(sched, worker)
    for _ in range(50):  # the compile thread may still be at it
        if "bad" in run.finish:
            break
        threading.Event().wait(0.02)
        run = finish_all(sched, worker, run)
    assert run.finish == {"bad": "error", "free": "length"} and not sched.requests


def test_a_token_the_grammar_refuses_ends_the_request_in_an_error():
    sched, worker = setup(synchronous=True)
    worker.ignore_mask = True  # a sampler that ignored the row (a bug): caught, not served
    sched.add_request(constrained("g", 9, "7,8"))
    run = finish_all(sched, worker)
    assert run.finish == {"g": "error"} and not sched.requests


def test_synchronous_compile_errors_raise_at_add():
    sched, _ = setup(synchronous=True)
    with pytest.raises(ValueError, match="Invalid regex"):
        sched.add_request(constrained("bad", 9, "bad"))
    assert not sched.requests


def test_without_a_backend_a_constrained_request_is_refused():
    sched, _ = make_scheduler()
    with pytest.raises(ValueError, match="no structured outputs backend"):
        sched.add_request(constrained("g", 9, "7"))


def test_workers_never_see_the_constraint():
    request = constrained("g", 9, "7")
    assert request.worker_sampling_params.structured_outputs is None
    assert request.sampling_params.structured_outputs is not None
