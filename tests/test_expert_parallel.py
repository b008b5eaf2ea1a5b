"""Expert parallelism (``--enable-expert-parallel``) against one rank and HF transformers.

- ``ExpertDispatch`` on its own: two gloo ranks as two data-parallel engines (EP=2), each
  with its own tokens (one of them none: the dummy forward), hold half the experts each;
  every rank's output must equal one rank's ``SparseMoeBlock`` with every expert on its
  own tokens, and every rank's count of the routing the whole step's.
- Offline, TP=2 with EP (each rank whole experts; attention TP-split): HF's greedy tokens.
- Served, ``-dp 2 --enable-expert-parallel`` (EP=2 over two engine cores stepping in
  lock-step): HF's greedy tokens from either engine, with the other engine idle, and from
  both at once; the expert-load metric; a killed worker of one engine ends every
  request with an error and stops the server (no rank hangs in a collective).
- Bad layouts are start-up errors: experts not divisible by TP x DP, a dense model,
  pipeline parallelism.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import openai
import pytest
import torch

from launch.llm import LLM, SamplingParams
from services.config import ConfigError, EngineConfig, ModelArchConfig
from services.gpu_worker.distributed import SINGLE_RANK, ParallelState
from services.gpu_worker.model.expert_dispatch import ExpertDispatch
from services.gpu_worker.model.moe import SparseMoeBlock
from services.model_loader import load_hf_config, prepare_model
from tests.server_utils import RemoteServer, free_port, metric
from tests.test_moe_model import NUM_NEW, VOCAB, _hf_config, _hf_model, _save, greedy_with_cache
from tests.test_server_faults import StreamInThread

# ---------------------------------------------------------------- the dispatch alone

CASES = [(3, 5), (0, 4), (6, 0), (1, 1)]  # each engine's tokens in one step


def _arch() -> ModelArchConfig:
    cfg = _hf_config("qwen3_moe").to_dict()
    cfg["architectures"] = ["Qwen3MoeForCausalLM"]
    return ModelArchConfig.from_hf_config(cfg)


def _full_block(arch: ModelArchConfig) -> SparseMoeBlock:
    torch.manual_seed(0)
    block = SparseMoeBlock(arch, SINGLE_RANK)
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 1.0)
        block.w13.normal_(0.0, 0.2)
        block.w2.normal_(0.0, 0.2)
    return block


def _dispatch_rank(rank: int, port: int, out: str, backend: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    parallel = ParallelState(ep_rank=rank, ep_size=2, dp_rank=rank, dp_size=2,
                             dp_group=dist.new_group([0, 1]), ep_group=dist.group.WORLD,
                             all2all_backend=backend)  # fmt: skip
    arch = _arch()
    full = _full_block(arch)
    dispatch = ExpertDispatch(parallel, arch.num_experts)
    block = SparseMoeBlock(arch, parallel, dispatch)
    half = arch.num_experts // 2
    with torch.no_grad():
        block.gate.weight.copy_(full.gate.weight)
        block.w13.copy_(full.w13[rank * half : (rank + 1) * half])
        block.w2.copy_(full.w2[rank * half : (rank + 1) * half])
    results = []
    with torch.inference_mode():
        for case in CASES:
            x_all = torch.randn(
                sum(case), arch.hidden_size, generator=torch.Generator().manual_seed(7)
            )
            start = sum(case[:rank])
            x = x_all[start : start + case[rank]]
            dispatch.begin_step(case)
            if case[rank]:
                y = block(x)
            else:
                dispatch.dummy_forward([block], arch.hidden_size, x.dtype, x.device)
                y = x
            _, ids = full.route(x_all)
            want_load = torch.bincount(ids.flatten(), minlength=8)
            if backend == "all_to_all":  # a rank counts the pairs its own experts received
                want_load[torch.arange(8) // half != rank] = 0
            results.append({"y": y, "want": full(x), "load": dispatch.take_load(),
                            "want_load": want_load.tolist()})  # fmt: skip
    torch.save(results, out)
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["allgather_reducescatter", "all_to_all"])
def test_dispatch_over_two_engines_equals_one_rank(backend, tmp_path) -> None:
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    paths = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    procs = [
        ctx.Process(target=_dispatch_rank, args=(r, port, paths[r], backend)) for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    for rank, path in enumerate(paths):
        for case, got in zip(CASES, torch.load(path), strict=True):
            assert got["y"].shape == (case[rank], 64)
            torch.testing.assert_close(got["y"], got["want"], rtol=1e-5, atol=1e-5)
            assert got["load"] == got["want_load"]


# ---------------------------------------------------------------- whole engines


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(HF folder of the small Qwen3-MoE, prompts, HF's greedy continuations)."""
    model = _hf_model("qwen3_moe")
    folder = _save("qwen3_moe", model, tmp_path_factory.mktemp("qwen3_moe_ep"))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 23, 40, 71)]
    return folder, prompts, [greedy_with_cache(model, p) for p in prompts]


@pytest.mark.parametrize("backend", ["allgather_reducescatter", "all_to_all"])
def test_tp2_with_expert_parallel_equals_hf(backend, moe_model) -> None:
    """EP=2 over the TP ranks; with all_to_all each rank sends its half of the tokens."""
    folder, prompts, greedy = moe_model
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    with LLM(
        str(folder), max_model_len=256, num_gpu_blocks_override=64, tensor_parallel_size=2,
        enable_expert_parallel=True, max_num_batched_tokens=64, all2all_backend=backend,
    ) as llm:  # fmt: skip
        assert [r.outputs[0].token_ids for r in llm.generate(prompts, params)] == greedy


def _complete(url: str, prompt: list[int], engine: str | None = None) -> list[int]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    out = client.completions.create(
        model="moe", prompt=prompt, max_tokens=NUM_NEW, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        extra_headers={"X-data-parallel-rank": engine} if engine is not None else None,
    )  # fmt: skip
    return list(out.choices[0].token_ids)  # type: ignore[attr-defined]


def _ep_server(folder: Path, *extra: str) -> RemoteServer:
    return RemoteServer(
        "--model", str(folder), "--served-model-name", "moe", "-dp", "2", *extra,
        "--enable-expert-parallel", "--max-num-batched-tokens", "64", "--max-model-len", "256",
        env={"ACTORSERVE_EXPERT_LOAD_INTERVAL_S": "0"},
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["allgather_reducescatter", "all_to_all"])
def test_dp2_expert_parallel_serves_hf_tokens_with_an_idle_engine(backend, moe_model) -> None:
    folder, prompts, greedy = moe_model
    with _ep_server(folder, "--all2all-backend", backend) as server:
        server.wait_ready()
        # One engine at a time: the other runs dummy forwards through the MoE layers.
        for engine in ("0", "1"):
            assert _complete(server.url, prompts[0], engine) == greedy[0]
        # Both engines at once, with different token counts each step.
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda i: _complete(server.url, prompts[i], str(i % 2)), range(4)))
        assert got == greedy
        routed = {
            rank: metric(server, "actorserve:expert_tokens_total", ep_rank=str(rank))
            for rank in (0, 1)
        }
        assert all(v is not None and v > 0 for v in routed.values()), routed
        per_rank = "an even share" if backend == "all_to_all" else "imbalance (max / mean)"
        assert "expert load over" in server.log and per_rank in server.log


@pytest.mark.slow  # make test-slow; make test: DP=2 and TP=2 with EP each
def test_dp2_tp2_expert_parallel_is_ep4(moe_model) -> None:
    """Four ranks, two experts each; attention TP-split within each engine core."""
    folder, prompts, greedy = moe_model
    with _ep_server(folder, "-tp", "2") as server:
        server.wait_ready()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda i: _complete(server.url, prompts[i], str(i % 2)), range(4)))
        assert got == greedy
        for rank in range(4):
            assert metric(server, "actorserve:expert_tokens_total", ep_rank=str(rank))


def test_dp2_expert_parallel_dead_engine_fails_every_request(moe_model) -> None:
    folder, prompts, _ = moe_model
    with _ep_server(folder) as server:
        server.wait_ready()
        # Token ids: the test tokenizer's text ids lie past this small model's vocabulary.
        streams = [StreamInThread(server.url, prompts[i], 200, model="moe") for i in range(2)]  # type: ignore[arg-type]
        for s in streams:
            assert s.first.wait(120), server.log
        worker = next(
            p for p in server.processes()
            if "worker" in p.cmdline() and p.cmdline()[-1] == "1"
        )  # fmt: skip
        killed_at = time.monotonic()
        os.kill(worker.pid, signal.SIGKILL)
        for s in streams:
            s.join(60)
            assert isinstance(s.error, openai.APIError), repr(s.error)
            assert s.ended_at is not None and s.ended_at - killed_at < 30
        assert server.wait_exit(60) not in (None, 0), server.log


# ---------------------------------------------------------------- bad layouts


def _config_dir(tmp_path: Path, **overrides: object) -> Path:
    cfg = _hf_config("qwen3_moe").to_dict()
    cfg.update(architectures=["Qwen3MoeForCausalLM"], **overrides)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"data_parallel_size": 3}, r"8 experts cannot be split evenly over the 3 expert"),
        ({"tensor_parallel_size": 2, "data_parallel_size": 3}, r"over the 6 expert-parallel"),
        ({"pipeline_parallel_size": 2}, r"--pipeline-parallel-size > 1 is not supported"),
    ],
)
def test_bad_expert_parallel_layouts(kwargs, message, tmp_path) -> None:
    arch = ModelArchConfig.from_hf_config(load_hf_config(_config_dir(tmp_path)))
    with pytest.raises(ConfigError, match=message):
        config = EngineConfig.from_kwargs(
            enable_expert_parallel=True, load_format="dummy", **kwargs
        )
        config.finalize(arch)


def test_expert_parallel_needs_a_moe_model() -> None:
    arch = ModelArchConfig.from_hf_config(load_hf_config(prepare_model(None)))
    config = EngineConfig.from_kwargs(enable_expert_parallel=True)
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model; LlamaForCausalLM"):
        config.finalize(arch)


def test_expert_parallel_holds_whole_experts(tmp_path) -> None:
    """EP does not cut the experts' width: a width TP could not split is fine."""
    arch = ModelArchConfig.from_hf_config(
        load_hf_config(_config_dir(tmp_path, moe_intermediate_size=30))
    )
    config = EngineConfig.from_kwargs(
        enable_expert_parallel=True, tensor_parallel_size=4, load_format="dummy"
    )
    config.finalize(arch)
    assert config.parallel.expert_parallel_size == 4
