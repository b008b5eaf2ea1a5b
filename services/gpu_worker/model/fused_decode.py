"""A decode-only step's layers in one C++ call (``actorserve_kernels/cpu/decode_layers.cpp``).

On a CPU, with one rank and GGUF-quantized linears, a batch of single-token rows runs every
layer of ``LlamaModel`` in ``decode_layers``: no Python per layer, the same arithmetic as
the Python layers (tests/test_quantized_model.py holds them equal). ``FusedDecodeWeights.of``
decides once per model whether it can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from services.gpu_worker.attention import AttentionMetadata, KVCache


@dataclass(frozen=True)
class FusedDecodeWeights:
    """What ``decode_layers`` needs from a model, gathered once."""

    weights: list[torch.Tensor]
    types: list[int]
    dims: list[int]
    num_heads: int
    num_kv_heads: int
    eps: float
    scale: float
    # Each layer's fp8 KV cache scales: the layers' buffers (filled in place, so read per call)
    kv_scales: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def of(cls, model: Any) -> FusedDecodeWeights | None:
        """The layers of ``model`` (a ``LlamaModel``, typed loosely: llama.py imports this
        module) as ``decode_layers`` reads them, or None when it cannot run
        them: another rank or stage, a dense or unquantized linear, q/k norms, no C++ op."""
        from services.gpu_worker.attention.torch_backend import TorchAttentionBackend
        from services.gpu_worker.model.layers import _cpu_op

        p = model.parallel
        if (
            p.tp_size != 1
            or not (p.is_first_stage and p.is_last_stage)
            or _cpu_op("decode_layers") is None
        ):
            return None
        weights: list[torch.Tensor] = []
        types: list[int] = []
        kv_scales = [(m.self_attn.k_scale, m.self_attn.v_scale) for m in model.layers]
        for module in model.layers:
            layer = module  # a LlamaDecoderLayer (not imported: llama.py imports this module)
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            quants = [lin.quant for lin in linears]
            backend = attn.attn
            if (
                attn.q_norm is not None
                or not isinstance(backend, TorchAttentionBackend)
                or backend.head_dim not in (64, 128)
                or any(q is None for q in quants)
                or any(lin.bias is not None for lin in linears[1:])
            ):
                return None
            qkv, o, gate_up, down = (q for q in quants if q is not None)
            bias = attn.qkv_proj.bias
            weights += [layer.input_layernorm.weight, qkv.packed,
                        bias if bias is not None else qkv.packed.new_empty(0, dtype=torch.float32),
                        o.packed, layer.post_attention_layernorm.weight, gate_up.packed, down.packed]  # fmt: skip
            types += [qkv.ggml_type, o.ggml_type, gate_up.ggml_type, down.ggml_type]
        first = model.layers[0]
        a, m = first.self_attn, first.mlp
        dims = [
            a.q_size + 2 * a.kv_size,
            a.o_proj.out_features,
            2 * m.intermediate_size,
            m.down_proj.out_features,
        ]
        eps = first.input_layernorm.eps
        return cls(
            weights, types, dims, a.num_heads, a.num_kv_heads, eps, a.head_dim**-0.5, kv_scales
        )


def fused_decode_layers(
    hidden: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    kv_caches: list[KVCache],
    meta: AttentionMetadata,
    fused: FusedDecodeWeights,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer of a decode-only step through ``decode_layers``: (hidden, residual)."""
    from actorserve_kernels.cpu import decode_layers
    from actorserve_kernels.kv_quant import kind

    fp8 = kind(kv_caches[0][0]) == "fp8"
    k_scales = [float(k) for k, _ in fused.kv_scales] if fp8 else []
    v_scales = [float(v) for _, v in fused.kv_scales] if fp8 else []
    return decode_layers(
        hidden.contiguous(), fused.weights, fused.types, fused.dims,
        [k for k, _ in kv_caches], [v for _, v in kv_caches],
        meta.block_table, meta.slot_mapping, meta.seq_lens_cpu.long(), cos_sin[0], cos_sin[1],
        fused.num_heads, fused.num_kv_heads, fused.eps, fused.scale, k_scales, v_scales,
    )  # fmt: skip
