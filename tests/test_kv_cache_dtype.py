"""``--kv-cache-dtype`` fp8 / fp8_e5m2 / int8 (issue 32): the flag, the cache's size, the
torch backend's attention over a quantized cache, and the model end to end.

The kernels have their own tests (tests/test_kv_quant_kernels.py, tests/test_kv_quant_cpu.py);
the references here are float64 attention over the dequantized cache and the unquantized
model on the same weights.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from actorserve_kernels import kv_quant
from services.config import ConfigError, EngineConfig, ModelArchConfig
from services.gpu_worker.attention.torch_backend import TorchAttentionBackend
from services.gpu_worker.model_runner import ModelRunner, build_attention_metadata
from services.protocol import BlockStoreLoad, SamplingParams
from tests.test_model_runner import Driver

QUANTIZED = ("fp8", "fp8_e5m2", "int8")
STORAGE = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}


def test_flags():
    assert EngineConfig.from_kwargs(kv_cache_dtype="int8").cache.kv_cache_dtype == "int8"
    config = EngineConfig.from_kwargs(kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert config.cache.calculate_kv_scales
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of"):
        EngineConfig.from_kwargs(kv_cache_dtype="fp4")
    with pytest.raises(ConfigError, match="--calculate-kv-scales"):
        EngineConfig.from_kwargs(kv_cache_dtype="int8", calculate_kv_scales=True)


def test_connectors_refuse_measured_scales():
    """Blocks that reach another server must be read with the scales they were written
    with: measured scales are refused where blocks cross servers, not for the host tier."""
    from services.config.kv_transfer import KVTransferConfig
    from services.kv_transfer.offload import OffloadConnectorScheduler
    from services.kv_transfer.p2p import P2PConnectorScheduler

    engine = EngineConfig.from_kwargs(kv_cache_dtype="fp8", calculate_kv_scales=True)
    with pytest.raises(ConfigError, match="--calculate-kv-scales with the p2p KV connector"):
        P2PConnectorScheduler(KVTransferConfig("p2p"), engine, 1024)
    offload = KVTransferConfig("offload", kv_connector_extra_config={"kv_offload_bytes": 1 << 20})
    assert OffloadConnectorScheduler(offload, engine, 1024).capacity == 1024
    int8_tier = KVTransferConfig(
        "offload",
        kv_connector_extra_config={"kv_offload_bytes": 1 << 20, "kv_offload_dtype": "int8"},
    )
    with pytest.raises(ConfigError, match="stored as the cache holds them"):
        OffloadConnectorScheduler(int8_tier, EngineConfig.from_kwargs(kv_cache_dtype="int8"), 1024)


# ---------------------------------------------------------------- the torch backend


def _reference(query, keys, values, q_lens, ctx_lens, scale):
    """float64 causal attention of each request's new tokens over its [ctx, heads, D] K/V."""
    out, start = [], 0
    for k, v, q_len, ctx in zip(keys, values, q_lens, ctx_lens, strict=True):
        q = query[start : start + q_len].double()
        groups = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(groups, 1)
        vv = v.double().repeat_interleave(groups, 1)
        s = torch.einsum("qhd,khd->hqk", q, kk) * scale
        pos = ctx - q_len + torch.arange(q_len)
        s = s.masked_fill(torch.arange(ctx)[None, None, :] > pos[None, :, None], -math.inf)
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
        start += q_len
    return torch.cat(out)


@pytest.mark.parametrize("kv", QUANTIZED)
@pytest.mark.parametrize("use_kernel", [False, True])
def test_torch_backend_attends_over_the_dequantized_cache(kv, use_kernel):
    """Two steps: prompts written to a quantized cache, then a prefill chunk over a cached
    prefix and decodes reading it: the output is attention over the dequantized K/V
    (float64 reference, exact up to accumulation order), and the cache holds
    ``kv_quant.quantize`` of the K/V."""
    heads, kv_heads, d, bs = 6, 2, 64, 16
    gen = torch.Generator().manual_seed(3)
    backend = TorchAttentionBackend(heads, d, kv_heads, d**-0.5, use_cpu_kernel=use_kernel)
    if use_kernel and not kv_quant_op_available():
        pytest.skip("the C++ ops did not build")
    width = kv_quant.row_width(kv, d)
    shape = (12, bs, kv_heads, width)
    cache = (torch.zeros(shape, dtype=STORAGE[kv]), torch.zeros(shape, dtype=STORAGE[kv]))
    scales = (torch.tensor([0.02]), torch.tensor([0.03]))
    table = np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::-1].copy()  # pages reversed
    all_k = [torch.empty(0, kv_heads, d)] * 3
    all_v = [torch.empty(0, kv_heads, d)] * 3
    for computed, scheduled in (([0, 0, 0], [20, 9, 1]), ([20, 9, 1], [1, 12, 1])):
        meta, token_req, _ = build_attention_metadata(
            np.array(computed), np.array(scheduled), table, bs, torch.device("cpu")
        )
        t = sum(scheduled)
        q = torch.randn(t, heads, d, generator=gen)
        k = torch.randn(t, kv_heads, d, generator=gen) * 3
        v = torch.randn(t, kv_heads, d, generator=gen) * 3
        out = backend.forward(q, k, v, cache, meta, scales)
        deq_k, deq_v = [], []
        for r in range(3):
            rows = torch.from_numpy(np.flatnonzero(token_req == r))
            kq = kv_quant.dequantize(kv_quant.quantize(k[rows], STORAGE[kv], scales[0]),
                                     scales[0], torch.float32)  # fmt: skip
            vq = kv_quant.dequantize(kv_quant.quantize(v[rows], STORAGE[kv], scales[1]),
                                     scales[1], torch.float32)  # fmt: skip
            fresh = computed[r] == 0 and scheduled[r] > 1  # new prompts attend unquantized
            all_k[r] = torch.cat([all_k[r], k[rows] if fresh else kq])
            all_v[r] = torch.cat([all_v[r], v[rows] if fresh else vq])
            deq_k.append(all_k[r])
            deq_v.append(all_v[r])
            all_k[r] = torch.cat([all_k[r][: computed[r]], kq])  # what the cache holds
            all_v[r] = torch.cat([all_v[r][: computed[r]], vq])
        ctx = [c + n for c, n in zip(computed, scheduled, strict=True)]
        ref = _reference(q, deq_k, deq_v, scheduled, ctx, d**-0.5)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    # The cache holds every token's quantized K, in its slot (request 0: pages 3, 2).
    k_cache_rows = cache[0].view(-1, kv_heads, width)
    slots = [3 * bs + i for i in range(bs)] + [2 * bs + i for i in range(21 - bs)]
    got = kv_quant.dequantize(k_cache_rows[slots], scales[0], torch.float32)
    torch.testing.assert_close(got, all_k[0], atol=0, rtol=0)


def kv_quant_op_available() -> bool:
    from actorserve_kernels.cpu import load_cpu_ops

    return load_cpu_ops()


# ---------------------------------------------------------------- the model end to end

TINY = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 512,
}  # fmt: skip


def _runner(kv: str, **extra) -> ModelRunner:
    arch = ModelArchConfig.from_hf_config(TINY)
    config = EngineConfig.from_kwargs(
        load_format="dummy", device="cpu", dtype="float32", block_size=16, max_model_len=256,
        max_num_seqs=8, num_threads=1, kv_cache_dtype=kv, **extra,
    )  # fmt: skip
    config.finalize(arch)
    runner = ModelRunner(config, None, arch=arch)
    runner.initialize_kv_cache(64)
    return runner


def test_cache_size_follows_the_dtype():
    plain = _runner("auto")
    assert plain.kv_caches[0][0].dtype == torch.float32
    for kv in QUANTIZED:
        runner = _runner(kv)
        assert runner.kv_caches[0][0].dtype == STORAGE[kv]
        assert runner.kv_caches[0][0].shape[-1] == kv_quant.row_width(kv, 64)
        ratio = runner.kv_cache_bytes_per_block() / plain.kv_cache_bytes_per_block()
        assert ratio == (68 / 256 if kv == "int8" else 1 / 4)  # fp32 model: 4 bytes a value
        _, layout = runner.kv_caches_for_transfer()
        assert layout.dtype == str(STORAGE[kv]).removeprefix("torch.")


def _logprobs(runner: ModelRunner, prompts: list[list[int]]) -> list[list[float]]:
    """Greedy continuations, prompts prefilled in chunks of 8 (later chunks read the
    earlier ones from the cache): each step's sampled-token logprob."""
    driver = Driver(runner)
    lps: list[list[float]] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        driver.add(f"r{i}", p, sampling=SamplingParams(temperature=0.0, logprobs=1), max_new=6)
    step = driver.step

    def record(schedule):
        result = step(schedule)
        for req_id, lp in zip(result.req_ids, result.logprobs, strict=True):
            lps[int(req_id[1:])].append(lp.logprob)
        return result

    driver.step = record  # type: ignore[method-assign]
    driver.run(chunk=8)
    return lps


@pytest.mark.parametrize("kv", QUANTIZED)
def test_model_with_a_quantized_cache_stays_close(kv):
    """The same random-weight model, each KV dtype against auto: the logprobs of what is
    sampled move by little (a bound per dtype), and they do move (the cache was read)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (30, 17, 41)]
    want = _logprobs(_runner("auto"), prompts)
    got = _logprobs(_runner(kv, calculate_kv_scales=kv.startswith("fp8")), prompts)
    diffs = [abs(a - b) for w, g in zip(want, got, strict=True) for a, b in zip(w, g, strict=False)]
    bound = {"fp8": 0.05, "fp8_e5m2": 0.1, "int8": 0.01}[kv]
    assert 0 < max(diffs) < bound, (kv, max(diffs))


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_triton_backend_with_a_quantized_cache(kv):
    """The Triton backend (interpreted here) over the same quantized cache: the layer's
    scales reach its kernels, and the model stays as close to auto as on the torch backend."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (19, 26)]
    want = _logprobs(_runner("auto"), prompts)
    got = _logprobs(_runner(kv, attention_backend="triton",
                            calculate_kv_scales=kv == "fp8"), prompts)  # fmt: skip
    diffs = [abs(a - b) for w, g in zip(want, got, strict=True) for a, b in zip(w, g, strict=False)]
    assert 0 < max(diffs) < {"fp8": 0.05, "int8": 0.01}[kv], (kv, max(diffs))


def test_calculated_scales_are_measured_once():
    runner = _runner("fp8", calculate_kv_scales=True)
    attn = runner.model.model.layers[0].self_attn
    assert float(attn.k_scale) == 1.0
    _logprobs(runner, [[5, 6, 7, 8, 9, 10, 11, 12, 13]])
    first = (float(attn.k_scale), float(attn.v_scale))
    assert first[0] != 1.0 and first[1] != 1.0
    _logprobs(runner, [[100] * 40])
    assert (float(attn.k_scale), float(attn.v_scale)) == first


def test_checkpoint_scales_are_loaded():
    from services.model_loader import dummy_weights

    arch = ModelArchConfig.from_hf_config(TINY)
    weights = list(dummy_weights(arch, torch.float32))
    weights += [("model.layers.0.self_attn.k_scale", torch.tensor(0.5)),
                ("model.layers.1.self_attn.v_proj.v_scale", torch.tensor([0.25]))]  # fmt: skip
    config = EngineConfig.from_kwargs(load_format="dummy", device="cpu", dtype="float32",
                                      max_model_len=256, kv_cache_dtype="fp8")  # fmt: skip
    config.finalize(arch)
    runner = ModelRunner(config, None, arch=arch, weights=weights)
    layers = runner.model.model.layers
    assert float(layers[0].self_attn.k_scale) == 0.5
    assert float(layers[1].self_attn.v_scale) == 0.25
    assert float(layers[1].self_attn.k_scale) == 1.0


# ---------------------------------------------------------------- blocks move as stored


def _quantized_caches(kv: str, layout, num_blocks: int = 8) -> list:
    width = kv_quant.row_width(kv, layout.head_dim)
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, width)

    def filled() -> torch.Tensor:
        return kv_quant.quantize(torch.randn(*shape[:3], layout.head_dim) * 4, STORAGE[kv],
                                 torch.tensor([0.05]))  # fmt: skip

    return [(filled(), filled()) for _ in range(layout.num_layers)]


@pytest.mark.parametrize("kv", QUANTIZED)
def test_the_host_tier_keeps_quantized_blocks_as_stored(kv):
    """Offloaded and loaded back into other blocks: the same bytes (no second quantization)."""
    from services.kv_transfer.offload import OffloadConnectorWorker
    from tests.test_kv_offload import LAYOUT, Reports, engine, step

    cfg = engine(kv_offload_bytes=1 << 20)
    cfg.cache.kv_cache_dtype = kv
    w = OffloadConnectorWorker(cfg.kv_transfer, cfg, 0, Reports())
    kv_caches = _quantized_caches(kv, LAYOUT)
    w.register_kv_caches(kv_caches, LAYOUT)
    want = [(kv_quant.as_bytes(k)[[1, 3]].clone(), kv_quant.as_bytes(v)[[1, 3]].clone())
            for k, v in kv_caches]  # fmt: skip
    step(w, save_keys=[70, 5], save_block_ids=[1, 3])
    step(w, loads=[BlockStoreLoad("r", [70, 5], [6, 2])])
    for (k, v), (wk, wv) in zip(kv_caches, want, strict=True):
        assert torch.equal(kv_quant.as_bytes(k)[[6, 2]], wk)
        assert torch.equal(kv_quant.as_bytes(v)[[6, 2]], wv)


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_a_p2p_pull_moves_quantized_blocks_in_fewer_bytes(kv):
    """A decode instance pulls a quantized cache's blocks byte for byte: a quarter of an fp32
    cache's bytes for fp8, (head_dim + 4) / (4 head_dim) for int8."""
    from services.protocol import KVLayout, P2PHold
    from tests.test_kv_transfer import _bind, load, meta, worker

    layout = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8,
                      dtype=str(STORAGE[kv]).removeprefix("torch."))  # fmt: skip
    src = _quantized_caches(kv, layout)
    dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
    with (
        worker("kv_producer", src, layout) as (prod, _),
        worker("kv_consumer", dst, layout) as (
            cons,
            got,
        ),
    ):
        _bind(prod, meta(holds=[P2PHold("p1", [1, 3, 5], [1, 1, 1], 30.0)]))
        _bind(cons, meta(loads=[load("d1", [0, 2, 4], "p1", [1, 3, 5], prod.bound_port)]))
        done = got.wait("finished_recving", "d1")
    fp32_bytes = 2 * 2 * 3 * 4 * 2 * 8 * 4  # layers x K/V x blocks x slots x heads x dims x 4
    assert done.num_bytes == fp32_bytes * (12 / 32 if kv == "int8" else 1 / 4)
    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        assert torch.equal(kv_quant.as_bytes(dk)[[0, 2, 4]], kv_quant.as_bytes(sk)[[1, 3, 5]])
        assert torch.equal(kv_quant.as_bytes(dv)[[0, 2, 4]], kv_quant.as_bytes(sv)[[1, 3, 5]])


# ---------------------------------------------------------------- the engine


@pytest.mark.parametrize("kv", ["int8", pytest.param("fp8", marks=pytest.mark.slow)])
def test_preemption_and_prefix_hits_over_a_quantized_cache(kv, greedy_prompts, hf_greedy_tokens):
    """The default model in a pool too small for its requests, over a quantized cache:
    requests are preempted and recomputed, the pool stays whole every step and empties,
    a repeated prompt hits the prefix cache, and greedy outputs stay HF's up to where the
    quantization first tips a token (most of them)."""
    from launch.llm import LLM
    from launch.llm import SamplingParams as Params
    from tests.conftest import NUM_GREEDY_TOKENS

    # 40 usable int8 blocks: the ~950 tokens of test_engine's heavy-preemption run in 640.
    llm = LLM(max_model_len=512, num_gpu_blocks_override=41, block_size=16,
              max_num_batched_tokens=256, kv_cache_dtype=kv)  # fmt: skip
    llm.step_hook = llm.scheduler.check_integrity
    params = Params(temperature=0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    outputs = [r.outputs[0].token_ids for r in llm.generate(greedy_prompts, params)]
    assert llm.scheduler.num_preemptions > 0
    pool = llm.scheduler.kv_cache_manager.block_pool
    assert pool.get_usage() == 0.0
    same = [next((i for i, (a, b) in enumerate(zip(o, h, strict=True)) if a != b), len(h))
            for o, h in zip(outputs, hf_greedy_tokens, strict=True)]  # fmt: skip
    assert sum(same) >= 0.75 * sum(len(h) for h in hf_greedy_tokens), same
    before = pool.prefix_cache_stats.hits
    again = llm.generate(greedy_prompts[-1:], params)[0]
    assert pool.prefix_cache_stats.hits > before and again.num_cached_tokens > 0


def test_cache_config_info_names_the_dtype():
    from services.config.serve import ServeConfig
    from services.metrics.engine_metrics import cache_config_labels

    config = ServeConfig(engine=EngineConfig.from_kwargs(kv_cache_dtype="fp8_e5m2"))
    assert cache_config_labels(config)["cache_dtype"] == "fp8_e5m2"
