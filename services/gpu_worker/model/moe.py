"""The mixture-of-experts block of Qwen3-MoE and Mixtral: a router and stacked experts.

``gate`` (a ``Linear`` H -> E, replicated on every rank) scores the experts; the routing
weights are HF's: softmax over all experts in fp32, the top k kept, renormalised to sum to
one (Mixtral always, Qwen3-MoE when ``norm_topk_prob``); Qwen3-MoE then rounds them to the
hidden dtype, Mixtral keeps them fp32. ``actorserve_kernels.moe.fused_experts`` runs the
experts (a C++ op, a Triton kernel or the torch reference).

The experts are stacked as vLLM stacks them: ``w13`` [E, 2 * I, H] holds each expert's gate
rows then its up rows, ``w2`` [E, H, I] its down projection. Tensor parallelism without
expert parallelism (vLLM's default): every rank holds every expert's slice of I
(column-parallel ``w13``, row-parallel ``w2``) and the block ends with one all-reduce.

``expert_param`` maps HF checkpoint names (``mlp.experts.E.{gate,up,down}_proj`` of
Qwen3-MoE, ``block_sparse_moe.experts.E.{w1,w3,w2}`` of Mixtral) onto the stacked
parameters; ``SparseMoeBlock.load_expert`` copies one expert's tensor (cut to this rank's
slice) into them.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from actorserve_kernels.moe import fused_experts
from services.config import ModelArchConfig
from services.gpu_worker.distributed import ParallelState
from services.gpu_worker.model.layers import Linear

# HF's expert projection names: (stacked param, shard of w13: 0 gate, 1 up; None for w2).
_EXPERT_PROJ = {
    "gate_proj": ("w13", 0),
    "up_proj": ("w13", 1),
    "down_proj": ("w2", None),
    "w1": ("w13", 0),
    "w3": ("w13", 1),
    "w2": ("w2", None),
}
_EXPERT_NAME = re.compile(
    r"^(?P<prefix>.*\.)(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)


def expert_param(hf_name: str) -> tuple[str, int, int | None] | None:
    """(stacked parameter name, expert, w13 shard) of an HF expert weight, else None.

    ``model.layers.3.mlp.experts.5.up_proj.weight`` -> ``("model.layers.3.mlp.w13", 5, 1)``.
    """
    m = _EXPERT_NAME.match(hf_name)
    if m is None:
        return None
    param, shard = _EXPERT_PROJ[m["proj"]]
    return f"{m['prefix']}mlp.{param}", int(m["expert"]), shard


def checkpoint_module_name(hf_name: str) -> str:
    """Mixtral's ``block_sparse_moe`` module named as ours (``mlp``)."""
    return hf_name.replace(".block_sparse_moe.", ".mlp.")


class SparseMoeBlock(nn.Module):
    """``forward(x[T, H]) -> [T, H]``: the routed experts' weighted sum (all-reduced)."""

    def __init__(self, arch: ModelArchConfig, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_experts = arch.num_experts
        self.top_k = arch.num_experts_per_tok
        self.renormalize = arch.norm_topk_prob
        # HF's Qwen3-MoE router rounds its weights to the hidden dtype; Mixtral's does not.
        self.round_weights = arch.architecture != "MixtralForCausalLM"
        self.intermediate_size = arch.moe_intermediate_size // parallel.tp_size  # this rank's
        h, i = arch.hidden_size, self.intermediate_size
        self.gate = Linear(h, arch.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(arch.num_experts, 2 * i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(arch.num_experts, h, i), requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] fp32, topk_ids [T, k] int64) as HF's router computes them."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_weights:
            weights = weights.to(x.dtype).float()
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = fused_experts(x, self.w13, self.w2, weights, ids)
        return self.parallel.all_reduce(out)

    def load_expert(self, param: str, expert: int, shard: int | None, tensor: torch.Tensor) -> None:
        """Copy one expert's full HF tensor (gate/up [I, H] or down [H, I]), cut to this
        rank's slice of I, into ``w13`` (rows of ``shard``) or ``w2``."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range: the model has {self.num_experts}")
        width, rank = self.intermediate_size, self.parallel.tp_rank
        if param == "w13":
            assert shard is not None
            target = self.w13.data[expert].narrow(0, shard * width, width)
            full = (self.parallel.tp_size * width, target.shape[1])
            if tuple(tensor.shape) != full:
                raise ValueError(f"has shape {tuple(tensor.shape)}, expected {full}")
            target.copy_(tensor.narrow(0, rank * width, width))
        else:
            target = self.w2.data[expert]
            full = (target.shape[0], self.parallel.tp_size * width)
            if tuple(tensor.shape) != full:
                raise ValueError(f"has shape {tuple(tensor.shape)}, expected {full}")
            target.copy_(tensor.narrow(1, rank * width, width))
