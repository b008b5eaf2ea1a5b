"""GGUF models served from their quantized blocks (``--quantization gguf``, the default for a
GGUF model on CPU): the same logits as the dequantized weights, one copy of each weight.

References: HF transformers on the dequantized default model, and our dense load path over
the same file (itself checked against HF in test_model.py and test_model_loader.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from actorserve_kernels.cpu import QUANT_TYPES, int8_activations_supported, load_cpu_ops
from services.config import ModelArchConfig
from services.gpu_worker.attention.torch_backend import TorchAttentionBackend
from services.gpu_worker.model.layers import Linear, VocabParallelEmbedding
from services.gpu_worker.model.llama import LlamaForCausalLM
from services.model_loader import iter_weights, load_hf_config, prepare_model
from services.model_loader.gguf_convert import gguf_source, iter_gguf_weights
from services.model_loader.gguf_tensors import GGUFBlocks
from tests.test_model import _our_logits
from tests.test_model_loader import _random_k_blocks

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="the C++ CPU kernels did not build")


def _load(
    folder: Path, quantized: bool, int8: bool = False, dtype: torch.dtype = torch.float32
) -> LlamaForCausalLM:
    cfg = load_hf_config(folder)
    model = LlamaForCausalLM(ModelArchConfig.from_hf_config(cfg), TorchAttentionBackend).eval()
    model = model.to(dtype)
    model.int8_activations = int8
    source = gguf_source(folder)
    assert source is not None
    if quantized:
        model.load_weights(iter_gguf_weights(source, cfg, dtype, QUANT_TYPES.values()))
    else:
        model.load_weights(iter_weights(folder, dtype))
    return model


def _quantized_modules(model: LlamaForCausalLM) -> dict[str, str]:
    """Module name -> ggml type name of every module computing from quantized blocks."""
    names = {v: k for k, v in QUANT_TYPES.items()}
    return {
        name: names[m.quant.ggml_type]
        for name, m in model.named_modules()
        if isinstance(m, Linear | VocabParallelEmbedding) and m.quant is not None
    }


def test_default_model_quantized_matches_hf(hf_reference, long_prompt) -> None:
    """The default Q4_1 model read natively: every matrix stays in its blocks (one copy,
    ~1/5 of fp32), and the logits are HF's on the dequantized weights."""
    model = _load(prepare_model(None), quantized=True)
    quantized = _quantized_modules(model)
    linears = [n for n, m in model.named_modules() if isinstance(m, Linear)]
    assert set(linears) <= set(quantized) and quantized["model.embed_tokens"] == "Q8_0"
    assert {quantized[n] for n in linears} == {"Q4_1"}
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    packed_bytes = sum(
        m.quant.packed.numel() for m in model.modules() if getattr(m, "quant", None) is not None
    )
    assert dense_bytes < 1_000_000 and packed_bytes < 100_000_000  # fp32 would be 540 MB
    with torch.inference_mode():
        expected = hf_reference.model(torch.tensor([long_prompt])).logits[0]
    ours = _our_logits(model, long_prompt)
    # Same tolerance as the dense model against HF (test_prefill_logits_match_hf).
    torch.testing.assert_close(ours, expected, atol=5e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def _tiny_llama_gguf(
    path: Path,
    *,
    hidden: int,
    inter: int,
    head_dim: int,
    embd: Q,
    output: Q,
    layers: dict[int, tuple[Q, Q, Q, Q, Q]],
) -> None:
    """A small Llama GGUF (4 query heads, 2 KV heads, a vocabulary of 259: not a multiple of
    16 rows, an untied output) with the given type per matrix: layers[i] = (q and k, v, o,
    gate and up, down). K-quant matrices are random valid blocks (gguf cannot quantize to
    them) with super-block scales small enough for sane activations."""
    from services.model_loader.gguf_tokenizer import _byte_spelling

    tokens = [_byte_spelling()[b] for b in range(256)] + ["Ġt", "he", "<|endoftext|>"]
    vocab, heads, kv_heads = len(tokens), 4, 2
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_context_length, 256), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, inter), (w.add_block_count, len(layers)),
                       (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0)):  # fmt: skip
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([1] * 258 + [3])
    w.add_token_merges(["Ġ t", "h e"])
    w.add_eos_token_id(258)

    def matrix(name: str, rows: int, cols: int, qtype: Q) -> None:
        if qtype in (Q.Q4_K, Q.Q6_K):
            raw = _random_k_blocks(rng, qtype, (rows, cols), scale=(1e-4, 1e-3))
            w.add_tensor(name, raw, raw_dtype=qtype)
            return
        dense = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
        if qtype == Q.F16:
            w.add_tensor(name, dense.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(dense, qtype), raw_dtype=qtype)

    matrix("token_embd.weight", vocab, hidden, embd)
    matrix("output.weight", vocab, hidden, output)
    w.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
    for layer, (qk, v, o, mlp, down) in layers.items():
        p = f"blk.{layer}."
        matrix(p + "attn_q.weight", heads * head_dim, hidden, qk)
        matrix(p + "attn_k.weight", kv_heads * head_dim, hidden, qk)
        matrix(p + "attn_v.weight", kv_heads * head_dim, hidden, v)
        matrix(p + "attn_output.weight", hidden, heads * head_dim, o)
        matrix(p + "ffn_gate.weight", inter, hidden, mlp)
        matrix(p + "ffn_up.weight", inter, hidden, mlp)
        matrix(p + "ffn_down.weight", hidden, inter, down)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + norm + ".weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_mixed_gguf(path: Path) -> None:
    """A 3-layer Llama GGUF with every case the loader distinguishes: fused shards of one type
    (layer 1), of mixed quantized types (layer 0's q/k/v), partly dense (layer 2's q/k/v), an
    F16 matrix, Q8_0/Q4_0/Q4_1. Layer 2's q/k come dense (F16) and its v quantized, as
    llama.cpp's K-quant mixes do (Q6_K falling back to Q8_0)."""
    layers = {0: (Q.Q4_1, Q.Q8_0, Q.Q4_0, Q.F16, Q.Q8_0), 1: (Q.Q4_0, Q.Q4_0, Q.Q4_0, Q.Q4_1, Q.Q8_0),
              2: (Q.F16, Q.Q8_0, Q.Q4_1, Q.Q8_0, Q.Q8_0)}  # fmt: skip
    _tiny_llama_gguf(
        path, hidden=64, inter=96, head_dim=16, embd=Q.Q8_0, output=Q.Q4_0, layers=layers
    )


def _tiny_k_quant_gguf(path: Path, *, q6k_v: bool = True) -> None:
    """Llama.cpp's Q4_K_M pattern: Q4_K matrices, Q6_K for down (and v unless ``q6k_v`` is
    False) in layer 0 and for the embedding and output (widths multiples of 256, the
    K-quant super-block)."""
    v = Q.Q6_K if q6k_v else Q.Q4_K
    layers = {0: (Q.Q4_K, v, Q.Q4_K, Q.Q4_K, Q.Q6_K), 1: (Q.Q4_K, Q.Q4_K, Q.Q4_K, Q.Q4_K, Q.Q4_K)}
    _tiny_llama_gguf(
        path, hidden=256, inter=512, head_dim=64, embd=Q.Q6_K, output=Q.Q6_K, layers=layers
    )


def _prepared(tmp_path: Path, write: Callable[[Path], None]) -> Path:
    """The converted folder of a GGUF that ``write`` makes."""
    path = tmp_path / "model.gguf"
    write(path)
    return prepare_model(str(path), "gguf", cache_dir=tmp_path / "cache")


def test_mixed_types_quantized_equal_dense(tmp_path: Path) -> None:
    folder = _prepared(tmp_path, _tiny_mixed_gguf)
    quant, dense = _load(folder, quantized=True), _load(folder, quantized=False)
    assert _quantized_modules(quant) == {
        "model.embed_tokens": "Q8_0",
        "lm_head": "Q4_0",
        "model.layers.0.self_attn.o_proj": "Q4_0",
        "model.layers.0.mlp.down_proj": "Q8_0",
        "model.layers.1.self_attn.qkv_proj": "Q4_0",
        "model.layers.1.self_attn.o_proj": "Q4_0",
        "model.layers.1.mlp.gate_up_proj": "Q4_1",
        "model.layers.1.mlp.down_proj": "Q8_0",
        "model.layers.2.self_attn.o_proj": "Q4_1",
        "model.layers.2.mlp.gate_up_proj": "Q8_0",
        "model.layers.2.mlp.down_proj": "Q8_0",
    }  # layer 0: q/k/v of two types and an F16 MLP stay dense; layer 2: q/k/v partly F16
    tokens = np.random.default_rng(1).integers(0, 259, 70).tolist()
    torch.testing.assert_close(
        _our_logits(quant, tokens), _our_logits(dense, tokens), atol=1e-5, rtol=0
    )


def test_k_quants_quantized_equal_dense(tmp_path: Path) -> None:
    """Q4_K and Q6_K matrices (a Q4_K_M-style mix) stay in their blocks, fused q/k/v of mixed
    K types expanded, and give the dense weights' logits: prompts through the kernels'
    register passes (5 tokens) and their expand-and-GEMM path (70 tokens)."""
    folder = _prepared(tmp_path, _tiny_k_quant_gguf)
    quant, dense = _load(folder, quantized=True), _load(folder, quantized=False)
    assert _quantized_modules(quant) == {
        "model.embed_tokens": "Q6_K",
        "lm_head": "Q6_K",
        "model.layers.0.self_attn.o_proj": "Q4_K",
        "model.layers.0.mlp.gate_up_proj": "Q4_K",
        "model.layers.0.mlp.down_proj": "Q6_K",
        "model.layers.1.self_attn.qkv_proj": "Q4_K",
        "model.layers.1.self_attn.o_proj": "Q4_K",
        "model.layers.1.mlp.gate_up_proj": "Q4_K",
        "model.layers.1.mlp.down_proj": "Q4_K",
    }
    for n in (5, 70):
        tokens = np.random.default_rng(n).integers(0, 259, n).tolist()
        ours, ref = _our_logits(quant, tokens), _our_logits(dense, tokens)
        scale = float(ref.abs().max())  # logits of tens: fp32 rounding is ~1e-6 of that
        assert scale > 1.0  # not a degenerate all-zero model
        torch.testing.assert_close(ours, ref, atol=2e-6 * scale, rtol=0)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K])
def test_gguf_blocks_narrow(qtype: Q) -> None:
    """A TP rank's slice of a quantized matrix: rows always, columns along whole blocks."""
    rng = np.random.default_rng(2)
    if qtype == Q.Q4_K:  # gguf cannot quantize K-quants: random valid blocks
        raw = _random_k_blocks(rng, qtype, (8, 512))
    else:
        raw = gguf.quants.quantize(rng.standard_normal((8, 512)).astype(np.float32), qtype)
    blocks = GGUFBlocks(torch.from_numpy(raw), int(qtype), (8, 512))
    full = blocks.dequantize()
    rows = blocks.narrow(0, 2, 3)
    assert rows is not None and torch.equal(rows.dequantize(), full[2:5])
    size = blocks.block_size
    cols = blocks.narrow(1, size, size)
    assert cols is not None and torch.equal(cols.dequantize(), full[:, size : 2 * size])
    assert blocks.narrow(1, size // 2, size) is None  # cuts a block: the loader expands it


@pytest.mark.parametrize(
    "model_kind",
    ["default", "default-int8", "default-bf16", "k-quants", "default-fp8kv", "default-int8kv"],
)
def test_fused_decode_layers_equal_python_layers(model_kind: str, tmp_path: Path) -> None:
    """A decode-only step through ``decode_layers`` (one C++ call for every layer) gives the
    Python layers' logits and cache contents bit for bit: the same kernels in the same order,
    for the default model (Q4_1, with fp32, int8 or bf16 activations; over an fp8 or int8 KV
    cache) and a Q4_K/Q6_K one."""
    from actorserve_kernels import kv_quant
    from services.gpu_worker.model_runner import build_attention_metadata
    from tests.test_model import make_kv_cache

    if model_kind == "default-int8" and not int8_activations_supported():
        pytest.skip("needs AVX-512 VNNI")
    if model_kind.startswith("default"):
        folder = prepare_model(None)
    else:
        # fused q/k/v of one type
        folder = _prepared(tmp_path, lambda path: _tiny_k_quant_gguf(path, q6k_v=False))
    dtype = torch.bfloat16 if model_kind == "default-bf16" else torch.float32
    model = _load(folder, quantized=True, int8=model_kind == "default-int8", dtype=dtype)
    arch, block_size = model.arch, 16
    lens = np.array([20, 37, 50])
    tables = np.arange(3 * 4, dtype=np.int32).reshape(3, 4)  # 4 blocks (64 slots) each
    caches = [make_kv_cache(12, block_size, arch.num_key_value_heads, arch.head_dim, dtype)
              for _ in range(arch.num_hidden_layers)]  # fmt: skip
    kv_dtype = {"default-fp8kv": "fp8", "default-int8kv": "int8"}.get(model_kind)
    if kv_dtype is not None:  # quantized caches, fp8 scales other than 1.0
        width = kv_quant.row_width(kv_dtype, arch.head_dim)
        shape = (12, block_size, arch.num_key_value_heads, width)
        storage = kv_quant.storage_dtype(kv_dtype, dtype)
        caches = [(torch.zeros(shape, dtype=storage), torch.zeros(shape, dtype=storage))
                  for _ in range(arch.num_hidden_layers)]  # fmt: skip
        for layer in model.model.layers:
            layer.self_attn.k_scale.fill_(0.07)
            layer.self_attn.v_scale.fill_(0.03)
    rng = np.random.default_rng(3)

    def step(
        caches: list, computed: np.ndarray, scheduled: np.ndarray, fused: bool
    ) -> torch.Tensor:
        meta, _, positions = build_attention_metadata(
            computed, scheduled, tables, block_size, torch.device("cpu")
        )
        ids = torch.from_numpy(rng.integers(0, arch.vocab_size, int(scheduled.sum())))
        model.model.fused_decode = fused
        with torch.inference_mode():
            return model.compute_logits(model(ids, torch.from_numpy(positions), meta, caches))

    step(caches, np.zeros(3, np.int64), lens, fused=True)  # prefill: not fused either way
    assert model.model._fused is False  # undecided: no decode step yet
    twin = [(k.clone(), v.clone()) for k, v in caches]
    state = rng.bit_generator.state
    python = step(caches, lens, np.ones(3, np.int64), fused=False)
    rng.bit_generator.state = state  # the same next tokens
    fused = step(twin, lens, np.ones(3, np.int64), fused=True)
    assert model.model._fused is not None and model.model._fused is not False
    assert torch.equal(fused, python)
    for (k1, v1), (k2, v2) in zip(caches, twin, strict=True):
        if kv_dtype is not None:  # the same bytes
            assert torch.equal(kv_quant.as_bytes(k1), kv_quant.as_bytes(k2))
            assert torch.equal(kv_quant.as_bytes(v1), kv_quant.as_bytes(v2))
            continue
        assert torch.equal(k1.nan_to_num(), k2.nan_to_num()) and torch.equal(
            v1.nan_to_num(), v2.nan_to_num()
        )


def test_source_follows_the_file_prepared_last(tmp_path: Path) -> None:
    """Copies of one GGUF share a converted folder; the quantized weights are read from the
    copy prepared last, and not from a file that changed since."""
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    a.parent.mkdir()
    b.parent.mkdir()
    _tiny_mixed_gguf(a)
    b.write_bytes(a.read_bytes())
    cache = tmp_path / "cache"
    folder = prepare_model(str(a), "gguf", cache_dir=cache)
    assert gguf_source(folder) == a.resolve()
    assert prepare_model(str(b), "gguf", cache_dir=cache) == folder
    a.unlink()
    assert gguf_source(folder) == b.resolve()
    st = b.stat()  # same size, another time stamp: not the file that was prepared
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert gguf_source(folder) is None


def test_fused_decode_layers_refuses_a_bad_slot() -> None:
    """A slot outside the cache is a clear error, not a write past it."""
    from services.gpu_worker.model.fused_decode import FusedDecodeWeights

    model = _load(prepare_model(None), quantized=True)
    fused = FusedDecodeWeights.of(model.model)
    assert fused is not None
    arch = model.arch
    caches = [torch.zeros(2, 16, arch.num_key_value_heads, arch.head_dim)] * arch.num_hidden_layers
    cos = torch.ones(1, 1, arch.head_dim)
    with pytest.raises(RuntimeError, match="slot 32 not in \\[0, 32\\)"):
        torch.ops.actorserve_cpu.decode_layers(
            torch.zeros(1, arch.hidden_size), fused.weights, fused.types, fused.dims,
            caches, caches, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([32]),
            torch.tensor([1]), cos, cos, fused.num_heads, fused.num_kv_heads, fused.eps, fused.scale,
        )  # fmt: skip


@pytest.mark.skipif(not int8_activations_supported(), reason="needs AVX-512 VNNI")
def test_int8_activations_default_model(long_prompt) -> None:
    """``--cpu-activation-quant int8``: every quantized linear packed for int8 activations
    (the embedding lookups stay exact); logits near the exact ones, the same greedy choice
    at nearly every position. Not exact by design: bench/perplexity.py measures the cost."""
    folder = prepare_model(None)
    exact, model = _load(folder, quantized=True), _load(folder, quantized=True, int8=True)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and model.int8_linears() == len(linears)
    embed = model.model.embed_tokens.quant
    assert embed is not None and not embed.int8_activations
    ours, ref = _our_logits(model, long_prompt), _our_logits(exact, long_prompt)
    rel = float((ours - ref).norm() / ref.norm())
    same = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    assert 1e-5 < rel < 0.05 and same > 0.9, (rel, same)


def test_bf16_model_keeps_quantized_weights(long_prompt) -> None:
    """``--dtype bfloat16`` on a GGUF model: the same quantized blocks (one copy, no bf16
    expansion) and bf16 activations; logits near the exact fp32 ones (bf16 rounds), the
    same greedy choice at nearly every position."""
    folder = prepare_model(None)
    exact = _load(folder, quantized=True)
    model = _load(folder, quantized=True, dtype=torch.bfloat16)
    assert _quantized_modules(model) == _quantized_modules(exact)
    assert all(
        p.dtype == torch.bfloat16 and (p.numel() == 0) == (name in _dropped(exact))
        for name, p in model.named_parameters()
    )
    ours, ref = _our_logits(model, long_prompt), _our_logits(exact, long_prompt)
    assert ours.dtype == torch.float32
    assert not torch.equal(ours, ours.bfloat16().float())  # the head's fp32, not rounded
    rel = float((ours - ref).norm() / ref.norm())
    same = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    assert 1e-4 < rel < 0.05 and same > 0.85, (rel, same)


def _dropped(model: LlamaForCausalLM) -> set[str]:
    """Parameters emptied because their module computes from quantized blocks."""
    return {name for name, p in model.named_parameters() if p.numel() == 0}


def test_int8_activations_need_quantized_weights() -> None:
    from launch.llm import LLM
    from services.config import ConfigError

    # refused by the configuration, before the weights load (issue 34)
    with pytest.raises(ConfigError, match="applies to a GGUF model's quantized matrices"):
        LLM(quantization="none", cpu_activation_quant="int8", max_model_len=256)


def test_int8_activations_need_vnni(monkeypatch: pytest.MonkeyPatch) -> None:
    import actorserve_kernels.cpu
    from launch.llm import LLM
    from services.model_loader import ModelLoadError

    monkeypatch.setattr(actorserve_kernels.cpu, "int8_activations_supported", lambda: False)
    with pytest.raises(ModelLoadError, match="needs a CPU with AVX-512 VNNI"):
        LLM(cpu_activation_quant="int8", max_model_len=256)


def test_bf16_warns_without_bf16_dot_products(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``--dtype bfloat16`` on a CPU that would emulate bf16 products says it will be slow."""
    import actorserve_kernels.cpu as kc
    from launch.llm import LLM, SamplingParams

    monkeypatch.setattr(kc, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert not kc.bf16_dot_products()
    with caplog.at_level("WARNING"):
        llm = LLM(dtype="bfloat16", max_model_len=128)
    assert "without AVX512_BF16 or AMX" in caplog.text
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
