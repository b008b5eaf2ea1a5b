"""Where a worker rank sits in the parallel layout, and the collectives the model needs.

torch.distributed is the runtime (NCCL on CUDA, gloo on CPU): ranks rendezvous
over TCP at ``--master-addr:--master-port``, bound to the address given. With
one rank nothing is initialised and every collective is the identity, so the
single-rank path pays nothing.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from services.config import ModelArchConfig, ParallelConfig


@dataclass(frozen=True)
class ParallelState:
    """This rank's coordinates: global ``rank`` of ``world_size``; its tensor-parallel
    rank and group. ``group`` is None for a single rank (no collectives)."""

    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None

    @property
    def is_output_rank(self) -> bool:
        """The rank whose StepResult the engine reads (vLLM's output rank: TP rank 0)."""
        return self.tp_rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the TP group, in place; returns it."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every TP rank's ``x`` along the last dim, in rank order."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE_RANK = ParallelState()


@dataclass(frozen=True)
class HeadShard:
    """The attention heads a TP rank holds: query heads ``[q_start, q_start + num_heads)``
    and KV heads ``[kv_start, kv_start + num_kv_heads)``.

    Query heads split evenly. KV heads split when there are at least as many as ranks;
    otherwise each KV head is replicated on ``tp_size / total_kv_heads`` consecutive ranks
    (vLLM's rule), which keeps every rank's query heads with the KV head they attend to.
    """

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int

    @classmethod
    def of(cls, arch: ModelArchConfig, parallel: ParallelState) -> HeadShard:
        tp, r = parallel.tp_size, parallel.tp_rank
        num_heads = arch.num_attention_heads // tp
        total_kv = arch.num_key_value_heads
        if total_kv >= tp:
            num_kv, kv_start = total_kv // tp, r * (total_kv // tp)
        else:
            num_kv, kv_start = 1, r // (tp // total_kv)
        return cls(num_heads, num_kv, r * num_heads, kv_start)


def init_distributed(parallel: ParallelConfig, rank: int, device: str) -> ParallelState:
    """Join the group of ``parallel.world_size`` ranks (a no-op for one rank).

    Raises ``RuntimeError`` naming this rank, the address and the timeout when the group
    does not form in time (a rank that never started, or a wrong address)."""
    world = parallel.world_size
    if world == 1:
        return SINGLE_RANK
    if parallel.master_port is None:
        raise RuntimeError("--master-port is unresolved: the launcher picks one before start")
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    address = f"{parallel.master_addr}:{parallel.master_port}"
    try:
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            init_method=f"tcp://{address}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=parallel.distributed_timeout),
        )
    except (RuntimeError, ValueError) as e:  # torch raises DistStoreError (a RuntimeError)
        raise RuntimeError(
            f"worker rank {rank}: the group of {world} ranks did not form at {address} "
            f"within {parallel.distributed_timeout:.0f} s ({e})"
        ) from None
    return ParallelState(
        rank=rank,
        world_size=world,
        tp_rank=rank % parallel.tensor_parallel_size,
        tp_size=parallel.tensor_parallel_size,
        group=dist.group.WORLD,
    )
