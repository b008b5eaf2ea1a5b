"""``--async-scheduling`` (overlap): the scheduler plans step N+1 while step N runs and the
worker feeds N's sampled tokens into N+1. Outputs must not change: the same greedy (and
seeded) tokens as without it, offline and through the server, on the real torch backend."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from launch.llm import LLM, SamplingParams
from services.config import EngineConfig
from tests.server_utils import RemoteServer

PROMPTS = [
    "The capital of France is",
    "List three colours:",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(max_model_len=512, num_gpu_blocks_override=128)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    stop = SamplingParams(temperature=0, max_tokens=40, stop=["\n"])
    outs = llm.generate(PROMPTS, greedy) + llm.generate(PROMPTS[:2], seeded)
    outs += llm.generate(PROMPTS[2:3], stop)  # ends at a stop string or EOS, not at length
    return [o.outputs[0].token_ids for o in outs]


def test_offline_async_scheduling_gives_the_same_tokens(reference) -> None:
    # A small pool so that some requests are preempted and recomputed on the way.
    llm = LLM(max_model_len=96, num_gpu_blocks_override=7, async_scheduling=True)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    stop = SamplingParams(temperature=0, max_tokens=40, stop=["\n"])
    outs = llm.generate(PROMPTS, greedy) + llm.generate(PROMPTS[:2], seeded)
    outs += llm.generate(PROMPTS[2:3], stop)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.core.pipeline_depth == 2 and llm.scheduler.num_preemptions > 0


def test_served_async_scheduling_gives_the_same_tokens(reference) -> None:
    with RemoteServer("--async-scheduling") as server:
        server.wait_ready()

        def complete(args: tuple[str, dict]) -> list[int]:
            prompt, params = args
            body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 24,
                    "ignore_eos": True, "return_token_ids": True, **params}  # fmt: skip
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]  # type: ignore[no-any-return]

        jobs = [(p, {"temperature": 0}) for p in PROMPTS] + [
            (p, {"temperature": 0.8, "seed": 3}) for p in PROMPTS[:2]
        ]
        jobs.append((PROMPTS[2], {"temperature": 0, "max_tokens": 40, "stop": ["\n"],
                                  "ignore_eos": False}))  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            assert list(pool.map(complete, jobs)) == reference


def test_async_scheduling_with_pipeline_parallel_is_refused() -> None:
    from services.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="--async-scheduling with --pipeline-parallel-size"):
        EngineConfig.from_kwargs(async_scheduling=True, pipeline_parallel_size=2)


def _engine_core_proc(async_scheduling: bool):
    """The scheduler process's loop object (step, _flush, _handle) without its sockets, over
    an EngineCore with the property test's simulated workers."""
    import logging
    import queue

    from services.config import CacheConfig, SchedulerConfig, ServeConfig
    from services.scheduler.engine_core import EngineCore
    from services.scheduler.metrics import EngineCoreMetrics
    from services.scheduler.service import EngineCoreProc
    from tests.test_scheduler_property import SimExecutor

    class Sent(list):
        def send(self, msg) -> None:
            self.append(msg)

    sched = SchedulerConfig(max_model_len=64, max_num_batched_tokens=64,
                            async_scheduling=async_scheduling)  # fmt: skip
    engine = EngineConfig(scheduler=sched, cache=CacheConfig(block_size=4))
    proc = EngineCoreProc.__new__(EngineCoreProc)
    proc.dp_rank, proc._early_aborts, proc._debug = 0, {}, False
    proc.core = EngineCore(engine, SimExecutor(64, 4, 1))
    proc.scheduler = proc.core.scheduler
    proc._inputs = queue.SimpleQueue()
    proc._detok, proc._kv_events, proc._state = Sent(), None, None
    proc._last_load, proc._received, proc._unsent = (0, 0), False, None
    config = ServeConfig(engine=engine, served_model_names=["m"])
    proc.metrics = EngineCoreMetrics(config, proc.scheduler, logging.getLogger(__name__))
    return proc


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_aborted_while_their_plan_runs_leave_no_metrics_state(async_scheduling) -> None:
    """Found in review: with the step's host work deferred, a request aborted while the plan
    that admitted it was in flight was recorded finished before that plan's step, and stayed
    in the metrics' table of requests awaiting their first token forever."""
    from services.protocol import Abort, TokenizedRequest

    def request(req_id: str, prompt: list[int], max_tokens: int) -> TokenizedRequest:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return TokenizedRequest(req_id=req_id, prompt_token_ids=prompt, sampling=params)

    proc = _engine_core_proc(async_scheduling)
    proc._handle(request("busy", [1, 2, 3], 30))
    proc.step()
    for i in range(10):
        proc._handle(request(f"x{i}", [5, 6, 7, 8, 9], 5))
        proc.step()  # x_i admitted; with async scheduling its plan is still out
        proc._handle(Abort([f"x{i}"]))
        proc.step()
    while proc.core.has_work():
        proc.step()
    proc._flush()
    assert proc.metrics.engine._prefilling == {}
    pool = proc.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    finished = [t for batch in proc._detok for t in batch.items if t.finish_reason]
    assert sorted(t.req_id for t in finished) == ["busy", *[f"x{i}" for i in range(10)]]
