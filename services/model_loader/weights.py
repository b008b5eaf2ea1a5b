"""Weights of an HF folder (safetensors) and random weights of the same names and shapes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.config import ModelArchConfig
from services.model_loader.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

INDEX_FILE = "model.safetensors.index.json"


def load_hf_config(folder: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of an HF folder."""
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{folder} has no config.json") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return cfg


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files, in the index's order if there is one, else sorted by name."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot read {index}: {e}") from None
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise ModelLoadError(f"{folder} is missing weight files: {', '.join(missing)}")
    return files


def iter_weights(folder: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF parameter name, tensor cast to ``dtype``) for every tensor in the folder's weights."""
    from safetensors import safe_open  # here: the processes that only resolve a model skip it

    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    yield name, f.get_tensor(name).to(dtype)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"cannot read weights from {path}: {e}") from None


def param_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of a Llama-family decoder (or its MoE variant), in
    HF's order."""
    h, hd, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h)}
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if arch.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if arch.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        if arch.is_moe_layer(i):
            shapes.update(_moe_shapes(arch, p + arch.moe_checkpoint_module + "."))
        else:
            shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes[p + "mlp.up_proj.weight"] = (inter, h)
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes


def _moe_shapes(arch: ModelArchConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """A MoE block's router and experts by HF name (Qwen3-MoE's ``{gate,up,down}_proj``,
    Mixtral's ``w1``/``w3``/``w2``), in HF's order."""
    h, inter = arch.hidden_size, arch.moe_intermediate_size
    gate, up, down = (
        ("w1", "w3", "w2")
        if arch.architecture == "MixtralForCausalLM"
        else ("gate_proj", "up_proj", "down_proj")
    )
    shapes: dict[str, tuple[int, ...]] = {prefix + "gate.weight": (arch.num_experts, h)}
    for e in range(arch.num_experts):
        shapes[f"{prefix}experts.{e}.{gate}.weight"] = (inter, h)
        shapes[f"{prefix}experts.{e}.{up}.weight"] = (inter, h)
        shapes[f"{prefix}experts.{e}.{down}.weight"] = (h, inter)
    return shapes


def dummy_weights(
    arch: ModelArchConfig,
    dtype: torch.dtype,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights with exactly the HF names and shapes of ``arch`` (for --load-format dummy).

    Matrices and biases are N(0, 0.02) (small, so activations stay finite through many
    layers); norm weights are ones. The same seed on the same kind of device gives the
    same weights. Made on ``device``: a GPU draws an 8B model's in a second, where one CPU
    core takes a minute or more.
    """
    import torch  # here: the processes that only resolve a model never import torch

    gen = torch.Generator(device).manual_seed(seed)
    for name, shape in param_shapes(arch).items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=dtype, device=device)
        else:
            weight = torch.empty(shape, dtype=torch.float32, device=device)
            yield name, weight.normal_(0.0, 0.02, generator=gen).to(dtype)
