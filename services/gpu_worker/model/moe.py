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
from services.gpu_worker.model.expert_dispatch import ExpertDispatch
from services.gpu_worker.model.layers import Linear
from services.gpu_worker.model.moe_quant import DOWN, QuantExperts
from services.model_loader.gguf_tensors import GGUFBlocks

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
    """``forward(x[T, H]) -> [T, H]``: the routed experts' weighted sum (all-reduced).

    With expert parallelism (``parallel.ep_size`` > 1) the block holds whole experts,
    ``[expert_start, expert_start + num_local_experts)``, and ``ExpertDispatch`` brings
    it every token that may need them and takes the sums back."""

    def __init__(
        self, arch: ModelArchConfig, parallel: ParallelState, dispatch: ExpertDispatch | None = None
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.dispatch = dispatch
        self.num_experts = arch.num_experts
        self.top_k = arch.num_experts_per_tok
        self.renormalize = arch.norm_topk_prob
        # HF's Qwen3-MoE router rounds its weights to the hidden dtype; Mixtral's does not.
        self.round_weights = arch.architecture != "MixtralForCausalLM"
        ep = parallel.ep_size
        # Expert parallelism holds whole experts; else every expert's slice of I (TP).
        self.split = 1 if ep > 1 else parallel.tp_size
        self.intermediate_size = arch.moe_intermediate_size // self.split  # this rank's
        self.num_local_experts = arch.num_experts // ep
        self.expert_start = parallel.ep_rank * self.num_local_experts
        h, i, e = arch.hidden_size, self.intermediate_size, self.num_local_experts
        self.gate = Linear(h, arch.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self._expert_map: torch.Tensor | None = None  # built on first use, on x's device

    def expert_map(self, device: torch.device) -> torch.Tensor | None:
        """Expert parallelism: global expert id -> local index, -1 for another rank's
        (None: every expert is local)."""
        if self.parallel.ep_size == 1:
            return None
        if self._expert_map is None or self._expert_map.device != device:
            e = self.num_local_experts
            local = torch.full((self.num_experts,), -1, dtype=torch.int32, device=device)
            local[self.expert_start : self.expert_start + e] = torch.arange(
                e, dtype=torch.int32, device=device
            )
            self._expert_map = local
        return self._expert_map

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

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts' share of the weighted sum for tokens ``x`` (global ``ids``)."""
        if self.dispatch is not None:
            self.dispatch.count(ids)
        if self.quant_experts is not None:  # GGUF experts kept in their blocks (moe_quant.py)
            return self.quant_experts(x, weights, ids, self.expert_map(x.device))
        return fused_experts(
            x, self.w13, self.w2, weights, ids, expert_map=self.expert_map(x.device)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.ep_size > 1:
            assert self.dispatch is not None
            return self.dispatch.run(x, self)
        weights, ids = self.route(x)
        return self.parallel.all_reduce(self.experts(x, weights, ids))

    # GGUF experts kept quantized (``load_quantized_expert``): computed from these once all
    # arrived; None while they load, or when they load dense into ``w13``/``w2``.
    quant_experts: QuantExperts | None = None
    _dense_experts = False  # one expert projection came (or had to be loaded) dense

    def load_quantized_expert(
        self,
        param: str,
        expert: int,
        shard: int | None,
        tensor: torch.Tensor | GGUFBlocks,
        int8_activations: bool = False,
    ) -> bool:
        """Keep one local expert's full HF tensor given as GGUF blocks (gate/up [I, H] or
        down [H, I]), cut to this rank's slice of I, quantized (``moe_quant.QuantExperts``,
        packed once every local expert's three projections arrived; ``w13``/``w2`` are then
        freed). False when the caller must load it dense (``load_expert``): another rank's
        expert, a dense tensor, a model not fp32/bf16 on the CPU, a cut through blocks,
        a type the CPU kernels lack; from then on every expert of the block loads dense,
        the ones held so far expanded into ``w13``/``w2``."""
        if not self.is_local(expert):
            return False
        quant = self.quant_experts
        if quant is not None and quant.ready:
            raise ValueError("loaded twice")
        blocks = None
        usable = self.w13.device.type == "cpu" and self.w13.dtype in (torch.float32, torch.bfloat16)
        if isinstance(tensor, GGUFBlocks) and usable and not self._dense_experts:
            width, hidden = self.intermediate_size, self.gate.in_features
            full = (self.split * width, hidden) if param == "w13" else (hidden, self.split * width)
            if tensor.shape != full:
                raise ValueError(f"has shape {tensor.shape}, expected {full}")
            rank = 0 if self.split == 1 else self.parallel.tp_rank
            blocks = tensor.narrow(0 if param == "w13" else 1, rank * width, width)
        if blocks is None:  # this one loads dense, and so do the others
            self._dense_experts = True
            if quant is not None:
                quant.expand_into(self.w13.data, self.w2.data)
                self.quant_experts = None
            return False
        if quant is None:
            quant = self.quant_experts = QuantExperts(
                self.num_local_experts, self.intermediate_size, self.gate.in_features
            )
        projection = DOWN if param != "w13" else shard
        assert projection is not None
        quant.hold(expert - self.expert_start, projection, blocks)
        if not quant.complete:
            return True
        if not quant.pack(int8_activations):  # a type the CPU kernels lack: all dense
            self._dense_experts = True
            quant.expand_into(self.w13.data, self.w2.data)
            self.quant_experts = None
            return True
        # One copy of the weights: the stacked tensors keep their dims, with no experts.
        self.w13.data = self.w13.data.new_empty(0, *self.w13.shape[1:])
        self.w2.data = self.w2.data.new_empty(0, *self.w2.shape[1:])
        return True

    def is_local(self, expert: int) -> bool:
        return self.expert_start <= expert < self.expert_start + self.num_local_experts

    def load_expert(self, param: str, expert: int, shard: int | None, tensor: torch.Tensor) -> bool:
        """Copy one expert's full HF tensor (gate/up [I, H] or down [H, I]), cut to this
        rank's slice of I, into ``w13`` (rows of ``shard``) or ``w2``; False (nothing
        copied) for an expert another rank holds."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range: the model has {self.num_experts}")
        if not self.is_local(expert):
            return False
        local = expert - self.expert_start
        width = self.intermediate_size
        rank = 0 if self.split == 1 else self.parallel.tp_rank
        if param == "w13":
            assert shard is not None
            target = self.w13.data[local].narrow(0, shard * width, width)
            full = (self.split * width, target.shape[1])
            if tuple(tensor.shape) != full:
                raise ValueError(f"has shape {tuple(tensor.shape)}, expected {full}")
            target.copy_(tensor.narrow(0, rank * width, width))
        else:
            target = self.w2.data[local]
            full = (target.shape[0], self.split * width)
            if tuple(tensor.shape) != full:
                raise ValueError(f"has shape {tuple(tensor.shape)}, expected {full}")
            target.copy_(tensor.narrow(1, rank * width, width))
        return True
