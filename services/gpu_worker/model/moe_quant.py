"""The experts of a GGUF mixture-of-experts layer kept in their quantized blocks (CPU).

A dense GGUF layer stays quantized as a ``QuantWeight`` (``layers.py``); ``QuantExperts``
does the same for one ``SparseMoeBlock``'s local experts instead of expanding them into its
stacked fp32 ``w13``/``w2``. Each expert holds its gate and up projections as one
``QuantWeight`` [2 * I, H] (two when their ggml types differ) and its down projection
[H, I]; ``I`` is this rank's slice (tensor parallelism cuts gate/up by rows and down by
columns along whole blocks).

Loading (``SparseMoeBlock.load_quantized_expert``): each projection's blocks are held as
they arrive and packed once all of the block's local experts are there (a block's
experts arrive together in a GGUF file, so one layer's blocks are held at a time). When
one cannot stay quantized (it came dense, its type or a TP cut the kernels cannot take,
the C++ ops missing) ``expand_into`` writes every held projection dense into ``w13``/``w2``
and the block runs ``fused_experts`` as for any checkpoint.

``__call__`` is ``actorserve_kernels.moe.fused_experts_ref``'s math from the blocks: the
(token, k) pairs grouped by expert, each expert's MLP over its tokens only, the weighted
results summed in fp32 in expert order, the sum rounded once to the hidden dtype.
"""

from __future__ import annotations

import torch

from services.gpu_worker.model.layers import QuantWeight, silu_and_mul
from services.model_loader.gguf_tensors import GGUFBlocks

# A projection of an expert: its gate and up rows (w13's shards 0 and 1), its down matrix.
GATE, UP, DOWN = 0, 1, 2


class QuantExperts:
    """``num_experts`` local experts of intermediate width ``intermediate_size`` (this
    rank's) over hidden size ``hidden_size``, kept as GGUF blocks.

    ``__call__(x [T, H], topk_weights [T, k], topk_ids [T, k], expert_map)`` -> [T, H]:
    the sum over this rank's experts, as ``fused_experts`` returns it; ``expert_map``
    (global id -> local index, -1 on another rank; None: the ids are local) as the block's.
    """

    def __init__(self, num_experts: int, intermediate_size: int, hidden_size: int) -> None:
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.hidden_size = hidden_size
        # Per local expert: (gate_up,) or (gate, up); and down. Set by ``pack``.
        self.gate_up: list[tuple[QuantWeight, ...]] = []
        self.down: list[QuantWeight] = []
        self._held: dict[tuple[int, int], GGUFBlocks] = {}  # (local expert, projection)

    @property
    def ready(self) -> bool:
        """Packed: every local expert's three projections are in ``gate_up``/``down``."""
        return len(self.down) == self.num_experts

    @property
    def complete(self) -> bool:
        """Every local expert's three projections arrived (``pack`` may run)."""
        return len(self._held) == 3 * self.num_experts

    def hold(self, local: int, projection: int, blocks: GGUFBlocks) -> None:
        """Keep ``blocks`` (this rank's slice: [I, H] for GATE/UP, [H, I] for DOWN) until
        ``pack``."""
        i, h = self.intermediate_size, self.hidden_size
        expected = (h, i) if projection == DOWN else (i, h)
        if blocks.shape != expected:
            raise ValueError(f"has shape {blocks.shape}, expected {expected}")
        if (local, projection) in self._held:
            raise ValueError("loaded twice")
        self._held[(local, projection)] = blocks

    def pack(self, int8_activations: bool = False) -> bool:
        """Pack every held projection for the CPU kernels; False (nothing packed, the held
        blocks kept for ``expand_into``) when one cannot be."""
        assert self.complete
        gate_up: list[tuple[QuantWeight, ...]] = []
        down: list[QuantWeight] = []
        for e in range(self.num_experts):
            gate, up = self._held[(e, GATE)], self._held[(e, UP)]
            if gate.ggml_type == up.ggml_type:  # one matrix, as the dense MLP's gate_up_proj
                rows = (gate.shape[0] + up.shape[0], gate.shape[1])
                data = torch.cat([gate.data, up.data])
                parts = [GGUFBlocks(data, gate.ggml_type, rows)]
            else:
                parts = [gate, up]
            packed = [QuantWeight.pack(_contiguous(p), int8_activations) for p in parts]
            d = QuantWeight.pack(_contiguous(self._held[(e, DOWN)]), int8_activations)
            if d is None or any(q is None for q in packed):
                return False
            gate_up.append(tuple(q for q in packed if q is not None))
            down.append(d)
        self.gate_up, self.down = gate_up, down
        self._held.clear()
        return True

    def expand_into(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Write the held projections dense into the block's ``w13`` [E, 2I, H] and ``w2``
        [E, H, I] (the block falls back to them)."""
        i = self.intermediate_size
        for (e, projection), blocks in self._held.items():
            dense = blocks.dequantize()
            if projection == DOWN:
                w2[e].copy_(dense)
            else:
                w13[e].narrow(0, projection * i, i).copy_(dense)
        self._held.clear()

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weights."""
        weights = [q for parts in self.gate_up for q in parts] + self.down
        return sum(q.packed.numel() * q.packed.element_size() for q in weights)

    def mlp(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``expert``'s SwiGLU MLP over its tokens ``x`` [n, H]."""
        parts = self.gate_up[expert]
        if len(parts) == 1:
            gate_up = parts[0].linear(x)
        else:
            gate_up = torch.cat([q.linear(x) for q in parts], dim=-1)
        return self.down[expert].linear(silu_and_mul(gate_up))

    def __call__(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert self.ready, "QuantExperts used before every expert was loaded"
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        if x.shape[0] == 0:
            return out.to(x.dtype)
        top_k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1).long()
        local = expert_map.long()[flat] if expert_map is not None else flat
        # The pairs grouped by expert (ascending, -1 first), in token order within each.
        order = torch.argsort(local, stable=True)
        experts, counts = torch.unique_consecutive(local[order], return_counts=True)
        weights = topk_weights.reshape(-1).float()
        start = 0
        for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):
            rows = order[start : start + count]
            start += count
            if expert < 0:  # another rank's expert
                continue
            tokens = rows // top_k
            y = self.mlp(expert, x[tokens])
            out.index_add_(0, tokens, y.float() * weights[rows, None])
        return out.to(x.dtype)


def _contiguous(blocks: GGUFBlocks) -> GGUFBlocks:
    """``blocks`` with contiguous bytes (a column cut of a TP rank is a strided view)."""
    if blocks.data.is_contiguous():
        return blocks
    return GGUFBlocks(blocks.data.contiguous(), blocks.ggml_type, blocks.shape)
