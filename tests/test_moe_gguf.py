"""GGUF mixture-of-experts models, as llama.cpp writes them, against HF transformers in fp32.

Small random-weight Qwen3-MoE (arch ``qwen3moe``) and Mixtral (arch ``llama`` with
``llama.expert_count``, q/k rows in llama.cpp's rotary order) models are written with
llama.cpp's names and metadata: the router ``blk.N.ffn_gate_inp``, each projection of the 8
experts stacked in ``blk.N.ffn_{gate,up,down}_exps``. The expert tensors are F32, or
quantized (Q8_0, Q4_0, a mix of types within a layer); the other tensors F32, so the
reference is HF on the weights the file holds (the quantized experts dequantized).

Checked: the derived config; prefill logits within 1e-4 of HF's; greedy tokens through the
offline ``LLM``; quantized experts staying in their blocks (``QuantExperts``, ``w13``/``w2``
freed), falling back to dense for an F16 projection or a type the CPU kernels lack;
``QuantExperts`` against ``fused_experts_ref`` (with an expert map, under TP and EP cuts);
clear errors for a missing or misshapen expert tensor.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

from actorserve_kernels.cpu import load_cpu_ops
from actorserve_kernels.moe import fused_experts_ref
from launch.llm import LLM, SamplingParams
from services.config import ModelArchConfig
from services.gpu_worker.distributed import ParallelState
from services.gpu_worker.model.moe import SparseMoeBlock
from services.gpu_worker.model.moe_quant import DOWN, GATE, UP, QuantExperts
from services.model_loader import ModelLoadError, iter_weights, load_hf_config, prepare_model
from services.model_loader.gguf_tensors import GGUFBlocks, hf_expert_names, hf_tensor_name
from tests.test_model import _our_logits
from tests.test_model_loader import _gguf_name, _llama_cpp_permute
from tests.test_moe_model import _hf_config
from tests.test_quantized_model import _load

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="the C++ CPU kernels did not build")

NUM_NEW = 8
_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight"
)
_PROJ_INDEX = {
    "gate_proj": GATE,
    "up_proj": UP,
    "down_proj": DOWN,
    "w1": GATE,
    "w3": UP,
    "w2": DOWN,
}
_STACKED = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")

# The ggml types of each MoE layer's (gate, up, down) expert tensors.
F32 = (Q.F32, Q.F32, Q.F32)
VARIANTS: dict[str, dict[int, tuple[Q, Q, Q]]] = {
    "q8_0": {0: (Q.Q8_0,) * 3, 1: (Q.Q8_0,) * 3},
    # layer 1: gate and up of two types, packed as two matrices
    "mixed": {0: (Q.Q4_0, Q.Q4_0, Q.Q8_0), 1: (Q.Q8_0, Q.Q4_0, Q.Q4_0)},
    # layer 0: an F16 down projection; layer 1: Q5_0, which the CPU kernels lack: both dense
    "fallback": {0: (Q.Q8_0, Q.Q8_0, Q.F16), 1: (Q.Q5_0,) * 3},
}


def _tokens() -> list[str]:
    from services.model_loader.gguf_tokenizer import _byte_spelling

    return [_byte_spelling()[b] for b in range(256)] + ["Ġt", "he", "<|endoftext|>"]


def _hf_model(kind: str):
    """A random HF model (``tests/test_moe_model``'s scales) over the GGUF vocabulary.
    ``qwen3_moe``: every layer sparse, as llama.cpp reads qwen3moe; ``qwen3_moe_dense``:
    layer 1 a dense MLP (``mlp_only_layers``)."""
    import transformers

    overrides: dict[str, object] = {"vocab_size": len(_tokens())}
    if kind == "qwen3_moe":
        overrides.update(num_hidden_layers=2, mlp_only_layers=[])
    cfg = _hf_config("qwen3_moe" if kind.startswith("qwen3") else kind, **overrides)
    cls = (
        transformers.Qwen3MoeForCausalLM
        if kind.startswith("qwen3")
        else transformers.MixtralForCausalLM
    )
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 1.0)
            elif "experts" in name:
                p.normal_(0.0, 0.2)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.3 if "lm_head" in name else 0.1)
    return model


def _write_gguf(
    path: Path, kind: str, hf_folder: Path, types: dict[int, tuple[Q, Q, Q]], *,
    drop: str | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """``hf_folder``'s model as llama.cpp's converter writes it, the experts of layer i in
    ``types[i]``; returns the weights the file holds (dequantized) by HF name. ``drop``:
    a GGUF tensor left out."""
    cfg = load_hf_config(hf_folder)
    weights = dict(iter_weights(hf_folder, torch.float32))
    qwen = kind.startswith("qwen3")
    w = gguf.GGUFWriter(str(path), "qwen3moe" if qwen else "llama")
    heads, kv_heads, experts = cfg["num_attention_heads"], cfg["num_key_value_heads"], 8
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    w.add_rope_freq_base(float(theta))
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if qwen:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    tokens = _tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if qwen else "llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([1] * 258 + [3])
    w.add_token_merges(["Ġ t", "h e"])
    w.add_eos_token_id(258)
    held = dict(weights)
    expert_names: dict[tuple[int, int], list[str]] = {}
    for name, tensor in weights.items():
        m = _EXPERT.fullmatch(name)
        if m:
            names = expert_names.setdefault((int(m[1]), _PROJ_INDEX[m[3]]), [""] * experts)
            names[int(m[2])] = name
            continue
        array = tensor.numpy()
        if name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
            gguf_name = f"blk.{name.split('.')[2]}.ffn_gate_inp.weight"
        else:
            gguf_name = _gguf_name(name)
            if not qwen and (".q_proj." in name or ".k_proj." in name):
                array = _llama_cpp_permute(array, heads if ".q_proj." in name else kv_heads)
        if gguf_name != drop:
            w.add_tensor(gguf_name, np.ascontiguousarray(array))
    for (layer, proj), names in sorted(expert_names.items()):
        gguf_name = f"blk.{layer}.{_STACKED[proj]}.weight"
        array = np.stack([weights[n].numpy() for n in names])  # [E, rows, cols]
        qtype = types[layer][proj]
        raw_dtype = None
        if qtype == Q.F32:
            stored = array
        elif qtype == Q.F16:
            stored = array.astype(np.float16)
            array = stored.astype(np.float32)
        else:
            stored, raw_dtype = gguf.quants.quantize(array, qtype), qtype
            array = gguf.quants.dequantize(stored, qtype).reshape(array.shape)
        if gguf_name != drop:
            w.add_tensor(gguf_name, stored, raw_dtype=raw_dtype)
        for e, name in enumerate(names):
            held[name] = torch.from_numpy(np.array(array[e]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def _hf_on(hf_folder: Path, weights: dict[str, torch.Tensor], dest: Path):
    """The HF model of ``hf_folder``'s config over ``weights`` (HF names)."""
    import transformers

    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(hf_folder / "config.json", dest / "config.json")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(dest / "model.safetensors"))
    return transformers.AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()


def _moe_blocks(model) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    """kind -> the HF model saved (safetensors, HF's per-expert names)."""
    out = {}
    for kind in ("qwen3_moe", "qwen3_moe_dense", "mixtral"):
        folder = tmp_path_factory.mktemp(kind)
        _hf_model(kind).save_pretrained(folder, safe_serialization=True)
        out[kind] = folder
    return out


def _prepared(tmp_path: Path, kind: str, hf_folder: Path, variant: str):
    path = tmp_path / f"{kind}-{variant}.gguf"
    held = _write_gguf(path, kind, hf_folder, VARIANTS[variant])
    return path, prepare_model(str(path), "gguf", cache_dir=tmp_path / "cache"), held


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_moe_dense", "mixtral"])
def test_f32_gguf_config_weights_and_logits(kind, hf_folders, tmp_path) -> None:
    """The derived config is HF's; the converted weights are HF's exactly; logits HF's."""
    hf_folder = hf_folders[kind]
    variant = {0: F32, 1: F32, 2: F32}
    path = tmp_path / "m.gguf"
    _write_gguf(path, kind, hf_folder, variant)
    folder = prepare_model(str(path), "gguf", cache_dir=tmp_path / "cache")
    got = ModelArchConfig.from_hf_config(load_hf_config(folder))
    want = ModelArchConfig.from_hf_config(load_hf_config(hf_folder))
    for field in ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "intermediate_size",
                  "hidden_size", "num_hidden_layers", "head_dim", "qk_norm", "vocab_size",
                  "rope_theta", "rms_norm_eps", "tie_word_embeddings"):  # fmt: skip
        expected = getattr(want, field)
        if isinstance(expected, float):  # GGUF stores them as float32
            expected = pytest.approx(expected, rel=1e-6)
        assert getattr(got, field) == expected, field
    assert got.moe_checkpoint_module == ("block_sparse_moe" if kind == "mixtral" else "mlp")
    ours = dict(iter_weights(folder, torch.float32))
    ref = dict(iter_weights(hf_folder, torch.float32))
    assert ours.keys() == ref.keys()
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    model = _load(folder, quantized=True)
    assert all(b.quant_experts is None and b.w13.numel() > 0 for b in _moe_blocks(model))
    tokens = torch.randint(0, 259, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    logits = _our_logits(model, tokens)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("variant", ["q8_0", "mixed", "fallback"])
def test_quantized_experts_match_hf(kind, variant, hf_folders, tmp_path) -> None:
    """Quantized experts: kept in their blocks where the CPU kernels read them (w13/w2
    freed), dense otherwise; logits are HF's on the dequantized weights."""
    hf_folder = hf_folders[kind]
    _, folder, held = _prepared(tmp_path, kind, hf_folder, variant)
    model = _load(folder, quantized=True)
    blocks = _moe_blocks(model)
    assert len(blocks) == 2
    for layer, block in enumerate(blocks):
        if variant == "fallback":
            assert block.quant_experts is None
            assert block.w13.shape == (8, 64, 64) and block.w2.shape == (8, 64, 32)
            continue
        quant = block.quant_experts
        assert quant is not None and quant.ready
        assert block.w13.numel() == 0 and block.w2.numel() == 0
        gate, up, _ = VARIANTS[variant][layer]
        assert {len(parts) for parts in quant.gate_up} == {1 if gate == up else 2}
        assert quant.nbytes < 8 * 3 * 32 * 64 * 2  # at most ~1 byte a weight (fp32: 4)
    hf = _hf_on(hf_folder, held, tmp_path / "hf-dequantized")
    for n in (5, 70):  # the kernels' few-row and many-row paths
        tokens = torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        with torch.inference_mode():
            expected = hf(torch.tensor([tokens])).logits[0]
        logits = _our_logits(model, tokens)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_offline_greedy_equals_hf(kind, hf_folders, tmp_path) -> None:
    """The offline engine on a quantized GGUF MoE model (its default ``--quantization
    auto``): HF's greedy tokens on the dequantized weights, batched and chunked."""
    hf_folder = hf_folders[kind]
    _, folder, held = _prepared(tmp_path, kind, hf_folder, "mixed")
    hf = _hf_on(hf_folder, held, tmp_path / "hf-dequantized")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 17, 40, 90)]
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(NUM_NEW):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            expected.append(ids[len(prompt) :])
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    with LLM(str(folder), max_model_len=160, max_num_batched_tokens=48, num_threads=1) as llm:
        model = llm.core.executor.worker.model  # type: ignore[attr-defined]
        assert all(b.quant_experts is not None for b in _moe_blocks(model))
        assert [r.outputs[0].token_ids for r in llm.generate(prompts, params)] == expected


def _random_experts(rng: np.random.Generator, experts: int, inter: int, hidden: int,
                    types: tuple[Q, Q, Q]) -> list[list[GGUFBlocks]]:  # fmt: skip
    """Per expert its (gate [I, H], up [I, H], down [H, I]) as GGUF blocks."""
    out = []
    for _ in range(experts):
        parts = []
        for proj, qtype in enumerate(types):
            shape = (hidden, inter) if proj == DOWN else (inter, hidden)
            dense = (rng.standard_normal(shape) * 0.2).astype(np.float32)
            raw = gguf.quants.quantize(dense, qtype)
            parts.append(GGUFBlocks(torch.from_numpy(raw), int(qtype), shape))
        out.append(parts)
    return out


def _stacked(experts: list[list[GGUFBlocks]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense (w13 [E, 2I, H], w2 [E, H, I]) of ``experts``."""
    w13 = torch.stack([torch.cat([g.dequantize(), u.dequantize()]) for g, u, _ in experts])
    return w13, torch.stack([d.dequantize() for _, _, d in experts])


@pytest.mark.parametrize("types", [(Q.Q8_0, Q.Q8_0, Q.Q4_0), (Q.Q4_0, Q.Q8_0, Q.Q4_1)])
def test_quant_experts_equal_reference(types) -> None:
    """``QuantExperts`` is ``fused_experts_ref`` on the dequantized weights; with an expert
    map, another rank's experts are skipped."""
    rng = np.random.default_rng(0)
    experts = _random_experts(rng, 8, 32, 64, types)
    w13, w2 = _stacked(experts)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(0))
    probs = torch.rand(37, 8, generator=torch.Generator().manual_seed(1)).softmax(-1)
    weights, ids = probs.topk(2, dim=-1)

    def quant_experts(parts: list[list[GGUFBlocks]]) -> QuantExperts:
        q = QuantExperts(len(parts), 32, 64)
        for e, blocks in enumerate(parts):
            for proj, b in enumerate(blocks):
                q.hold(e, proj, b)
        assert q.complete and q.pack()
        return q

    full = quant_experts(experts)
    expected = fused_experts_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(full(x, weights, ids), expected, atol=1e-5, rtol=1e-5)
    assert full(x[:0], weights[:0], ids[:0]).shape == (0, 64)
    # Experts 4-7 on this rank (local 0-3); pairs routed to 0-3 belong to another rank.
    expert_map = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3], dtype=torch.int32)
    mine = quant_experts(experts[4:])(x, weights, ids, expert_map)
    remote = ids < 4
    ref = fused_experts_ref(
        x, w13[4:], w2[4:], weights.masked_fill(remote, 0.0), (ids - 4).clamp_min(0)
    )
    torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(mine, expected)  # the remote pairs did not count


@pytest.mark.parametrize(
    "parallel,inter,kept",
    [
        (ParallelState(tp_rank=0, tp_size=2), 64, True),  # I / 2 = 32: whole Q8_0 blocks
        (ParallelState(tp_rank=1, tp_size=2), 64, True),
        (ParallelState(tp_rank=1, tp_size=2), 32, False),  # down's columns cut a block
        (ParallelState(ep_rank=1, ep_size=2), 32, True),  # whole experts 4-7
    ],
)
def test_block_keeps_its_slice_quantized(parallel, inter, kept) -> None:
    """A rank's ``SparseMoeBlock`` keeps its TP slice (gate/up rows, down columns along
    whole blocks) or its EP experts quantized, else expands them; its share is the
    reference's over the same slice."""
    arch = ModelArchConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=16, hidden_size=64, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=inter,
    )  # fmt: skip
    block = SparseMoeBlock(arch, parallel)
    experts = _random_experts(np.random.default_rng(1), 8, inter, 64, (Q.Q8_0,) * 3)
    for e, parts in enumerate(experts):
        for proj, blocks in enumerate(parts):
            param, shard = ("w2", None) if proj == DOWN else ("w13", proj)
            if not block.load_quantized_expert(param, e, shard, blocks):
                block.load_expert(param, e, shard, blocks.dequantize())
    assert (block.quant_experts is not None) == kept
    assert (block.w13.numel() == 0) == kept
    w13, w2 = _stacked(experts)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        weights, ids = block.route(x)
        share = block.experts(x, weights, ids)
    if parallel.ep_size > 1:
        remote = ids < 4
        ref = fused_experts_ref(
            x, w13[4:], w2[4:], weights.masked_fill(remote, 0.0), (ids - 4).clamp_min(0)
        )
    else:
        i, r = inter // 2, parallel.tp_rank
        rows = torch.cat(
            [torch.arange(r * i, (r + 1) * i), torch.arange(inter + r * i, inter + (r + 1) * i)]
        )
        ref = fused_experts_ref(x, w13[:, rows], w2[:, :, r * i : (r + 1) * i], weights, ids)
    torch.testing.assert_close(share, ref, atol=1e-5, rtol=1e-5)


def test_gguf_expert_names() -> None:
    assert hf_expert_names("blk.3.ffn_up_exps.weight", 2) == [
        "model.layers.3.mlp.experts.0.up_proj.weight",
        "model.layers.3.mlp.experts.1.up_proj.weight",
    ]
    assert hf_expert_names("blk.0.ffn_gate_exps.weight", 1, "block_sparse_moe") == [
        "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    ]
    assert hf_expert_names("blk.0.ffn_gate.weight", 8) is None
    assert hf_tensor_name("blk.2.ffn_gate_inp.weight") == "model.layers.2.mlp.gate.weight"
    # Mixtral files from before llama.cpp stacked the experts: one tensor per expert
    assert (
        hf_tensor_name("blk.1.ffn_down.7.weight", "block_sparse_moe")
        == "model.layers.1.block_sparse_moe.experts.7.w2.weight"
    )


@pytest.mark.parametrize(
    "drop,message",
    [
        ("blk.1.ffn_up_exps.weight", r"lacks blk\.1\.ffn_up_exps\.weight: the up projections"),
        ("blk.0.ffn_gate_inp.weight", r"layers without an expert router \(blk\.0\.ffn_gate_inp"),
    ],
)
def test_missing_expert_tensor_is_a_clear_error(drop, message, hf_folders, tmp_path) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(path, "mixtral", hf_folders["mixtral"], VARIANTS["q8_0"], drop=drop)
    with pytest.raises(ModelLoadError, match=message):
        prepare_model(str(path), "gguf", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_bf16_and_int8_activations_keep_experts_quantized(mode, hf_folders, tmp_path) -> None:
    """``--dtype bfloat16`` and ``--cpu-activation-quant int8`` keep the experts in their
    blocks too (int8: Q8_0/Q4_0 packed for int8 activations); logits near the exact fp32
    ones, the same greedy choice at nearly every position (neither is exact by design)."""
    from actorserve_kernels.cpu import int8_activations_supported

    if mode == "int8" and not int8_activations_supported():
        pytest.skip("needs AVX-512 VNNI")
    _, folder, _ = _prepared(tmp_path, "mixtral", hf_folders["mixtral"], "mixed")
    exact = _load(folder, quantized=True)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    model = _load(folder, quantized=True, int8=mode == "int8", dtype=dtype)
    for block in _moe_blocks(model):
        quant = block.quant_experts
        assert quant is not None and block.w13.numel() == 0
        assert all(q.int8_activations == (mode == "int8") for q in quant.down)
    tokens = torch.randint(0, 259, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    ours, ref = _our_logits(model, tokens), _our_logits(exact, tokens)
    rel = float((ours - ref).norm() / ref.norm())
    same = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    assert 1e-5 < rel < 0.05 and same > 0.85, (rel, same)
