"""``--async-scheduling`` (overlap): the scheduler plans step N+1 while step N runs and the
worker feeds N's sampled tokens into N+1. Outputs must not change: the same greedy (and
seeded) tokens as without it, offline and through the server, on the real torch backend."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from services.engine import LLM, SamplingParams
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
