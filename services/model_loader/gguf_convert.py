"""Convert a GGUF file, once, into a Hugging Face folder that the rest of the engine loads.

The folder holds ``config.json``, ``model.safetensors`` (or shards with an index),
``tokenizer.json`` and ``tokenizer_config.json``. It is built in a temporary sibling directory
and renamed into place, so a folder that exists is complete, and two processes converting the
same file at once both end up with one valid folder.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFReader, ReaderTensor
from safetensors.torch import save_file

from services.model_loader.errors import ModelLoadError
from services.model_loader.gguf_file import open_gguf as open_gguf  # re-exported
from services.model_loader.gguf_record import gguf_source as gguf_source  # re-exported
from services.model_loader.gguf_record import record_source as record_source  # re-exported
from services.model_loader.gguf_record import source_record
from services.model_loader.gguf_tensors import (
    IGNORED_TENSORS,
    ROUTER_TENSOR,
    STACKED_EXPERT_TENSORS,
    GGUFBlocks,
    dequantize_array,
    dequantize_tensor,
    hf_expert_names,
    hf_tensor_name,
    to_torch,
    unpermute_rotary,
)
from services.model_loader.gguf_tokenizer import build_tokenizer_files

GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),  # Mixtral too, when it has experts
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
SHARD_BYTES = 4 << 30
_PROGRESS_EVERY = 50


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value field as a plain Python value (arrays as lists)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception:
            continue  # a field we cannot decode is one we do not need
    return meta


def hf_config_from_gguf(meta: dict[str, Any], tensors: dict[str, ReaderTensor]) -> dict[str, Any]:
    """HF ``config.json`` contents for the model a GGUF file describes."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    try:
        heads = int(get("attention.head_count"))
        kv_heads = int(get("attention.head_count_kv", heads))
        k_rows = int(tensors["blk.0.attn_k.weight"].shape[1])
        config: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "vocab_size": int(get("vocab_size") or tensors["token_embd.weight"].shape[1]),
            "hidden_size": int(get("embedding_length")),
            "intermediate_size": int(
                get("feed_forward_length") or get("expert_feed_forward_length")
            ),
            "num_hidden_layers": int(get("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            # not always hidden/heads (Qwen3); the k projection's rows always tell it
            "head_dim": int(get("attention.key_length") or k_rows // kv_heads),
            "hidden_act": "silu",
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(get("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in tensors,
            "torch_dtype": "float32",  # quantized tensors are expanded to fp32
        }
    except (TypeError, KeyError) as e:
        missing = e.args[0] if isinstance(e, KeyError) else "a required model key"
        raise ModelLoadError(
            f"GGUF file lacks {missing} needed to build the model config"
        ) from None
    config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "llama":
        config["mlp_bias"] = False
    if get("expert_count") or arch == "qwen3moe":
        config.update(_moe_config(meta, arch, tensors, config))
    rope_scaling = _rope_scaling(meta, arch, tensors, config["head_dim"], config["rope_theta"])
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    for hf_key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        if (value := meta.get(f"tokenizer.ggml.{gguf_key}")) is not None:
            config[hf_key] = int(value)
    eos = [
        int(v)
        for k in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (v := meta.get(f"tokenizer.ggml.{k}")) is not None
    ]
    if eos:
        eos = list(dict.fromkeys(eos))
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


def _moe_config(
    meta: dict[str, Any], arch: str, tensors: dict[str, ReaderTensor], config: dict[str, Any]
) -> dict[str, Any]:
    """The mixture-of-experts fields of the HF config, as llama.cpp reads the file.

    ``qwen3moe`` becomes Qwen3-MoE; ``llama`` with ``llama.expert_count`` is Mixtral as
    llama.cpp's converter writes it. Routing is softmax, top ``expert_used_count``,
    renormalised: llama.cpp's graph renormalises for both architectures whatever HF's
    ``norm_topk_prob`` was (its converter does not write it for them); for Qwen3-MoE an
    explicit ``qwen3moe.expert_weights_norm`` is honoured. Qwen3-MoE layers without a router
    (``blk.N.ffn_gate_inp``) become ``mlp_only_layers`` with a dense MLP.
    """

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    experts, used = get("expert_count"), get("expert_used_count")
    for key, value in (("expert_count", experts), ("expert_used_count", used)):
        if value is None:
            raise ModelLoadError(
                f"GGUF file lacks {arch}.{key} needed to build the mixture-of-experts config"
            )
    experts, used = int(experts), int(used)
    gating = get("expert_gating_func")
    if gating is not None and int(gating) != ExpertGatingFuncType.SOFTMAX:
        raise ModelLoadError(
            f"GGUF file routes its experts with gating function {int(gating)}; supported: "
            f"softmax ({int(ExpertGatingFuncType.SOFTMAX)})"
        )
    if int(get("expert_shared_count") or 0):
        raise ModelLoadError("GGUF file has shared experts, which are not supported")
    layers = config["num_hidden_layers"]
    moe_layers = [i for i in range(layers) if f"blk.{i}.{ROUTER_TENSOR}.weight" in tensors]
    if not moe_layers:
        raise ModelLoadError(
            f"GGUF file says {arch}.expert_count = {experts} but has no expert router "
            f"(blk.N.{ROUTER_TENSOR}.weight)"
        )
    for layer in moe_layers:
        _check_expert_tensors(tensors, layer, experts)
    width = get("expert_feed_forward_length")
    if width is None:  # Mixtral: the experts' width is feed_forward_length
        stacked = tensors.get(f"blk.{moe_layers[0]}.ffn_gate_exps.weight")
        width = int(stacked.shape[1]) if stacked is not None else config["intermediate_size"]
    if arch == "qwen3moe":
        return {
            "num_experts": experts,
            "num_experts_per_tok": used,
            "moe_intermediate_size": int(width),
            "norm_topk_prob": bool(get("expert_weights_norm", True)),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(layers) if i not in moe_layers],
        }
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture {arch!r} with experts is not supported")
    if len(moe_layers) != layers:
        dense = sorted(set(range(layers)) - set(moe_layers))
        raise ModelLoadError(
            f"GGUF file (llama with experts: Mixtral) has layers without an expert router "
            f"(blk.{dense[0]}.{ROUTER_TENSOR}.weight); Mixtral's layers all have experts"
        )
    config.pop("mlp_bias", None)
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": int(width),
        "num_local_experts": experts,
        "num_experts_per_tok": used,
    }


def _check_expert_tensors(tensors: dict[str, ReaderTensor], layer: int, experts: int) -> None:
    """Every projection of MoE layer ``layer``'s experts is there: stacked
    (``blk.N.ffn_gate_exps``, ``experts`` of them) or one tensor per expert (older files)."""
    for stacked in STACKED_EXPERT_TENSORS:
        name = f"blk.{layer}.{stacked}.weight"
        t = tensors.get(name)
        if t is not None:
            if len(t.shape) != 3 or int(t.shape[2]) != experts:
                raise ModelLoadError(
                    f"GGUF tensor {name} has shape {tuple(int(d) for d in reversed(t.shape))}; "
                    f"expected {experts} stacked experts (expert_count)"
                )
            continue
        kind = stacked.removesuffix("_exps")
        if not all(f"blk.{layer}.{kind}.{e}.weight" in tensors for e in range(experts)):
            raise ModelLoadError(
                f"GGUF file lacks {name}: the {kind.removeprefix('ffn_')} projections of "
                f"the experts of MoE layer {layer}"
            )


def _rope_scaling(
    meta: dict[str, Any], arch: str, tensors: dict[str, ReaderTensor], head_dim: int, theta: float
) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind in ("linear", "yarn") and factor:
        out: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        if kind == "yarn" and orig:
            out["original_max_position_embeddings"] = int(orig)
        return out
    if "rope_freqs.weight" in tensors:
        # Llama 3.1+ stores no scaling metadata, only the per-frequency divisors it computed.
        freqs = dequantize_tensor(tensors["rope_freqs.weight"]).astype(np.float64).reshape(-1)
        return _llama3_params_from_freqs(freqs, head_dim, theta)
    return None


def _llama3_params_from_freqs(freqs: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """Recover HF's ``llama3`` rope_scaling from llama.cpp's ``rope_freqs`` tensor.

    The divisors depend on factor (the largest divisor) and on low/high frequency factors and
    the original context, which the file does not store; Meta used the same three values for
    every Llama 3.x (1, 4, 8192), so we check that they reproduce the tensor exactly.
    """
    factor, low, high, orig = float(freqs.max()), 1.0, 4.0, 8192
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < orig / high,
        1.0,
        np.where(wavelen > orig / low, factor, 1.0 / ((1 - smooth) / factor + smooth)),
    )
    if expected.shape != freqs.shape or not np.allclose(expected, freqs, rtol=1e-3):
        raise ModelLoadError(
            "GGUF rope_freqs tensor does not match Llama-3 rope scaling with the standard "
            "low/high frequency factors (1, 4) and original context 8192; cannot convert it"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": orig,
    }


def iter_hf_tensors(
    reader: GGUFReader, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, dense tensor) for every model tensor in the file."""
    for name, tensor in _hf_tensors(reader, config, ()):
        assert isinstance(tensor, torch.Tensor)
        yield name, tensor


def _hf_tensors(
    reader: GGUFReader, config: dict[str, Any], keep: Collection[int]
) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """(HF name, tensor) for every model tensor in the file: dense, except matrices whose
    ggml type is in ``keep``, which come as their blocks (``GGUFBlocks``). A stacked expert
    tensor comes as its experts' matrices, one by one."""
    permute = config["model_type"] in ("llama", "mixtral")  # llama.cpp permutes both
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    moe_module = "block_sparse_moe" if config["model_type"] == "mixtral" else "mlp"
    num_experts = _num_experts(config)
    for t in reader.tensors:
        if t.name in IGNORED_TENSORS:
            continue
        experts = hf_expert_names(t.name, num_experts, moe_module) if num_experts else None
        if experts is not None:
            yield from _split_experts(t, experts, keep)
            continue
        name = hf_tensor_name(t.name, moe_module)
        if name is None:
            raise ModelLoadError(f"GGUF tensor {t.name!r} has no Hugging Face counterpart")
        qtype = GGMLQuantizationType(t.tensor_type)
        n_head = 0  # Llama's q/k rows are stored in llama.cpp's rotary order
        if permute and ".attn_q." in t.name:
            n_head = heads
        elif permute and ".attn_k." in t.name:
            n_head = kv_heads
        if qtype in keep and len(t.shape) == 2:
            rows = np.asarray(t.data)
            if n_head:
                rows = unpermute_rotary(rows, n_head)  # whole rows move: blocks stay intact
            shape = (int(t.shape[1]), int(t.shape[0]))
            data = torch.from_numpy(np.array(rows))  # a writable copy of the mapped file
            yield name, GGUFBlocks(data, int(qtype), shape)
            continue
        array = dequantize_tensor(t)
        if n_head:
            array = unpermute_rotary(array, n_head)
        yield name, to_torch(array, qtype)


def _num_experts(config: dict[str, Any]) -> int:
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def _split_experts(
    t: ReaderTensor, names: list[str], keep: Collection[int]
) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """A stacked expert tensor (torch shape [E, rows, cols]) as its experts' matrices: each
    expert's rows are whole GGUF rows, so a quantized one is a slice of the blocks."""
    qtype = GGMLQuantizationType(t.tensor_type)
    if len(t.shape) != 3 or int(t.shape[2]) != len(names):
        raise ModelLoadError(
            f"GGUF tensor {t.name} has shape {tuple(int(d) for d in reversed(t.shape))}; "
            f"expected {len(names)} stacked experts"
        )
    rows, cols = int(t.shape[1]), int(t.shape[0])
    data = np.asarray(t.data)  # [E, rows, cols] or, quantized, [E, rows, row bytes]
    for expert, name in enumerate(names):
        if qtype in keep:
            blocks = torch.from_numpy(np.array(data[expert]))  # a writable copy of the map
            yield name, GGUFBlocks(blocks, int(qtype), (rows, cols))
        else:
            dense = dequantize_array(data[expert], qtype, (rows, cols), t.name)
            yield name, to_torch(dense, qtype)


def _num_hf_tensors(tensors: dict[str, ReaderTensor], config: dict[str, Any]) -> int:
    """How many tensors ``iter_hf_tensors`` yields (stacked experts count one each)."""
    experts = _num_experts(config)
    stacked = sum(1 for name in tensors if hf_expert_names(name, 1) is not None)
    return len(tensors) + stacked * (experts - 1) if experts else len(tensors)


def iter_gguf_weights(
    gguf_path: Path, config: dict[str, Any], dtype: torch.dtype, keep: Collection[int]
) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """The model's weights read from the GGUF file itself: matrices of the ggml types in
    ``keep`` as their blocks, everything else dense in ``dtype``."""
    reader = open_gguf(gguf_path)
    for name, tensor in _hf_tensors(reader, config, keep):
        yield name, tensor if isinstance(tensor, GGUFBlocks) else tensor.to(dtype)


def _progress(
    items: Iterable[tuple[str, torch.Tensor]], total: int, label: str
) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        from tqdm import tqdm
    except ImportError:
        start = time.monotonic()
        for i, item in enumerate(items, 1):
            if i % _PROGRESS_EVERY == 0 or i == total:
                print(
                    f"{label}: {i}/{total} tensors ({time.monotonic() - start:.1f}s)",
                    file=sys.stderr,
                )
            yield item
        return
    yield from tqdm(items, total=total, desc=label, unit="tensor", file=sys.stderr)


def write_safetensors(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path) -> None:
    """Write shards of at most SHARD_BYTES; one file is ``model.safetensors``, more get an index."""
    shards: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        save_file(pending, str(out_dir / f"shard-{len(shards):05d}.tmp"), metadata={"format": "pt"})
        shards.append(list(pending))
        pending, pending_bytes = {}, 0

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + nbytes > SHARD_BYTES:
            flush()
        pending[name] = tensor
        pending_bytes += nbytes
    if pending or not shards:
        flush()
    if len(shards) == 1:
        os.replace(out_dir / "shard-00000.tmp", out_dir / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(out_dir / f"shard-{i:05d}.tmp", out_dir / fname)
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert ``gguf_path`` into the HF folder ``out_dir`` (atomically); returns ``out_dir``."""
    reader = open_gguf(gguf_path)
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = hf_config_from_gguf(meta, tensors)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tokenizer_files = build_tokenizer_files(meta, config["max_position_embeddings"])
        for fname, text in tokenizer_files.items():
            (tmp / fname).write_text(text, encoding="utf-8")
        label = f"converting {gguf_path.name}"
        total = _num_hf_tensors(tensors, config)
        write_safetensors(_progress(iter_hf_tensors(reader, config), total, label), tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "source.json").write_text(json.dumps(source_record(gguf_path)))
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():
                raise
            shutil.rmtree(tmp)  # another process finished the same conversion first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
