"""Model loader against independent references: HF transformers reading the same GGUF,
weights we write ourselves in llama.cpp's layout, and HF model classes for names/shapes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from services.config import ModelArchConfig
from services.model_loader import (
    ModelLoadError,
    default_model_path,
    dummy_weights,
    iter_weights,
    load_hf_config,
    load_tokenizer,
    prepare_model,
)
from services.model_loader.gguf_convert import open_gguf
from services.model_loader.gguf_tensors import TESTED_TYPES, dequantize_tensor

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 2024; we've won 3-2.",
    "  leading and trailing spaces   ",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(12345))",
    "中文分词测试：你好，世界！",
    "emoji 🤗🚀👍🏽 and accents: café naïve",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after special<file_sep>more",
    "",
    " ",
    "\n\n\n",
    "numbers 0 1 22 333 4444 3.14159 1e-9",
]


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The default model converted once per session into a private cache: (folder, cache)."""
    cache = tmp_path_factory.mktemp("actorserve-cache")
    return prepare_model(None, cache_dir=cache), cache


@pytest.fixture(scope="module")
def hf_tokenizer(hf_reference):
    """HF's tokenizer built from the same GGUF (conftest loads it once per session)."""
    return hf_reference.tokenizer


@pytest.fixture(scope="module")
def weight_diffs(converted, hf_reference) -> tuple[dict[str, float], set[str], set[str]]:
    """max |ours - HF| per tensor, and the names only one side has. The reference is HF's
    dequantization of the same GGUF (conftest's session-wide ``hf_reference``)."""
    ref = dict(hf_reference.state_dict)
    if hf_reference.arch.tie_word_embeddings:
        ref.pop("lm_head.weight", None)
    ours = dict(iter_weights(converted[0], torch.float32))
    diffs = {
        name: (ours[name] - ref[name]).abs().max().item()
        if ours[name].shape == ref[name].shape
        else float("inf")
        for name in ours.keys() & ref.keys()
    }
    return diffs, set(ours) - set(ref), set(ref) - set(ours)


def test_weights_match_transformers(weight_diffs) -> None:
    diffs, only_ours, only_hf = weight_diffs
    assert not only_ours and not only_hf, (only_ours, only_hf)
    assert len(diffs) == 30 * 9 + 2
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= 1e-6, f"{worst}: {diffs[worst]}"


def test_config_of_default_model(converted) -> None:
    cfg = load_hf_config(converted[0])
    arch = ModelArchConfig.from_hf_config(cfg)
    # SmolLM2-135M-Instruct's published config.json
    assert arch.architecture == "LlamaForCausalLM"
    assert (arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers) == (576, 1536, 30)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (9, 3, 64)
    assert arch.vocab_size == 49152 and arch.tie_word_embeddings
    assert arch.rope_theta == 100000.0 and arch.max_position_embeddings == 8192
    assert arch.bos_token_id == 1 and arch.eos_token_ids == (2,)


def test_tokenizer_matches_transformers(converted, hf_tokenizer) -> None:
    ours = load_tokenizer(converted[0])
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf_tokenizer(text)["input_ids"], text
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ours.encode(TEXTS[6]), False) == TEXTS[6]
    assert ours.bos_token == hf_tokenizer.bos_token and ours.eos_token == hf_tokenizer.eos_token
    assert ours.eos_token_id == hf_tokenizer.eos_token_id == 2
    assert ours.all_special_ids == set(hf_tokenizer.all_special_ids) | set(range(17))
    assert not ours.add_bos_token


def test_tokenizer_digits_are_split_like_llama_cpp(converted) -> None:
    # 'smollm' pre-tokenizer: every digit is its own pre-token, as in SmolLM2's tokenizer.json.
    ours = load_tokenizer(converted[0])
    pieces = [ours.tokenizer.id_to_token(i) for i in ours.encode("year 2024")]
    assert pieces[-4:] == ["2", "0", "2", "4"]


def test_tokenizer_bos_is_prepended_once(converted, tmp_path: Path) -> None:
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((converted[0] / "tokenizer.json").read_text())
    cfg = json.loads((converted[0] / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    tok = load_tokenizer(folder)
    assert tok.encode("hi")[0] == tok.bos_token_id == 1
    assert tok.encode("<|im_start|>hi").count(1) == 1
    assert tok.bos_token_id not in tok.encode("hi", add_special_tokens=False)


def test_second_prepare_hits_cache(converted) -> None:
    folder, cache = converted
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    start = time.monotonic()
    again = prepare_model(str(default_model_path()), "auto", cache_dir=cache)
    assert time.monotonic() - start < 5.0
    assert again == folder and (folder / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [folder.name]  # no temp dirs left


def test_chat_template_carried_over(converted, hf_tokenizer) -> None:
    assert load_tokenizer(converted[0]).chat_template == hf_tokenizer.chat_template


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda d: d / "nope.gguf", "does not exist"),
        (lambda d: _write(d / "junk.gguf", b"not a gguf at all" * 10), "not a GGUF"),
        (lambda d: _write(d / "cut.gguf", _default_model_prefix(4096)), "corrupt or truncated"),
        (lambda d: _write(d / "half.gguf", _tiny_gguf_missing_tail(d)), "corrupt or truncated"),
        (
            lambda d: _write(d / "gpt2" / "config.json", b'{"architectures": ["GPT2LMHeadModel"]}'),
            "GPT2LMHeadModel",
        ),
        (
            lambda d: _write(d / "empty" / "config.json", _tiny_llama_config_json()),
            "no *.safetensors",
        ),
    ],
    ids=[
        "missing",
        "garbage",
        "truncated-header",
        "truncated-data",
        "unsupported-arch",
        "no-weights",
    ],
)
def test_errors_are_one_line(tmp_path: Path, make, fragment: str) -> None:
    path = make(tmp_path)
    target = path.parent if path.name == "config.json" else path
    with pytest.raises(ModelLoadError) as info:
        prepare_model(str(target), cache_dir=tmp_path / "cache")
    msg = str(info.value)
    assert fragment in msg and "\n" not in msg
    cache = tmp_path / "cache"
    assert not (cache.exists() and [p for p in cache.iterdir() if p.is_dir()])  # no half folder


def test_unsupported_gguf_arch(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    _finish(w)
    with pytest.raises(
        ModelLoadError, match="'phi2' is not supported; supported: llama, qwen2, qwen3"
    ):
        prepare_model(str(path), cache_dir=tmp_path / "cache")


def test_open_gguf_reads_what_gguf_reads(tmp_path: Path) -> None:
    """open_gguf's faster header parsing (a plain view of the mapping) gives gguf's own
    reader's fields and tensors: the default model (a 49k vocabulary, merges, Q4_1 and
    f32 tensors) and a small file written here with scalars, strings and arrays."""
    path = tmp_path / "mixed.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("x.u8", 7)
    w.add_int16("x.i16", -300)
    w.add_float64("x.f64", 0.125)
    w.add_bool("x.flag", True)
    w.add_string("x.text", "héllo")
    w.add_array("x.ints", [3, 1, 4, 1, 5])
    w.add_array("x.floats", [0.5, -2.0])
    w.add_array("x.words", ["a", "", "ü", "<|im_end|>"])
    w.add_array("x.nested", [[1, 2], [3]])  # (gguf's own path)
    w.add_tensor("w", np.arange(24, dtype=np.float32).reshape(4, 6))
    _finish(w)
    for file in (default_model_path(), path):
        theirs, ours = gguf.GGUFReader(file, "r"), open_gguf(file)
        assert list(ours.fields) == list(theirs.fields)
        for key, field in theirs.fields.items():
            got = ours.fields[key]
            assert (got.offset, got.types, got.data) == (field.offset, field.types, field.data)
            assert got.contents() == field.contents(), key
        assert ours.data_offset == theirs.data_offset
        assert len(ours.tensors) == len(theirs.tensors) > 0
        for got_t, want in zip(ours.tensors, theirs.tensors, strict=True):
            assert (got_t.name, got_t.tensor_type, got_t.n_bytes, got_t.data_offset) == (
                want.name, want.tensor_type, want.n_bytes, want.data_offset)  # fmt: skip
            assert np.array_equal(got_t.shape, want.shape)
            assert np.array_equal(got_t.data, want.data)


def test_dummy_format_needs_only_config(tmp_path: Path) -> None:
    cfg = _write(tmp_path / "m" / "config.json", _tiny_llama_config_json())
    assert prepare_model(str(cfg), "dummy") == cfg.parent
    assert prepare_model(str(cfg.parent), "dummy") == cfg.parent


@pytest.mark.parametrize("qtype", TESTED_TYPES, ids=lambda q: q.name)
def test_dequantize_each_type(tmp_path: Path, qtype: Q) -> None:
    """Our reading path vs transformers' own dequantizer (an independent implementation),
    and vs the original floats where gguf-py can quantize."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((8, 512)).astype(np.float32)
    if qtype in (Q.Q4_K, Q.Q6_K):
        raw = _random_k_blocks(rng, qtype, x.shape)  # gguf-py cannot quantize K types
    else:
        raw = gguf.quants.quantize(x, qtype)
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("w", raw, raw_dtype=qtype)
    _finish(w)
    (tensor,) = open_gguf(path).tensors
    ours = torch.from_numpy(np.array(dequantize_tensor(tensor), copy=True))
    if qtype == Q.BF16:
        ours = ours.view(torch.int16).view(torch.bfloat16)
    assert tuple(ours.shape) == x.shape
    if qtype in (Q.F32, Q.F16):
        ref = torch.from_numpy(raw.astype(np.float32))
    elif qtype == Q.BF16:  # bf16 is the top half of an f32
        ref = torch.from_numpy((raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32))
    else:
        ref = hf_dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(qtype))
    assert torch.equal(ours.float().reshape(-1), ref.float().reshape(-1))
    if qtype not in (Q.Q4_K, Q.Q6_K):
        tol = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 0.03}.get(qtype, 0.35)
        assert (ours.float() - torch.from_numpy(x)).abs().max().item() <= tol


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_dummy_weights_match_hf_names_and_shapes(arch: str) -> None:
    import transformers

    cfg = json.loads(_tiny_llama_config_json())
    cfg["architectures"] = [arch]
    cfg["head_dim"] = 24  # differs from hidden/heads, as in Qwen3
    model_type = {
        "LlamaForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
    }[arch]
    hf_cfg = transformers.AutoConfig.for_model(
        model_type, **{k: v for k, v in cfg.items() if k != "architectures"}
    )
    ref = getattr(transformers, arch)(hf_cfg).state_dict()
    ours = dict(dummy_weights(ModelArchConfig.from_hf_config(cfg), torch.bfloat16, seed=3))
    ref.pop("lm_head.weight")  # tied: HF lists it, checkpoints do not store it
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in ref.items()}
    assert all(v.dtype == torch.bfloat16 for v in ours.values())
    again = dict(dummy_weights(ModelArchConfig.from_hf_config(cfg), torch.bfloat16, seed=3))
    assert all(torch.equal(ours[k], again[k]) for k in ours)
    assert torch.equal(
        ours["model.norm.weight"], torch.ones(cfg["hidden_size"], dtype=torch.bfloat16)
    )


# -- helpers ---------------------------------------------------------------------------------


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _default_model_prefix(size: int) -> bytes:
    with open(default_model_path(), "rb") as f:
        return f.read(size)


def _tiny_gguf_missing_tail(tmp: Path) -> bytes:
    """A well-formed header whose tensor data is cut short."""
    w = gguf.GGUFWriter(str(tmp / "whole.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.ones((64, 32), np.float32))
    _finish(w)
    data = (tmp / "whole.gguf").read_bytes()
    return data[: len(data) - 1024]


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_llama_config_json() -> bytes:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
    }
    return json.dumps(cfg).encode()


def _random_k_blocks(
    rng: np.random.Generator,
    qtype: Q,
    shape: tuple[int, int],
    scale: tuple[float, float] = (0.001, 0.1),
) -> np.ndarray:
    """Valid K-quant blocks: random quants and scales, finite fp16 super-block scales drawn
    from ``scale``."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = shape[0] * shape[1] // block
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    scale = rng.uniform(*scale, (n_blocks, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        raw[:, 0:4] = scale  # d, dmin
    else:
        raw[:, -2:] = scale[:, :2]  # d is the last field of Q6_K
    return raw.reshape(shape[0], -1)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute, which our loader must undo
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_gguf_conversion_recovers_hf_weights(tmp_path: Path, model_type: str) -> None:
    """Write an HF model's weights as llama.cpp would (names, q/k permutation for llama, metadata),
    convert, and get exactly the HF weights and an equivalent config back."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from services.model_loader.gguf_tokenizer import _byte_spelling

    tokens = [_byte_spelling()[b] for b in range(256)] + ["Ġt", "he", "<|endoftext|>"]
    head_dim = 24 if model_type == "qwen3" else 16
    kwargs = dict(vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-5,
                  max_position_embeddings=4096, tie_word_embeddings=model_type != "llama")  # fmt: skip
    if model_type == "llama":
        kwargs["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                  "rope_theta": 500000.0}  # fmt: skip
    hf_cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM}[model_type]  # fmt: skip
    ref = {k: v.float() for k, v in model_cls(hf_cfg).state_dict().items()}
    if hf_cfg.tie_word_embeddings:
        ref.pop("lm_head.weight")
    for k in ref:  # HF initialises norms to ones and biases to zeros: make them informative
        if ref[k].dim() == 1:
            ref[k] = torch.randn_like(ref[k])

    path = tmp_path / f"{model_type}.gguf"
    w = gguf.GGUFWriter(str(path), model_type)
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_block_count(2)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0 if model_type == "llama" else 10000.0)
    if model_type == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if model_type != "llama" else "llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([1] * 258 + [3])
    w.add_token_merges(["Ġ t", "h e"])
    w.add_eos_token_id(258)
    w.add_chat_template("{{ messages[0]['content'] }}")
    for name, tensor in ref.items():
        array = tensor.numpy()
        if model_type == "llama" and (".q_proj." in name or ".k_proj." in name):
            array = _llama_cpp_permute(array, 4 if ".q_proj." in name else 2)
        w.add_tensor(_gguf_name(name), array.copy())
    if model_type == "llama":
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
        base = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        w.add_tensor("rope_freqs.weight", (base / scaled.double()).float().numpy())
    _finish(w)

    folder = prepare_model(str(path), "gguf", cache_dir=tmp_path / "cache")
    ours = dict(iter_weights(folder, torch.float32))
    assert ours.keys() == ref.keys()
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name
    cfg = load_hf_config(folder)
    got, want = (
        ModelArchConfig.from_hf_config(cfg),
        ModelArchConfig.from_hf_config({**hf_cfg.to_dict(), "architectures": [model_cls.__name__]}),
    )
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
                  "attention_bias", "qk_norm", "max_position_embeddings"):  # fmt: skip
        assert getattr(got, field) == getattr(want, field), field
    if model_type == "llama":
        expected = {k: v for k, v in kwargs["rope_scaling"].items() if k != "rope_theta"}
        assert cfg["rope_scaling"] == expected
    tok = load_tokenizer(folder)
    assert tok.encode("the t<|endoftext|>") == [ord("t"), 257, 256, 258]  # t|he, Ġt, special
    assert tok.decode([ord("t"), 257, 256, 258], skip_special_tokens=False) == "the t<|endoftext|>"
    assert tok.eos_token == "<|endoftext|>" and tok.chat_template == "{{ messages[0]['content'] }}"


_MERGES = ["Ġ 1", "Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "1 2", "Ġ Ġ", "Ċ Ċ", "o n", "' S"]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2"])
def test_pre_tokenizers_match_transformers(tmp_path: Path, pre: str) -> None:
    """Our split regex per ``tokenizer.ggml.pre`` vs HF's GGUF tokenizer, on a tiny vocabulary
    whose merges (digits, runs of spaces and newlines) make the regexes' differences visible."""
    from transformers import AutoTokenizer

    from services.model_loader.gguf_tokenizer import _byte_spelling, build_tokenizer

    merges = list(dict.fromkeys(_MERGES))
    tokens = [_byte_spelling()[b] for b in range(256)] + [m.replace(" ", "") for m in merges]
    tokens += ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>"]
    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2" if pre == "qwen2" else "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 4) + [3] * 4)
    w.add_token_merges(merges)
    w.add_eos_token_id(len(tokens) - 2)
    _finish(w)
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = build_tokenizer({f.name: f.contents() for f in open_gguf(path).fields.values()})
    for text in TEXTS + ["12 123 1234 in the there  \n\n\n  a1", "x  \n  \n y", "IT'S it's"]:
        assert ours.encode(text).ids == ref(text)["input_ids"], (pre, text)
