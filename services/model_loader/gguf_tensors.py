"""GGUF tensors -> Hugging Face parameters: names, layouts and dequantization.

llama.cpp names tensors ``blk.N.attn_q.weight`` and so on; HF names them
``model.layers.N.self_attn.q_proj.weight``. Both store a Linear weight as (out, in) once the
GGUF shape (innermost first) is reversed, so apart from names only two things change: quantized
blocks are expanded to floats, and Llama's q/k rows are put back in HF's rotary order.

Mixture-of-experts layers (Qwen3-MoE, Mixtral): llama.cpp stacks each projection of every
expert into one tensor, ``blk.N.ffn_{gate,up,down}_exps.weight`` (torch shape [E, rows, cols],
each expert's matrix in HF layout), and names the router ``blk.N.ffn_gate_inp.weight``
([E, H]). ``hf_expert_names`` gives the HF names of a stacked tensor's experts, in order:
``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`` (Qwen3-MoE) or
``model.layers.N.block_sparse_moe.experts.E.{w1,w3,w2}.weight`` (Mixtral). Mixtral files
written before llama.cpp stacked them (early 2024) hold one tensor per expert,
``blk.N.ffn_gate.E.weight``; ``hf_tensor_name`` maps those.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize

from services.model_loader.errors import ModelLoadError

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Present in some files but not parameters of the HF model: llama.cpp's precomputed RoPE
# factors (we carry them as ``rope_scaling`` in config.json instead).
IGNORED_TENSORS = frozenset(
    {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
)
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# The MoE block's module in HF checkpoints -> its experts' (gate, up, down) projection names.
EXPERT_PROJECTIONS = {
    "mlp": ("gate_proj", "up_proj", "down_proj"),  # Qwen3-MoE
    "block_sparse_moe": ("w1", "w3", "w2"),  # Mixtral
}
# llama.cpp's stacked expert tensors -> index into EXPERT_PROJECTIONS' triples.
STACKED_EXPERT_TENSORS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
ROUTER_TENSOR = "ffn_gate_inp"
_STACKED_RE = re.compile(r"blk\.(\d+)\.(ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.weight")
_LEGACY_EXPERT_RE = re.compile(r"blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight")

# Types we have exercised; anything else gguf.quants can expand is accepted too.
TESTED_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q6_K,
)


def hf_tensor_name(gguf_name: str, moe_module: str = "mlp") -> str | None:
    """The HF parameter name for a GGUF tensor name, or None if it has no HF counterpart
    (or is a stacked expert tensor: ``hf_expert_names``). ``moe_module``: the MoE block's
    module name in HF checkpoints (``mlp``, or Mixtral's ``block_sparse_moe``)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
    if m and m.group(2) == ROUTER_TENSOR and m.group(3) == "weight":
        return f"model.layers.{m.group(1)}.{moe_module}.gate.weight"
    legacy = _LEGACY_EXPERT_RE.fullmatch(gguf_name)
    if legacy:
        layer, kind, expert = legacy.groups()
        proj = EXPERT_PROJECTIONS[moe_module][STACKED_EXPERT_TENSORS[kind + "_exps"]]
        return f"model.layers.{layer}.{moe_module}.experts.{expert}.{proj}.weight"
    return None


def hf_expert_names(gguf_name: str, num_experts: int, moe_module: str = "mlp") -> list[str] | None:
    """The HF names of a stacked expert tensor's ``num_experts`` matrices (expert order),
    or None if ``gguf_name`` is not one."""
    m = _STACKED_RE.fullmatch(gguf_name)
    if m is None:
        return None
    proj = EXPERT_PROJECTIONS[moe_module][STACKED_EXPERT_TENSORS[m.group(2)]]
    prefix = f"model.layers.{m.group(1)}.{moe_module}.experts."
    return [f"{prefix}{e}.{proj}.weight" for e in range(num_experts)]


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Llama q/k rows (interleaved -> HF half-split rotary).

    llama.cpp reshapes rows as (n_head, 2, head_dim/2) and swaps the last two axes; swapping
    them back with the shapes exchanged is the inverse. Works for weights and 1-D biases.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(t: ReaderTensor) -> np.ndarray:
    """The tensor as a dense array in HF layout (out, in): float32 for quantized types, else as
    stored (F32/F16; BF16 comes back as its raw uint16 bits, see ``to_torch``)."""
    shape = tuple(int(d) for d in reversed(t.shape))
    return dequantize_array(np.asarray(t.data), GGMLQuantizationType(t.tensor_type), shape, t.name)


def dequantize_array(
    data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], name: str
) -> np.ndarray:
    """``data`` (a GGUF tensor's, or a part of whole rows of it) as ``dequantize_tensor``
    returns it, in ``shape``; ``name`` is for the error."""
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return data.reshape(shape)
    if qtype == GGMLQuantizationType.BF16:
        return data.view(np.uint16).reshape(shape)
    try:
        out = dequantize(data, qtype)
    except NotImplementedError:
        raise ModelLoadError(
            f"tensor {name} uses GGML type {qtype.name}, which cannot be dequantized; "
            f"supported: {', '.join(q.name for q in TESTED_TYPES)} and the other types gguf.quants knows"
        ) from None
    return out.reshape(shape)


def to_torch(array: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """A writable torch tensor; BF16 bits are reinterpreted, so nothing is rounded."""
    if qtype == GGMLQuantizationType.BF16:
        return torch.from_numpy(np.array(array, dtype=np.uint16).view(np.int16)).view(
            torch.bfloat16
        )
    return torch.from_numpy(np.array(array))


@dataclass(frozen=True)
class GGUFBlocks:
    """A quantized matrix as GGUF stores it, for kernels that read it without expanding it.

    ``data``: uint8 [rows, row bytes], each row ``cols / block_size`` blocks of ``ggml_type``;
    ``shape``: the matrix's (rows, cols) in HF layout. Loaders that cannot use it call
    ``dequantize()``.
    """

    data: torch.Tensor
    ggml_type: int
    shape: tuple[int, int]

    @property
    def block_size(self) -> int:
        return int(GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)][0])

    def narrow(self, dim: int, start: int, length: int) -> GGUFBlocks | None:
        """Rows or columns ``[start, start + length)``; None when columns cut a block."""
        rows, cols = self.shape
        if dim == 0:
            return GGUFBlocks(self.data.narrow(0, start, length), self.ggml_type, (length, cols))
        bs = self.block_size
        if start % bs or length % bs:
            return None
        per_block = self.data.shape[1] // (cols // bs)
        data = self.data.narrow(1, start // bs * per_block, length // bs * per_block)
        return GGUFBlocks(data, self.ggml_type, (rows, length))

    def dequantize(self) -> torch.Tensor:
        """The matrix as fp32 [rows, cols]."""
        array = dequantize(self.data.contiguous().numpy(), GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(array.reshape(self.shape), dtype=np.float32))
