"""The experts of a mixture-of-experts layer: the torch reference and the kernels' dispatch.

``fused_experts(hidden, w13, w2, topk_weights, topk_ids)`` computes, for every token ``t``,

    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x)) * up_e(x)),  e = topk_ids[t, j]

with the experts' weights stacked as vLLM stacks them: ``w13`` [E, 2 * I, H] holds each
expert's gate rows then its up rows, ``w2`` [E, H, I] its down projection. The router (which
experts, with which weights) is the model's: Mixtral and Qwen3-MoE normalise differently.

Expert parallelism (vLLM's ``--enable-expert-parallel``) gives each rank whole experts:
``w13``/``w2`` hold this rank's ``E_local`` experts, ``topk_ids`` stay global, and
``expert_map`` (int32 [E_global], vLLM's argument of the same name) maps a global id to its
local index, or to -1 for an expert another rank holds. Pairs of remote experts contribute
nothing: the result is this rank's share of the sum (zeros for a token none of whose experts
is local), and the ranks' shares add up to the whole (an all-reduce, elsewhere). The ids are
mapped with one gather, ``expert_map[topk_ids]``, and the kernels skip pairs of id -1.

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
    *,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: each expert's tokens gathered, its MLP, the weighted sum scattered
    back (in the hidden dtype, the weighted sum in fp32). With ``expert_map``, only the
    pairs of local experts (module doc)."""
    num_tokens, _ = hidden.shape
    inter = w2.shape[2]
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    if expert_map is not None:
        topk_ids = map_expert_ids(topk_ids, expert_map)
    flat_ids = topk_ids.reshape(-1)
    for expert in torch.unique(flat_ids).tolist():
        if expert < 0:  # another rank's expert
            continue
        rows = torch.nonzero(flat_ids == expert).flatten()
        tokens = rows // topk_ids.shape[1]
        x = hidden[tokens]
        gate_up = F.linear(x, w13[expert])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(act, w2[expert])
        weight = topk_weights.reshape(-1)[rows].float()[:, None]
        out.index_add_(0, tokens, y.float() * weight)
    return out.to(hidden.dtype)


def map_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """``expert_map[topk_ids]``: global expert ids [T, k] to local indices, -1 for another
    rank's experts (one gather on the ids' device, no host sync; ``expert_map``'s dtype)."""
    if expert_map.dim() != 1 or expert_map.is_floating_point():
        raise ValueError(
            f"expert_map must be a 1-d integer tensor, got {list(expert_map.shape)} "
            f"{expert_map.dtype}"
        )
    return expert_map[topk_ids]


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fused_experts_ref``'s result from the fastest kernel this device has.

    ``expert_map``: None (every expert local, ``topk_ids`` index ``w13``/``w2``), or, with
    expert parallelism, int32 [E_global]: global id -> local index, -1 for another rank's
    expert; then only the local pairs are summed (module doc)."""
    if hidden.device.type == "cpu" and not torch.is_grad_enabled():
        from actorserve_kernels import cpu

        op = getattr(cpu, "fused_moe", None)
        if op is not None and cpu.load_cpu_ops():
            ids = topk_ids if expert_map is None else map_expert_ids(topk_ids, expert_map)
            return op(hidden, w13, w2, topk_weights, ids)  # type: ignore[no-any-return]
    elif hidden.device.type == "cuda":
        try:
            from actorserve_kernels.fused_moe_triton import fused_moe
        except ImportError:
            pass
        else:
            return fused_moe(hidden, w13, w2, topk_weights, topk_ids, expert_map=expert_map)
    return fused_experts_ref(hidden, w13, w2, topk_weights, topk_ids, expert_map=expert_map)
