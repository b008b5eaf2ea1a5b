"""The simulated backend's mixture-of-experts terms (issue 33): active parameters, the
experts a step reaches, expert parallelism's dispatch and combine, engines in lock-step
(the slowest sets the pace, an engine without tokens waits as long), and the shipped
``qwen3-30b-a3b`` and ``deepseek-v3`` configs (DeepSeek's MLA, shared expert, fp8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.config import EngineConfig
from services.flags import ConfigError
from services.gpu_worker.distributed import rank_state
from services.gpu_worker.sim.cost_model import (
    RequestWork,
    SimHardware,
    StepCostModel,
    StepProfile,
)
from services.gpu_worker.sim.model_shape import load_sim_model
from services.gpu_worker.sim.worker import SimWorker
from services.model_arch import ModelArchConfig
from services.model_loader import load_hf_config, prepare_model
from services.model_loader.sim_model import (
    SIM_ARCHITECTURE_KEY,
    sim_config_path,
    sim_model_folder,
)
from services.protocol import SamplingParams
from services.request import Request
from services.scheduler.scheduler import Scheduler

TERA = 1e12
# A made-up MoE model with round numbers: 2 layers, 64 experts, top-4.
MOE = ModelArchConfig.from_hf_config({
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 1000, "hidden_size": 1024,
    "intermediate_size": 4096, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "num_experts": 64, "num_experts_per_tok": 4, "moe_intermediate_size": 512,
})  # fmt: skip


def _device(tmp_path: Path, **extra: float) -> SimHardware:
    raw = {
        "name": "round", "peak_flops": {"bf16": 100 * TERA, "fp8": 200 * TERA},
        "memory_bandwidth": 1 * TERA, "memory_capacity": 100e9,
        "interconnect_bandwidth": 0.1 * TERA, "interconnect_latency_s": 1e-5,
        "step_overhead_s": 1e-4, **extra,
    }  # fmt: skip
    path = tmp_path / "round.json"
    path.write_text(json.dumps(raw))
    return SimHardware.load(str(path))


def _shipped(name: str) -> tuple[ModelArchConfig, object]:
    return load_sim_model(json.loads(sim_config_path(name).read_text()))


# ---- the cost model's MoE terms


def test_flops_per_token_are_the_active_parameters(tmp_path: Path) -> None:
    """A long prefill on a device with all the bandwidth in the world is its FLOPs: 2 per
    active parameter and token (attention projections, router, the top-4 experts), the LM
    head apart (it runs on the sampled token only)."""
    device = _device(tmp_path, memory_bandwidth=1e21, interconnect_bandwidth=1e21)
    model = StepCostModel(MOE, device)
    attn = 1024 * (8 + 2 * 2) * 128 + 8 * 128 * 1024
    per_layer = attn + 1024 * 64 + 4 * 3 * 1024 * 512
    assert model.active_params() == 2 * per_layer + 1000 * 1024
    t = 2048
    cost = model.step_cost([RequestWork(t, 0, False)])
    assert cost.linear + cost.experts == pytest.approx(2 * t * 2 * per_layer / (100 * TERA))


def test_shipped_models_have_their_published_sizes() -> None:
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active; DeepSeek-V3: 671B, 37B active (both
    with the embedding, which ``active_params`` leaves out: a lookup)."""
    h200 = SimHardware.load("h200")
    arch, extras = _shipped("qwen3-30b-a3b")
    qwen = StepCostModel(arch, h200, extras=extras)  # type: ignore[arg-type]
    embedding = arch.vocab_size * arch.hidden_size
    assert qwen.active_params() + embedding == pytest.approx(3.3e9, rel=0.03)
    assert qwen.weight_bytes(0) / 2 == pytest.approx(30.5e9, rel=0.01)
    arch, extras = _shipped("deepseek-v3")
    ds = StepCostModel(arch, h200, extras=extras)  # type: ignore[arg-type]
    embedding = arch.vocab_size * arch.hidden_size
    assert ds.active_params() + embedding == pytest.approx(37e9, rel=0.03)
    # fp8 linear weights (1 byte), the embedding, LM head and router in bf16
    tables = 2 * embedding + 58 * arch.hidden_size * arch.num_experts
    assert ds.weight_bytes(0) - tables == pytest.approx(671e9, rel=0.01)


def test_distinct_experts_hit_grow_with_the_batch_and_saturate(tmp_path: Path) -> None:
    model = StepCostModel(MOE, _device(tmp_path))
    hits = [model.experts_hit(b) for b in (1, 2, 8, 32, 128, 1024)]
    assert hits[0] == pytest.approx(4)  # one token reaches its top-4
    assert hits == sorted(hits) and hits[-1] == pytest.approx(64, rel=1e-6)
    assert model.experts_hit(16) == pytest.approx(64 * (1 - (1 - 4 / 64) ** 16))
    ep = StepCostModel(MOE, _device(tmp_path), expert_parallel_size=8, data_parallel_size=8)
    assert ep.local_experts == 8
    assert ep.experts_hit(16) == pytest.approx(model.experts_hit(16) / 8)
    # A decode step's experts are bandwidth-bound: the weights of the experts hit.
    params = 3 * 1024 * 512
    assert model.expert_time(1) == pytest.approx(
        (4 * params * 2 + 4 * (2 * 1024 + 3 * 512) * 2) / TERA
    )


def test_tensor_parallel_moe_splits_every_expert_and_all_reduces(tmp_path: Path) -> None:
    one = StepCostModel(MOE, _device(tmp_path))
    tp2 = StepCostModel(MOE, _device(tmp_path), tensor_parallel_size=2)
    assert tp2.local_experts == 64 and tp2.expert_width == 256
    assert tp2.layer_weight_bytes(0) < one.layer_weight_bytes(0)
    work = [RequestWork(1, 100, True)] * 16
    cost = tp2.step_cost(work)
    assert cost.dispatch == 0 and cost.all_reduce == pytest.approx(2 * 2 * tp2.all_reduce_time(16))
    assert cost.experts == pytest.approx(one.step_cost(work).experts / 2, rel=0.05)


def test_dispatch_and_combine_bytes_scale_with_dp_minus_one_over_dp(tmp_path: Path) -> None:
    """An all-gather and a reduce-scatter of N hidden states each move (dp-1)/dp of them
    through every rank's link, with dp-1 hops of latency each."""
    device = _device(tmp_path, interconnect_latency_s=0.0)
    nbytes = 1000 * 1024 * 2
    for dp in (2, 4, 8):
        model = StepCostModel(MOE, device, expert_parallel_size=dp, data_parallel_size=dp)
        assert model.dispatch_time(1000) == pytest.approx(2 * (dp - 1) / dp * nbytes / (0.1 * TERA))
    lat = StepCostModel(MOE, _device(tmp_path), expert_parallel_size=8, data_parallel_size=8)
    assert lat.dispatch_time(1) == pytest.approx(2 * 7 * 1e-5, rel=0.01)
    assert StepCostModel(MOE, device).dispatch_time(1000) == 0.0  # no engines to reach


def test_lockstep_step_is_the_slowest_engines(tmp_path: Path) -> None:
    """A lock-step step: the slowest engine's attention and dense part, then the experts
    over every engine's tokens and their dispatch. Each engine knows only the others'
    counts and takes them for the least work a count can be, so the slowest engine
    computes the longest step, and that is the step (the others' are at most as long)."""
    model = StepCostModel(MOE, _device(tmp_path), expert_parallel_size=4, data_parallel_size=4)
    counts = (30, 5, 0, 12)
    work = {d: [RequestWork(1, 500, True)] * n for d, n in enumerate(counts)}
    work[3] = [RequestWork(12, 2000, True)]  # a prefill chunk after a long prefix
    alone = {d: model._local_cost(model.profile(w)).total for d, w in work.items()}
    for d, n in enumerate(counts):  # the estimate of an engine from its count: a lower bound
        assert model._local_cost(StepProfile(n)).total <= alone[d]
    # 2 MoE layers; 47 tokens in all
    want = max(alone.values()) + 2 * model.expert_time(47) + 2 * model.dispatch_time(47) + 1e-4
    steps = {d: model.step_cost(work[d], counts, d) for d in range(4)}
    assert max(c.total for c in steps.values()) == pytest.approx(want, rel=1e-9)
    slowest = max(alone, key=alone.__getitem__)
    assert steps[slowest].total == pytest.approx(want, rel=1e-9) and steps[slowest].wait == 0
    for d in range(4):
        assert steps[d].total <= want * (1 + 1e-9)
        # waiting for the others is counted as such, never as this engine's own work
        assert steps[d].total - steps[d].wait == pytest.approx(
            alone[d] + 2 * model.expert_time(47) + 2 * model.dispatch_time(47) + 1e-4, rel=1e-9
        )
    # An engine without tokens (dummy) runs the experts' collectives for the others.
    assert 0 < steps[2].total <= want and steps[2].experts == steps[0].experts
    # Without lock-step the experts take this engine's tokens only, and nothing is sent.
    assert model.step_cost(work[0]).experts == pytest.approx(2 * model.expert_time(30))


# ---- the sim worker's lock-step hooks


def _engines(model: str, dp: int) -> list[tuple[Scheduler, SimWorker]]:
    config = EngineConfig.from_kwargs(
        worker_backend="sim", sim_model=model, sim_hardware="h200", sim_speed=1e-9,
        data_parallel_size=dp, enable_expert_parallel=True, max_num_batched_tokens=2048,
    )  # fmt: skip
    folder = sim_model_folder(model, prepare_model(None))
    arch, _ = load_sim_model(load_hf_config(folder))
    config.finalize(arch)
    out = []
    for d in range(dp):
        state = rank_state(config.parallel, 0, arch.num_hidden_layers, dp_rank=d)
        worker = SimWorker(config, folder, state)
        out.append((Scheduler(config.scheduler, config.cache, 4096), worker))
    return out


def _add(scheduler: Scheduler, req_id: str, prompt_len: int) -> None:
    prompt = [100 + (7 * i) % 5000 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    scheduler.add_request(Request(req_id, prompt, params))


def test_sim_worker_lockstep_and_dummy_steps() -> None:
    engines = _engines("qwen3-30b-a3b", 4)
    _add(engines[0][0], "big", 1024)
    _add(engines[1][0], "small", 16)
    plans = [s.schedule() if s.has_unfinished_requests() else None for s, _ in engines]
    counts = tuple(p.total_num_scheduled_tokens if p else 0 for p in plans)
    assert counts == (1024, 16, 0, 0)
    for (_, w), plan in zip(engines, plans, strict=True):
        w.begin_dp_step(counts)
        if plan is not None:
            result = w.execute(plan)
            assert len(result.req_ids) == 1  # each prompt ends here: one token sampled
        else:
            w.execute_dummy()
    big, small, idle, idle2 = (w for _, w in engines)
    cost = big.cost.step_cost([RequestWork(1024, 0, True)], counts, 0)
    assert big.last_step_s == pytest.approx(cost.total)
    assert big.cost.dispatch_time(1040) > 0 and cost.dispatch == pytest.approx(
        48 * big.cost.dispatch_time(1040)
    )
    # The small engine waits for the big one in the MoE layers: it counts the wait as
    # such, and its own step is at most the big one's.
    small_work = [RequestWork(16, 0, True)]
    assert small.last_cost == small.cost.step_cost(small_work, counts, 1)
    assert small.last_step_s <= big.last_step_s
    assert small.last_cost.wait > 0 and small.last_cost.experts == cost.experts
    # Idle engines spend the step in the MoE layers' collectives: their device is busy.
    assert 0 < idle.last_step_s <= big.last_step_s and idle.modelled_s == idle.last_step_s
    assert idle2.last_step_s == idle.last_step_s
    # Nobody has tokens: a dummy step takes no time.
    before = idle.modelled_s
    idle.begin_dp_step((0, 0, 0, 0))
    idle.execute_dummy()
    assert idle.modelled_s == before
    with pytest.raises(ValueError, match="4 engines"):
        idle.begin_dp_step((1, 2))


# ---- the shipped configs


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "deepseek-v3"])
def test_sim_configs_load_and_validate(model: str) -> None:
    folder = sim_model_folder(model, prepare_model(None))
    arch = ModelArchConfig.from_hf_config(load_hf_config(folder))  # what every process reads
    assert arch.is_moe and arch.num_experts_per_tok == 8
    for layout in (
        {"tensor_parallel_size": 8},
        {"data_parallel_size": 8, "enable_expert_parallel": True},
        {"tensor_parallel_size": 2, "data_parallel_size": 4, "enable_expert_parallel": True},
    ):
        config = EngineConfig.from_kwargs(worker_backend="sim", sim_model=model, **layout)
        config.finalize(arch)
        state = rank_state(config.parallel, 0, arch.num_hidden_layers)
        worker = SimWorker(config, folder, state)
        assert worker.cost.ep == config.parallel.expert_parallel_size
        assert worker.determine_num_blocks() > 0
    # Expert counts that the EP size does not divide are refused before anything starts.
    config = EngineConfig.from_kwargs(
        worker_backend="sim", sim_model=model, data_parallel_size=3, enable_expert_parallel=True
    )
    with pytest.raises(ConfigError, match="cannot be split evenly"):
        config.finalize(arch)


def test_deepseek_is_modelled_with_mla_and_refused_by_the_real_worker() -> None:
    raw = json.loads(sim_config_path("deepseek-v3").read_text())
    # The real worker (and the launcher before it) refuses the architecture it cannot run.
    with pytest.raises(ConfigError, match="unsupported model architecture 'DeepseekV3ForCausalLM'"):
        ModelArchConfig.from_hf_config(raw)
    with pytest.raises(ConfigError, match="for --worker-backend sim"):
        EngineConfig.from_kwargs(worker_backend="torch", sim_model="deepseek-v3")
    folder = sim_model_folder("deepseek-v3", prepare_model(None))
    mapped = load_hf_config(folder)
    assert mapped[SIM_ARCHITECTURE_KEY] == "DeepseekV3ForCausalLM"
    arch, extras = load_sim_model(mapped)
    assert [i for i in range(61) if not arch.is_moe_layer(i)] == [0, 1, 2]
    assert extras.mla is not None and extras.shared_expert_intermediate_size == 2048
    assert extras.weight_dtype == "fp8"
    h200 = SimHardware.load("h200")
    tp8 = StepCostModel(arch, h200, tensor_parallel_size=8, extras=extras)
    one = StepCostModel(arch, h200, extras=extras)
    # MLA's KV cache: one row of 512 + 64 values a token and layer, whole on every TP rank.
    assert tp8.kv_bytes_per_token(0) == one.kv_bytes_per_token(0) == 61 * 576 * 2
    # Decode attention runs absorbed (544 per pair and head as GQA), a prefill expanded (160,
    # plus the up-projection of its context).
    decode = tp8._attention_terms([RequestWork(1, 4096, True)])[0]
    assert decode == 16 * 2176 * (4096 + 1)
    prefill = tp8._attention_terms([RequestWork(4096, 0, True)])[0]
    assert prefill == 16 * 640 * (4096 * 4097 // 2) + 4096 * 2 * 512 * 16 * 256
    # fp8 experts and projections: a byte a weight, GEMMs at the fp8 peak.
    assert tp8.weight_bytes_per_param == 1
    assert tp8.linear_peak == pytest.approx(2 * tp8.peak, rel=0.01)
