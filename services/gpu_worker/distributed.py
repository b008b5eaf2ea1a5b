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

from services.config import ConfigError, ModelArchConfig, ParallelConfig


@dataclass(frozen=True)
class ParallelState:
    """This rank's coordinates: global ``rank`` of ``world_size`` (its engine core's
    ranks); its tensor-parallel rank and group (None for one rank: no collectives); its
    pipeline stage and the layers ``[layer_start, layer_end)`` that stage holds (None: all
    of them).

    Expert parallelism: ``ep_rank`` of ``ep_size`` ranks hold the experts. With engine
    cores in lock-step (``dp_size`` > 1) this is engine ``dp_rank``; ``dp_group`` joins
    this TP rank of every engine core, ``step_group`` (gloo, on the CPU) every rank of
    every engine core for the per-step agreement; ``ep_group`` all the expert-parallel ranks
    (in ``ep_rank`` order) for ``--all2all-backend all_to_all``."""

    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None
    pp_rank: int = 0
    pp_size: int = 1
    layers: tuple[int, int] | None = None
    ep_rank: int = 0
    ep_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: Any = None
    step_group: Any = None
    ep_group: Any = None
    all2all_backend: str = "allgather_reducescatter"

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        """The rank whose StepResult the engine reads (vLLM's output rank: TP rank 0 of
        the last pipeline stage)."""
        return self.tp_rank == 0 and self.is_last_stage

    @property
    def prev_stage_rank(self) -> int:
        """The rank this one receives hidden states from (same TP rank, previous stage)."""
        return self.rank - self.tp_size

    @property
    def next_stage_rank(self) -> int:
        return self.rank + self.tp_size

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        return self.layers if self.layers is not None else (0, num_layers)

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


def init_distributed(
    parallel: ParallelConfig, rank: int, device: str, num_layers: int, dp_rank: int = 0
) -> ParallelState:
    """Join the group of ``parallel.group_world_size`` ranks (a no-op for one rank) and
    make one TP group per pipeline stage (per engine core, with engine cores in lock-step:
    then also one group per TP rank across the engine cores, and a gloo group of all).

    Raises ``ConfigError`` naming this rank, the address and the timeout when the group
    does not form in time (a rank or node that never started, or a wrong address)."""
    world = parallel.group_world_size
    if device == "cuda":
        torch.cuda.set_device(local_device_index(parallel, rank, dp_rank))
    if world == 1:
        return rank_state(parallel, rank, num_layers)
    if parallel.master_port is None:
        raise RuntimeError("--master-port is unresolved: the launcher picks one before start")
    global_rank = dp_rank * parallel.world_size + rank if parallel.dp_lockstep else rank
    address = f"{parallel.master_addr}:{parallel.master_port}"
    timeout = datetime.timedelta(seconds=parallel.distributed_timeout)
    try:
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            init_method=f"tcp://{address}",
            rank=global_rank,
            world_size=world,
            timeout=timeout,
        )
    except (RuntimeError, ValueError) as e:  # torch raises DistStoreError (a RuntimeError)
        raise ConfigError(
            f"worker rank {rank}: the group of {world} ranks did not form at {address} "
            f"within {parallel.distributed_timeout:.0f} s ({e})"
        ) from None
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if parallel.dp_lockstep:
        # Every rank creates every group, in the same order (torch.distributed's rule).
        dp = parallel.data_parallel_size
        tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(dp)]
        dp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
        step = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
        return rank_state(
            parallel, rank, num_layers, tp_groups[dp_rank], dp_rank, dp_groups[rank % tp], step,
            ep_group=dist.group.WORLD,
        )  # fmt: skip
    group: Any = dist.group.WORLD
    if pp > 1:
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
        group = groups[rank // tp]
    return rank_state(parallel, rank, num_layers, group, ep_group=group)


def local_device_index(parallel: ParallelConfig, rank: int, dp_rank: int) -> int:
    """The GPU of worker ``rank`` of engine ``dp_rank`` among this machine's: the machine's
    engines in order, each with its ranks on this machine in order."""
    engine = dp_rank - parallel.local_engines.start
    local = parallel.local_ranks
    return (engine * len(local) + rank - local.start) % max(1, torch.cuda.device_count())


def rank_state(
    parallel: ParallelConfig,
    rank: int,
    num_layers: int,
    group: Any = None,
    dp_rank: int = 0,
    dp_group: Any = None,
    step_group: Any = None,
    ep_group: Any = None,
) -> ParallelState:
    """Rank ``rank`` of engine ``dp_rank``'s coordinates in the layout; ``group``: its TP
    group, if one was formed (a backend without collectives, such as the simulated one,
    forms none); ``dp_group``, ``step_group``: as ``init_distributed`` formed them."""
    tp, ep = parallel.tensor_parallel_size, parallel.expert_parallel_size
    lockstep = parallel.dp_lockstep
    return ParallelState(
        rank=rank,
        world_size=parallel.world_size,
        tp_rank=rank % tp,
        tp_size=tp,
        group=group,
        pp_rank=rank // tp,
        pp_size=parallel.pipeline_parallel_size,
        layers=parallel.stage_layers(num_layers)[rank // tp],
        ep_rank=((dp_rank * tp if lockstep else 0) + rank % tp) if ep > 1 else 0,
        ep_size=ep,
        dp_rank=dp_rank if lockstep else 0,
        dp_size=parallel.data_parallel_size if lockstep else 1,
        dp_group=dp_group,
        step_group=step_group,
        ep_group=ep_group,
        all2all_backend=parallel.all2all_backend,
    )


class StageLink:
    """Hands a pipeline stage's ``(hidden, residual)`` to the next stage, point to point
    between the same TP rank of neighbouring stages.

    ``send`` is asynchronous, so a stage moves on to the next micro-batch while the next
    stage takes this one; it waits only for its previous send (one in flight). Both
    sides know the shape from the StepPlan: [2, num_tokens, hidden_size].
    """

    def __init__(self, parallel: ParallelState, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        self.parallel = parallel
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self._in_flight: tuple[torch.Tensor, Any] | None = None

    def recv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        buf = torch.empty(2, num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(buf, src=self.parallel.prev_stage_rank)
        return buf[0], buf[1]

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        if self._in_flight is not None:
            self._in_flight[1].wait()
        buf = torch.stack([hidden, residual])
        self._in_flight = (buf, dist.isend(buf, dst=self.parallel.next_stage_rank))
