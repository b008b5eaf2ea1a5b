"""``--worker-backend sim``: the roofline against hand arithmetic, the KV pool against the
device's memory, and a simulated server that serves a load like the real one."""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

import httpx
import pytest

from services.flags import ConfigError
from services.gpu_worker.sim.cost_model import RequestWork, SimHardware, StepCostModel
from services.gpu_worker.sim.worker import OutputLengths
from services.model_arch import ModelArchConfig
from services.model_loader.sim_model import sim_config_path
from tests.server_utils import RemoteServer, metric, wait_metric

MODEL = "llama-3-8b"

# A made-up model and device with round numbers, so each term is easy to check by hand.
ARCH = ModelArchConfig.from_hf_config({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 1024,
    "intermediate_size": 4096, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
})  # fmt: skip
TERA = 1e12


@pytest.fixture
def device(tmp_path: Path) -> SimHardware:
    path = tmp_path / "round.json"
    path.write_text(json.dumps({
        "name": "round", "peak_flops": {"bf16": 100 * TERA}, "memory_bandwidth": 1 * TERA,
        "memory_capacity": 10e9, "interconnect_bandwidth": 0.1 * TERA,
        "interconnect_latency_s": 1e-5, "step_overhead_s": 1e-4,
    }))  # fmt: skip
    return SimHardware.load(str(path))


def test_a_decode_step_is_the_weights_over_the_bandwidth(device: SimHardware) -> None:
    """One request decoding at context 100: every GEMM is bandwidth-bound (2 flops per
    weight, 100 flops per byte would be needed), attention reads the context's KV."""
    model = StepCostModel(ARCH, device)
    # (in, out) of QKV (8 + 2*2 heads of 128), O, gate/up, down; bf16 = 2 bytes
    gemms = [(1024, 1536), (1024, 1024), (1024, 8192), (4096, 1024)]
    linear = sum((i * o + (i + o)) * 2 for i, o in gemms) / TERA
    # K and V of 2 heads x 128 for 101 tokens, plus the query and output of 8 heads
    attention = (2 * 2 * 101 + 2 * 8 * 1) * 128 * 2 / TERA
    lm_head = (1024 * 1000 + 1024 + 1000) * 2 / TERA
    want = 2 * (linear + attention) + lm_head + 1e-4
    got = model.step_time([RequestWork(1, 100, True)])
    assert got == pytest.approx(want, rel=1e-9)


def test_a_long_prefill_is_compute_bound_and_attention_is_causal(device: SimHardware) -> None:
    model = StepCostModel(ARCH, device)
    t = 2048
    params = 1024 * 1536 + 1024 * 1024 + 1024 * 8192 + 4096 * 1024
    linear = 2 * t * params / (100 * TERA)  # 2 flops per weight and token
    # each of the 2048 tokens attends to itself and those before: 2048 * 2049 / 2 pairs,
    # 4 flops per pair, head dim and query head
    attention = 4 * 8 * 128 * (2048 * 2049 // 2) / (100 * TERA)
    cost = model.step_cost([RequestWork(t, 0, False)])
    assert cost.linear == pytest.approx(2 * linear, rel=1e-9)
    assert cost.attention == pytest.approx(2 * attention, rel=1e-9)
    assert cost.lm_head == 0  # a partial prefill chunk samples nothing


def test_tensor_and_pipeline_parallel_add_their_communication(device: SimHardware) -> None:
    one = StepCostModel(ARCH, device)
    tp2 = StepCostModel(ARCH, device, tensor_parallel_size=2)
    pp2 = StepCostModel(ARCH, device, stage_layers=[1, 1])
    work = [RequestWork(64, 0, True)]
    # a ring all-reduce of 64 hidden states of 2 bytes over 2 ranks: 2*(2-1)/2 of the bytes
    all_reduce = 64 * 1024 * 2 / (0.1 * TERA) + 2 * 1e-5
    assert tp2.step_cost(work).all_reduce == pytest.approx(2 * 2 * all_reduce, rel=1e-9)
    assert tp2.step_cost(work).linear < one.step_cost(work).linear  # half the weights each
    hand_off = 2 * 64 * 1024 * 2 / (0.1 * TERA) + 1e-5  # hidden states and residuals
    assert pp2.step_cost(work).hand_off == pytest.approx(hand_off, rel=1e-9)
    assert pp2.step_time(work) == pytest.approx(one.step_time(work) + hand_off, rel=1e-9)


def test_llama3_8b_decode_floor_on_h200() -> None:
    """The bandwidth floor: a decode step reads Llama-3-8B's bf16 weights but the embedding
    table (of which it reads a row per token): 16.06 - 1.05 = 15.01 GB, at the H200's
    4.8 TB/s 3.13 ms; at the shipped efficiency (80 %) 3.91 ms, plus 0.2 ms per step."""
    arch = ModelArchConfig.from_hf_config(json.loads(sim_config_path("llama-3-8b").read_text()))
    h200 = SimHardware.load("h200")
    model = StepCostModel(arch, h200)
    assert model.weight_bytes(0) == pytest.approx(16.06e9, rel=0.001)
    step = model.step_time([RequestWork(1, 512, True)])
    embedding = 128256 * 4096 * 2
    assert step == pytest.approx((16.06e9 - embedding) / (4.8e12 * 0.8) + 2e-4, rel=0.01)


def test_bad_hardware_and_lengths_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither a shipped device"):
        SimHardware.load("h900")
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({"name": "x", "peak_flops": {}, "memory_bandwidth": 1, "memory_capacity": 1})
    )
    with pytest.raises(ConfigError, match="needs peak_flops"):
        SimHardware.load(str(bad))
    for spec in ("exp:-1", "normal:3", "uniform:9,2"):
        with pytest.raises(ConfigError, match="--sim-eos"):
            OutputLengths(spec)
    lengths = OutputLengths("uniform:10,20")
    assert all(10 <= lengths.sample(k) <= 20 for k in range(100))
    assert lengths.sample(7) == OutputLengths("uniform:10,20").sample(7)  # per-request stream


def test_kv_pool_is_what_the_simulated_device_holds() -> None:
    """Llama-3-8B on an H200 at --gpu-memory-utilization 0.92 (vLLM's default): 141 GB x 0.92, less 16.06 GB of
    weights and the activations of a 2048-token step, in blocks of 16 tokens x 32 layers x
    8 KV heads x 128 x 2 (K and V) x 2 bytes = 2 MiB."""
    from services.config import EngineConfig
    from services.gpu_worker.distributed import ParallelState
    from services.gpu_worker.sim.worker import SimWorker
    from services.model_loader import prepare_model
    from services.model_loader.sim_model import sim_model_folder

    config = EngineConfig.from_kwargs(worker_backend="sim", sim_model=MODEL)
    config.scheduler.max_num_batched_tokens = 2048
    worker = SimWorker(config, sim_model_folder(MODEL, prepare_model(None)), ParallelState())
    activations = 2048 * (4 * 4096 + 3 * 14336) * 2
    budget = 141e9 * 0.92 - 16.06e9 - activations
    assert worker.determine_num_blocks() == pytest.approx(budget / 2**21, rel=0.001)


# ---- a simulated server under load


@pytest.fixture(scope="module")
def sim_server():
    # A small pool (128 MiB: 64 blocks of 16 tokens) so that the load also preempts.
    with RemoteServer(
        "--worker-backend", "sim", "--sim-model", MODEL, "--sim-hardware", "h200",
        "--sim-eos", "exp:24", "--kv-cache-memory-bytes", "128MiB", "--max-model-len", "512",
    ) as server:  # fmt: skip
        yield server.wait_ready()


def _complete(url: str, prompt: list[int], **params: object) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "return_token_ids": True}
    r = httpx.post(f"{url}/v1/completions", json={**body, **params}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]  # type: ignore[no-any-return]


def test_200_requests_at_a_fixed_rate_are_all_served(sim_server: RemoteServer) -> None:
    rate = 40.0  # requests per second
    prompts = [[100 + (7 * i + j) % 5000 for j in range(20 + (37 * i) % 300)] for i in range(200)]
    before = metric(sim_server, "vllm:request_success_total") or 0.0
    start = time.monotonic()

    def send(i: int) -> dict:
        time.sleep(max(0.0, start + i / rate - time.monotonic()))
        return _complete(sim_server.url, prompts[i], temperature=0)

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        choices = list(pool.map(send, range(200)))
    reasons = [c["finish_reason"] for c in choices]
    assert set(reasons) == {"stop", "length"}  # --sim-eos ends some before max_tokens
    assert all(len(c["token_ids"]) <= 32 for c in choices)
    assert all(len(c["token_ids"]) == 32 for c in choices if c["finish_reason"] == "length")
    assert wait_metric(sim_server, "vllm:request_success_total", before + 200, timeout_s=10)
    assert wait_metric(sim_server, "vllm:kv_cache_usage_perc", 0.0, timeout_s=10)
    assert metric(sim_server, "vllm:num_requests_running") == 0
    assert (metric(sim_server, "vllm:num_preemptions_total") or 0) > 0  # the pool was full
    # Greedy requests repeat their tokens (after preemptions too).
    for i in (0, 57, 199):
        assert (
            _complete(sim_server.url, prompts[i], temperature=0)["token_ids"]
            == choices[i]["token_ids"]
        )


def test_seeded_requests_repeat_and_unseeded_ones_differ(sim_server: RemoteServer) -> None:
    prompt = list(range(200, 260))
    seeded = [_complete(sim_server.url, prompt, temperature=1.0, seed=7, ignore_eos=True)
              for _ in range(2)]  # fmt: skip
    assert seeded[0]["token_ids"] == seeded[1]["token_ids"]
    other = _complete(sim_server.url, prompt, temperature=1.0, seed=8, ignore_eos=True)
    assert other["token_ids"] != seeded[0]["token_ids"]
    free = [_complete(sim_server.url, prompt, temperature=1.0, ignore_eos=True)
            for _ in range(2)]  # fmt: skip
    assert free[0]["token_ids"] != free[1]["token_ids"]
    assert all(len(c["token_ids"]) == 32 for c in seeded + free)  # ignore_eos: no sampled EOS


def test_sim_speed_reports_simulated_seconds() -> None:
    """At --sim-speed 0.01 the simulated world runs 100 times faster than real time: the
    server's request latencies read 100 times the real ones (here, over the same request:
    between 50x and 100x the client's real time, which also holds the HTTP round trip; the
    client and its connection are made before the clock starts: an httpx client's set-up,
    ~20-50 ms of a loaded machine, once put the ratio at 44x)."""
    with RemoteServer(
        "--worker-backend", "sim", "--sim-model", MODEL, "--sim-speed", "0.01",
        "--kv-cache-memory-bytes", "1GiB",
    ) as server:  # fmt: skip
        server.wait_ready()
        body = {"model": MODEL, "prompt": list(range(100, 164)), "max_tokens": 200,
                "ignore_eos": True}  # fmt: skip
        with httpx.Client(timeout=120) as client:
            assert client.get(f"{server.url}/health").status_code == 200  # connected
            start = time.monotonic()
            r = client.post(f"{server.url}/v1/completions", json=body)
            real = time.monotonic() - start
        assert r.status_code == 200, r.text
        assert wait_metric(server, "vllm:e2e_request_latency_seconds_count", 1, timeout_s=10)
        simulated = metric(server, "vllm:e2e_request_latency_seconds_sum")
        assert simulated is not None and 50 * real <= simulated <= 100 * real, (simulated, real)


def test_clock_scales_intervals_and_wall_time() -> None:
    from services import clock

    try:
        env = clock.set_sim_speed(0.1, epoch=time.time())
        t0, w0, r0 = clock.monotonic(), clock.wall(), time.monotonic()
        time.sleep(0.05)
        real = time.monotonic() - r0
        assert clock.monotonic() - t0 == pytest.approx(10 * real, rel=0.2)
        assert clock.wall() - w0 == pytest.approx(10 * real, rel=0.2)
        assert clock.real_seconds(1.0) == pytest.approx(0.1)
        assert float(env[clock.SPEED_ENV]) == 0.1
    finally:
        clock.set_sim_speed(1.0)


def test_sim_refuses_what_it_does_not_model() -> None:
    from services.config import EngineConfig

    with pytest.raises(ConfigError, match="run it on one machine"):
        EngineConfig.from_kwargs(worker_backend="sim", tensor_parallel_size=2, nnodes=2,
                                 master_port=29500)  # fmt: skip
    with pytest.raises(ConfigError, match="engine nodes only at --sim-speed 1"):
        EngineConfig.from_kwargs(worker_backend="sim", sim_speed=0.5, data_parallel_size=2,
                                 data_parallel_size_local=1)  # fmt: skip


def test_sim_kv_cache_dtype_capacity_and_attention_time() -> None:
    """--kv-cache-dtype on a simulated H200: fp8 holds twice the bf16 blocks (int8 a little
    less, its rows carry a scale) and decode attention at long context reads half the bytes."""
    from services.config import EngineConfig
    from services.gpu_worker.distributed import ParallelState
    from services.gpu_worker.sim.worker import SimWorker
    from services.model_loader import load_hf_config, prepare_model
    from services.model_loader.sim_model import sim_model_folder

    folder = sim_model_folder(MODEL, prepare_model(None))
    blocks, attention = {}, {}
    for kv in ("auto", "fp8", "int8"):
        config = EngineConfig.from_kwargs(worker_backend="sim", sim_model=MODEL,
                                          kv_cache_dtype=kv, max_num_batched_tokens=2048)  # fmt: skip
        worker = SimWorker(config, folder, ParallelState())
        blocks[kv] = worker.determine_num_blocks()
        attention[kv] = worker.cost.attention_time([RequestWork(1, 8192, True)] * 64)
    head_dim = ModelArchConfig.from_hf_config(load_hf_config(folder)).head_dim
    assert blocks["fp8"] == pytest.approx(2 * blocks["auto"], rel=1e-3)
    assert blocks["int8"] == pytest.approx(2 * blocks["auto"] * head_dim / (head_dim + 4), rel=1e-3)
    assert attention["fp8"] < 0.55 * attention["auto"]
    assert attention["fp8"] < attention["int8"] < attention["auto"]


def test_kv_block_residency_is_timed_in_simulated_seconds() -> None:
    from services import clock
    from services.kv_cache.metrics import KVCacheMetrics

    try:
        clock.set_sim_speed(0.01)
        metrics = KVCacheMetrics(1.0)
        start = metrics._clock()
        time.sleep(0.02)
        assert metrics._clock() - start >= 1.0  # 20 ms real = 2 s simulated
    finally:
        clock.set_sim_speed(1.0)
