"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against HF transformers in fp32.

Small random-weight models (8 experts, top-2, hidden 64, expert width 32, vocabulary 256)
are built in HF with a seed and saved as HF folders (safetensors, HF's per-expert names);
our loader reads them. Prefill logits must match HF's within 1e-4 and greedy tokens must be
HF's, one request at a time, batched, in random prefill chunks mixed with decodes, resumed
after preemption, over a shared prefix's blocks, and offline under a tiny KV pool
(preemption), chunked prefill and prefix-cache hits. Also: the config fields,
``--load-format dummy`` from a config alone, TP=2 (each rank a slice of every expert)
and clear start-up errors for bad MoE configs.

Qwen3-MoE has three layers with layer 1 in ``mlp_only_layers`` (a dense MLP of another
width between two sparse ones).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from launch.llm import LLM, SamplingParams
from services.config import ConfigError, EngineConfig, ModelArchConfig
from services.gpu_worker.attention.torch_backend import TorchAttentionBackend
from services.gpu_worker.model.llama import LlamaForCausalLM
from services.gpu_worker.model.moe import SparseMoeBlock, expert_param
from services.gpu_worker.model_runner import ModelRunner
from services.model_loader import (
    ModelLoadError,
    dummy_weights,
    iter_weights,
    load_hf_config,
    prepare_model,
)
from services.model_loader.weights import param_shapes
from tests.test_model import _our_logits
from tests.test_model_runner import BLOCK_SIZE, Driver

VOCAB = 256
NUM_NEW = 12
KINDS = ["qwen3_moe", "mixtral"]


def _hf_config(kind: str, **overrides: object):
    import transformers

    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=512, num_experts_per_tok=2,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if kind.startswith("qwen3_moe"):
        cfg = transformers.Qwen3MoeConfig(
            **common, num_hidden_layers=3, num_experts=8, moe_intermediate_size=32,
            intermediate_size=48, mlp_only_layers=[1], decoder_sparse_step=1,
            norm_topk_prob=kind == "qwen3_moe",
        )  # fmt: skip
    else:
        cfg = transformers.MixtralConfig(
            **common, num_hidden_layers=2, num_local_experts=8, intermediate_size=32
        )
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def _hf_model(kind: str):
    import transformers

    cls = (
        transformers.Qwen3MoeForCausalLM
        if kind.startswith("qwen3_moe")
        else transformers.MixtralForCausalLM
    )
    torch.manual_seed(0)
    model = cls(_hf_config(kind)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # HF ones-inits norms: randomise them
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("gate.weight"):  # a decisive router: no near-ties in the top-k
                p.normal_(0.0, 1.0)
            elif "experts" in name:  # experts that matter next to the residual
                p.normal_(0.0, 0.2)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:  # larger than HF's 0.02: logits of a few units, no near-ties in greedy
                p.normal_(0.0, 0.3 if "lm_head" in name else 0.1)
    return model


def _save(kind: str, model, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    default = prepare_model(None)  # its tokenizer: ids below 256 decode to something
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default / name, folder / name)
    return folder


def greedy_with_cache(model, prompt: list[int]) -> list[int]:
    """HF's greedy continuation with its KV cache; EOS does not stop it."""
    out: list[int] = []
    cache, cur = None, torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(NUM_NEW):
            res = model(input_ids=cur, cache=cache, use_cache=True)
            cache = res.cache
            out.append(int(res.logits[0, -1].argmax()))
            cur = torch.tensor([[out[-1]]])
    return out


@pytest.fixture(scope="module", params=KINDS)
def moe(request, tmp_path_factory):
    """(kind, HF folder, HF model)."""
    kind = request.param
    model = _hf_model(kind)
    return kind, _save(kind, model, tmp_path_factory.mktemp(kind)), model


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 17, 40, 64, 90, 130)]


@pytest.fixture(scope="module")
def hf_greedy(moe, prompts) -> list[list[int]]:
    _, _, model = moe
    return [greedy_with_cache(model, p) for p in prompts]


@pytest.fixture(scope="module")
def runner(moe) -> ModelRunner:
    _, folder, _ = moe
    config = EngineConfig.from_kwargs(num_threads=1, block_size=BLOCK_SIZE, max_model_len=512)
    config.finalize(ModelArchConfig.from_hf_config(load_hf_config(folder)))
    runner = ModelRunner(config, folder)
    runner.initialize_kv_cache(256)
    return runner


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW)


def test_arch_fields(moe):
    kind, folder, _ = moe
    arch = ModelArchConfig.from_hf_config(load_hf_config(folder))
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (8, 2, 32)
    assert arch.norm_topk_prob
    if kind == "qwen3_moe":
        assert arch.qk_norm and arch.intermediate_size == 48
        assert [arch.is_moe_layer(i) for i in range(3)] == [True, False, True]
        assert arch.moe_checkpoint_module == "mlp"
    else:
        assert not arch.qk_norm
        assert [arch.is_moe_layer(i) for i in range(2)] == [True, True]
        assert arch.moe_checkpoint_module == "block_sparse_moe"
    # --load-format dummy's shapes are the checkpoint's, name for name.
    saved = dict(iter_weights(folder, torch.float32))
    assert param_shapes(arch) == {k: tuple(v.shape) for k, v in saved.items()}


def test_expert_param_names():
    assert expert_param("model.layers.3.mlp.experts.5.up_proj.weight") == (
        "model.layers.3.mlp.w13", 5, 1,
    )  # fmt: skip
    assert expert_param("model.layers.0.mlp.experts.7.w2.weight") == (
        "model.layers.0.mlp.w2",
        7,
        None,
    )
    assert expert_param("model.layers.0.mlp.gate.weight") is None
    assert expert_param("model.layers.0.mlp.gate_proj.weight") is None


@pytest.mark.parametrize("kind", [*KINDS, "qwen3_moe_unnormalised"])
def test_prefill_logits_match_hf(kind, tmp_path):
    model = _hf_model(kind)
    folder = _save(kind, model, tmp_path)
    arch = ModelArchConfig.from_hf_config(load_hf_config(folder))
    assert arch.norm_topk_prob == (kind != "qwen3_moe_unnormalised")
    ours = LlamaForCausalLM(arch, TorchAttentionBackend)
    ours.load_weights(iter_weights(folder, torch.float32))
    assert sum(isinstance(m, SparseMoeBlock) for m in ours.modules()) == 2
    tokens = torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expected = model(torch.tensor([tokens])).logits[0]
    logits = _our_logits(ours, tokens)
    assert expected.abs().max() > 1.0  # the comparison is not of near-zero logits
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_greedy_each_alone_and_batched(runner, prompts, hf_greedy):
    for i, prompt in enumerate(prompts[:3]):
        driver = Driver(runner)
        req = driver.add(f"alone-{i}", prompt, GREEDY, max_new=NUM_NEW)
        driver.run()
        assert req.output == hf_greedy[i], f"prompt {i}"
    driver = Driver(runner)
    reqs = [driver.add(f"batch-{i}", p, GREEDY, max_new=NUM_NEW) for i, p in enumerate(prompts)]
    driver.run()
    assert [r.output for r in reqs] == hf_greedy
    assert len(runner.input_batch) == 0


def test_chunked_prefill_mixed_with_decode(runner, prompts, hf_greedy):
    driver = Driver(runner)
    reqs = [driver.add(f"chunk-{i}", p, GREEDY, max_new=NUM_NEW) for i, p in enumerate(prompts)]
    driver.run(rng=random.Random(0), admit_per_step=1)
    assert [r.output for r in reqs] == hf_greedy


def test_shared_prefix_blocks_and_resume(runner, prompts, hf_greedy):
    long_prompt, expected = prompts[-1], hf_greedy[-1]
    driver = Driver(runner)
    owner = driver.add("owner", long_prompt[:100] + [5, 6, 7], GREEDY, max_new=1)
    driver.run()
    shared = owner.block_ids[: 96 // BLOCK_SIZE]
    reader = driver.add("reader", long_prompt, GREEDY, max_new=NUM_NEW, shared_blocks=shared)
    driver.run()
    assert reader.output == expected
    # Preempted after 5 tokens, recomputed in 7-token chunks into fresh blocks.
    driver = Driver(runner)
    first = driver.add("victim", prompts[3], GREEDY, max_new=5)
    driver.run()
    resumed = driver.add("victim", first.token_ids, GREEDY, max_new=NUM_NEW - 5)
    resumed.num_prompt_tokens = len(prompts[3])
    driver.run(chunk=7)
    assert first.output + resumed.output == hf_greedy[3]


def test_logprobs_are_hf_logprobs(runner, moe, prompts):
    _, _, model = moe
    prompt = prompts[2]
    driver = Driver(runner)
    driver.add("lp", prompt, SamplingParams(temperature=0.0, logprobs=5), max_new=1)
    result = driver.step({"lp": len(prompt)})
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    lp = result.logprobs[0]
    top = expected.topk(5)
    assert lp.top_token_ids == top.indices.tolist()
    torch.testing.assert_close(torch.tensor(lp.top_logprobs), top.values, atol=1e-4, rtol=0)
    driver.step({})


def test_offline_preemption_chunking_prefix_hits(moe, prompts, hf_greedy):
    _, folder, _ = moe
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    llm = LLM(
        str(folder), max_model_len=160, num_gpu_blocks_override=13, block_size=16,
        max_num_batched_tokens=48, enable_prefix_caching=True, num_threads=1,
    )  # fmt: skip
    llm.step_hook = llm.scheduler.check_integrity
    assert [r.outputs[0].token_ids for r in llm.generate(prompts, params)] == hf_greedy
    assert llm.scheduler.num_preemptions > 0
    pool = llm.scheduler.kv_cache_manager.block_pool
    before = pool.prefix_cache_stats.hits
    again = llm.generate([prompts[-1]], params)[0]
    assert again.outputs[0].token_ids == hf_greedy[-1]
    assert pool.prefix_cache_stats.hits > before and again.num_cached_tokens > 0


def test_tp2_equals_hf(moe, prompts, hf_greedy):
    _, folder, _ = moe
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    with LLM(
        str(folder), max_model_len=256, num_gpu_blocks_override=64, tensor_parallel_size=2,
        max_num_batched_tokens=64,
    ) as llm:  # fmt: skip
        assert [r.outputs[0].token_ids for r in llm.generate(prompts, params)] == hf_greedy


@pytest.mark.parametrize("kind", KINDS)
def test_dummy_load_format_from_config(kind, tmp_path):
    cfg = _hf_config(kind).to_dict()
    cfg["architectures"] = ["Qwen3MoeForCausalLM" if kind == "qwen3_moe" else "MixtralForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = ModelArchConfig.from_hf_config(load_hf_config(tmp_path))
    config = EngineConfig.from_kwargs(num_threads=1, load_format="dummy", seed=3, block_size=4)
    config.finalize(arch)
    runner = ModelRunner(config, None, arch=arch)
    expected = dict(dummy_weights(arch, torch.float32, 3))
    module = "mlp" if kind == "qwen3_moe" else "block_sparse_moe"
    down = "down_proj" if kind == "qwen3_moe" else "w2"
    block = runner.model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    torch.testing.assert_close(
        block.w2[3], expected[f"model.layers.0.{module}.experts.3.{down}.weight"]
    )
    runner.initialize_kv_cache(16)
    driver = Driver(runner)
    req = driver.add("d", [1, 2, 3], GREEDY, max_new=3)
    driver.run()
    assert len(req.output) == 3 and all(0 <= t < VOCAB for t in req.output)


@pytest.mark.parametrize(
    "kind,overrides,message",
    [
        (
            "qwen3_moe",
            {"num_experts_per_tok": 9},
            r"num_experts_per_tok \(9\) must be between 1 and",
        ),
        ("mixtral", {"num_experts_per_tok": 0}, r"num_experts_per_tok \(0\) must be between 1 and"),
        ("mixtral", {"num_local_experts": 0}, "num_local_experts must be at least 1"),
        ("qwen3_moe", {"moe_intermediate_size": None}, "bad value"),
    ],
)
def test_bad_moe_config_is_a_startup_error(kind, overrides, message, tmp_path):
    cfg = _hf_config(kind).to_dict()
    cfg.update(overrides)
    cfg["architectures"] = ["Qwen3MoeForCausalLM" if kind == "qwen3_moe" else "MixtralForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((ConfigError, ModelLoadError), match=message):
        LLM(str(tmp_path), load_format="dummy")


def test_expert_width_must_divide_tp(tmp_path):
    cfg = _hf_config("qwen3_moe").to_dict()  # its dense layer's width 48 divides 4
    cfg.update(architectures=["Qwen3MoeForCausalLM"], moe_intermediate_size=30)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"experts' MLP width \(30\) must be divisible"):
        LLM(str(tmp_path), load_format="dummy", tensor_parallel_size=4)
