"""The experts of a mixture-of-experts layer: the torch reference and the kernels' dispatch.

``fused_experts(hidden, w13, w2, topk_weights, topk_ids)`` computes, for every token ``t``,

    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x)) * up_e(x)),  e = topk_ids[t, j]

with the experts' weights stacked as vLLM stacks them: ``w13`` [E, 2 * I, H] holds each
expert's gate rows then its up rows, ``w2`` [E, H, I] its down projection. The router (which
experts, with which weights) is the model's: Mixtral and Qwen3-MoE normalise differently.

On a CPU the C++ op ``actorserve_kernels.cpu.fused_moe`` groups the tokens by expert and runs
each expert's GEMMs over its tokens only; on a GPU the Triton kernel of
``actorserve_kernels.fused_moe_triton`` does a grouped GEMM over the token ids sorted by
expert. Both are tested against ``fused_experts_ref``, which runs the same math expert by
expert in torch (exact fp32 for fp32 inputs, like the dense MLP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_experts_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The reference: each expert's tokens gathered, its MLP, the weighted sum scattered
    back (in the hidden dtype, the weighted sum in fp32)."""
    num_tokens, _ = hidden.shape
    inter = w2.shape[2]
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1)
    for expert in torch.unique(flat_ids).tolist():
        rows = torch.nonzero(flat_ids == expert).flatten()
        tokens = rows // topk_ids.shape[1]
        x = hidden[tokens]
        gate_up = F.linear(x, w13[expert])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(act, w2[expert])
        weight = topk_weights.reshape(-1)[rows].float()[:, None]
        out.index_add_(0, tokens, y.float() * weight)
    return out.to(hidden.dtype)


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``fused_experts_ref``'s result from the fastest kernel this device has."""
    if hidden.device.type == "cpu" and not torch.is_grad_enabled():
        from actorserve_kernels import cpu

        op = getattr(cpu, "fused_moe", None)
        if op is not None and cpu.load_cpu_ops():
            return op(hidden, w13, w2, topk_weights, topk_ids)  # type: ignore[no-any-return]
    elif hidden.device.type == "cuda":
        try:
            from actorserve_kernels.fused_moe_triton import fused_moe
        except ImportError:
            pass
        else:
            return fused_moe(hidden, w13, w2, topk_weights, topk_ids)
    return fused_experts_ref(hidden, w13, w2, topk_weights, topk_ids)
