"""GGUF tensors -> Hugging Face parameters: names, layouts and dequantization.

llama.cpp names tensors ``blk.N.attn_q.weight`` and so on; HF names them
``model.layers.N.self_attn.q_proj.weight``. Both store a Linear weight as (out, in) once the
GGUF shape (innermost first) is reversed, so apart from names only two things change: quantized
blocks are expanded to floats, and Llama's q/k rows are put back in HF's rotary order.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor
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


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF parameter name for a GGUF tensor name, or None if it has no HF counterpart."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
    return None


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
    qtype = GGMLQuantizationType(t.tensor_type)
    shape = tuple(int(d) for d in reversed(t.shape))
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(t.data).reshape(shape)
    if qtype == GGMLQuantizationType.BF16:
        return np.asarray(t.data).view(np.uint16).reshape(shape)
    try:
        out = dequantize(np.asarray(t.data), qtype)
    except NotImplementedError:
        raise ModelLoadError(
            f"tensor {t.name} uses GGML type {qtype.name}, which cannot be dequantized; "
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
