"""Tensor and pipeline parallelism over torch.distributed (gloo on this CPU): the ranks
are real processes, and a split model must give the tokens of the whole one.

- TP=3 on the default model (9 query heads, 3 KV heads: one KV head per rank), offline
  and through the server, against HF's greedy tokens.
- TP=2 on a small random model with 4 query heads, 1 KV head (replicated on both ranks)
  and an odd vocabulary (the last rank's vocabulary slice is padded), against TP=1.
- PP=2 on the default model, even (15/15) and uneven (16/14) layer splits, against HF;
  the stages' step traces overlap (two micro-batches in flight, not alternating stages).
- TP=2 x PP=2 (4 ranks) on the small model, against TP=1.
- Sizes that do not fit the model are clear start-up errors; killing one rank under load
  ends every request with an error and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from launch.llm import LLM, SamplingParams
from services.config import ConfigError
from tests.conftest import NUM_GREEDY_TOKENS
from tests.server_utils import RemoteServer

GREEDY = SamplingParams(temperature=0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)


def _tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def _children_of_this_process() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.is_running()}


@pytest.mark.slow  # make test-slow; make test: TP=3 through the server, TP=2 offline
def test_tp3_offline_equals_hf(greedy_prompts, hf_greedy_tokens) -> None:
    before = _children_of_this_process()
    # Prompts of several lengths, the long one chunked over steps, plus a seeded sample:
    # every rank must draw the same token, or the ranks' batches would diverge.
    with LLM(
        max_model_len=512, num_gpu_blocks_override=96, tensor_parallel_size=3,
        max_num_batched_tokens=128,
    ) as llm:  # fmt: skip
        assert len(_children_of_this_process() - before) == 3
        assert _tokens(llm.generate(greedy_prompts, GREEDY)) == hf_greedy_tokens
        sampled = SamplingParams(temperature=1.0, max_tokens=8, seed=7, n=2)
        twice = [_tokens([llm.generate(greedy_prompts[0], sampled)[0]]) for _ in range(2)]
        outputs = llm.generate(greedy_prompts[0], sampled)[0].outputs
        assert twice[0] == twice[1] and outputs[0].token_ids != outputs[1].token_ids
    deadline = time.monotonic() + 10
    while _children_of_this_process() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _children_of_this_process() - before  # close() ended the ranks


def test_tp2_replicated_kv_head_and_padded_vocab_equal_tp1(small_model: Path) -> None:
    prompts = [[1, 100, 200, 300], list(range(5, 120)), [49000, 7, 7, 7, 7, 7, 7]]
    kwargs = {"model": str(small_model), "load_format": "dummy", "seed": 5, "max_model_len": 256}
    one = _tokens(LLM(**kwargs).generate(prompts, GREEDY))
    with LLM(tensor_parallel_size=2, **kwargs) as llm:
        two = _tokens(llm.generate(prompts, GREEDY))
    assert two == one
    assert len({t for seq in one for t in seq}) > 3  # random weights, yet not degenerate


def _trace(folder: Path, rank: int) -> dict[int, tuple[float, float]]:
    """Step id -> (start, end) of one rank's execution of that plan."""
    text = (folder / f"rank{rank}.json").read_text().rstrip().rstrip(",")
    events = json.loads(text + "]")
    return {int(e["name"].split()[1]): (e["ts"], e["ts"] + e["dur"]) for e in events}


@pytest.mark.parametrize(
    "partition",
    [pytest.param(None, marks=pytest.mark.slow), "16,14"],  # make test: the uneven split
    ids=["even", "uneven"],
)
def test_pp2_offline_equals_hf_with_stages_busy_at_once(
    partition, greedy_prompts, hf_greedy_tokens, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("ACTORSERVE_STEP_TRACE_DIR", str(tmp_path))  # the ranks inherit it
    with LLM(
        max_model_len=512, num_gpu_blocks_override=96, pipeline_parallel_size=2,
        pp_layer_partition=partition, max_num_batched_tokens=64,
    ) as llm:  # fmt: skip
        assert _tokens(llm.generate(greedy_prompts, GREEDY)) == hf_greedy_tokens
    first, last = _trace(tmp_path, 0), _trace(tmp_path, 1)
    assert first.keys() == last.keys() and len(first) > NUM_GREEDY_TOKENS  # both ran every plan
    # Stage 0 starts plan k+1 while stage 1 still runs plan k. With one plan at a time that
    # never happens: plan k+1 is made only after plan k's result came back from stage 1.
    ahead = [k for k in first if k + 1 in first and first[k + 1][0] < last[k][1]]
    assert len(ahead) > len(first) // 4, f"stage 0 ran ahead in {len(ahead)} of {len(first)} steps"


def test_tp2_pp2_equals_tp1(small_model: Path) -> None:
    prompts = [[1, 100, 200, 300], list(range(5, 120)), [49000, 7, 7, 7, 7, 7, 7]]
    kwargs = {"model": str(small_model), "load_format": "dummy", "seed": 5, "max_model_len": 256}
    one = _tokens(LLM(**kwargs).generate(prompts, GREEDY))
    with LLM(tensor_parallel_size=2, pipeline_parallel_size=2, **kwargs) as llm:
        assert _tokens(llm.generate(prompts, GREEDY)) == one


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tensor_parallel_size": 2}, r"attention heads \(9\) must be divisible"),
        ({"tensor_parallel_size": 0}, "at least 1"),
        ({"worker_backend": "nope"}, "--worker-backend must be one of torch"),
        ({"attention_backend": "flash"}, "--attention-backend must be one of"),
        ({"pipeline_parallel_size": 2, "pp_layer_partition": "20,20"}, "30 in all"),
        ({"pipeline_parallel_size": 2, "pp_layer_partition": "30"}, "each of the 2 stages"),
        ({"pp_layer_partition": "a,b"}, "comma-separated layer counts"),
    ],
)
def test_sizes_and_names_that_do_not_fit_are_config_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LLM(max_model_len=256, **kwargs)


def test_kv_heads_neither_split_nor_replicated_is_a_config_error(small_model: Path) -> None:
    config = json.loads((small_model / "config.json").read_text())
    from services.config import EngineConfig, ModelArchConfig

    arch = ModelArchConfig.from_hf_config(
        {**config, "num_attention_heads": 6, "num_key_value_heads": 4}
    )
    engine = EngineConfig.from_kwargs(tensor_parallel_size=3, device="cpu")
    with pytest.raises(ConfigError, match="4 KV heads can be neither split over nor replicated"):
        engine.finalize(arch)


@pytest.fixture(scope="module")
def tp3_server() -> RemoteServer:
    with RemoteServer("-tp", "3") as s:
        yield s.wait_ready()


def test_tp3_server_equals_hf(tp3_server: RemoteServer, greedy_prompts, hf_greedy_tokens) -> None:
    client = openai.OpenAI(base_url=f"{tp3_server.url}/v1", api_key="x", max_retries=0, timeout=120)
    out = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=greedy_prompts[:4],
        max_tokens=NUM_GREEDY_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    got = [c.token_ids for c in sorted(out.choices, key=lambda c: c.index)]  # type: ignore[attr-defined]
    assert got == hf_greedy_tokens[:4]
    workers = [p for p in tp3_server.processes() if "worker" in " ".join(p.cmdline())]
    assert len(workers) == 3


def test_kill9_one_rank_fails_requests_and_leaves_nothing(tp3_server: RemoteServer) -> None:
    """Runs after the test above (same module server): kill rank 1 mid-generation."""
    import threading

    client = openai.OpenAI(base_url=f"{tp3_server.url}/v1", api_key="x", max_retries=0, timeout=60)
    errors: list[BaseException | None] = []

    def one() -> None:
        try:
            client.completions.create(
                model="SmolLM2-135M-Instruct", prompt="Count to a thousand:", max_tokens=400,
                temperature=0, extra_body={"ignore_eos": True},
            )  # fmt: skip
            errors.append(None)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(3)  # generating
    rank1 = next(p for p in tp3_server.processes() if p.cmdline()[-3:-1] == ["worker", "1"])
    os.kill(rank1.pid, signal.SIGKILL)
    start = time.monotonic()
    for t in threads:
        t.join(timeout=60)
    assert time.monotonic() - start < 30
    assert len(errors) == 4 and all(e is not None for e in errors), errors
    assert tp3_server.wait_exit(30) not in (None, 0)
    assert tp3_server.wait_all_gone(15) == []
    assert "worker rank 1 process died" in tp3_server.log


def test_offline_rank_death_is_an_error_not_a_hang(small_model: Path) -> None:
    import threading

    from services.scheduler.executor import WorkerDied

    kwargs = {"model": str(small_model), "load_format": "dummy", "max_model_len": 512}
    with LLM(tensor_parallel_size=2, **kwargs) as llm:
        ranks = [p for p in psutil.Process().children() if p.cmdline()[-3:-1] == ["worker", "1"]]
        assert len(ranks) == 1
        threading.Timer(0.5, lambda: os.kill(ranks[0].pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(WorkerDied, match="worker rank 1 process exited with code -9"):
            llm.generate([[1, 2, 3]] * 8, SamplingParams(max_tokens=500, ignore_eos=True))
        assert time.monotonic() - start < 30


@pytest.mark.slow
def test_restart_on_failure_brings_every_rank_back(small_model: Path) -> None:
    """--restart-on-failure with two ranks: kill rank 1 and both ranks start again (at a new
    rendezvous port), the server answers as before, SIGTERM then ends every process."""
    args = ("--model", str(small_model), "--load-format", "dummy", "-tp", "2",
            "--max-model-len", "512", "--restart-on-failure")  # fmt: skip
    with RemoteServer(*args) as server:
        server.wait_ready()

        def ranks() -> dict[str, int]:
            return {p.cmdline()[-2]: p.pid for p in server.processes()
                    if p.cmdline()[-3:-2] == ["worker"]}  # fmt: skip

        body = {"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        want = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        before = ranks()
        os.kill(before["1"], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while "the engine restarted in" not in server.log:
            assert time.monotonic() < deadline and server.popen.poll() is None, server.log
            time.sleep(0.2)
        after = ranks()
        assert set(after) == {"0", "1"} and not set(after.values()) & set(before.values())
        got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        server.popen.send_signal(signal.SIGTERM)
        assert server.wait_exit(60) == 0, server.log
        assert server.wait_all_gone(10) == []
