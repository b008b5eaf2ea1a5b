"""How one engine core's model is split over worker ranks, and over machines."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field

from services.flags import ConfigError, flag
from services.model_arch import ModelArchConfig

logger = logging.getLogger(__name__)


@dataclass
class ParallelConfig:
    """How the model is split over worker ranks (torch.distributed: NCCL on CUDA, gloo on CPU).

    ``world_size = tensor_parallel_size * pipeline_parallel_size`` workers; rank r is
    TP rank ``r % tp`` of pipeline stage ``r // tp``. The engine core broadcasts each
    StepPlan to every rank and takes the StepResult of TP rank 0 of the last stage
    (vLLM's output rank).
    """

    tensor_parallel_size: int = field(
        default=1,
        metadata=flag("worker ranks that split every layer (Megatron-style)", aliases=("-tp",)),
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata=flag("pipeline stages, each a consecutive run of layers", aliases=("-pp",)),
    )
    pp_layer_partition: str | None = field(
        default=None,
        metadata=flag("layers per stage, e.g. 16,14 (default: as even as possible)"),
    )
    data_parallel_size: int = field(
        default=1,
        metadata=flag(
            "engine cores (scheduler, KV cache, worker ranks each) behind one API server",
            aliases=("-dp",),
        ),
    )
    data_parallel_size_local: int | None = field(
        default=None,
        metadata=flag(
            "engine cores on this machine (default: all of --data-parallel-size)",
            aliases=("-dpl",),
        ),
    )
    data_parallel_start_rank: int = field(
        default=0,
        metadata=flag(
            "the first engine core this machine runs (--headless nodes)", aliases=("-dpr",)
        ),
    )
    data_parallel_address: str = field(
        default="127.0.0.1",
        metadata=flag(
            "the API server node's address, which engine cores on other machines reach",
            aliases=("-dpa",),
        ),
    )
    data_parallel_rpc_port: int = field(
        default=29550,
        metadata=flag(
            "port on --data-parallel-address for engine cores on other machines (uses 2)",
            aliases=("-dpp",),
        ),
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata=flag(
            "MoE layers hold whole experts, num_experts / (TP x DP) per rank, instead of "
            "every expert split by TP; with DP > 1 the engine cores step together",
            aliases=("-ep",),
        ),
    )
    all2all_backend: str = field(
        default="allgather_reducescatter",
        metadata=flag(
            "how expert parallelism moves tokens: allgather_reducescatter (vLLM's default: "
            "every engine's tokens to every rank, the sums back) or all_to_all (each "
            "(token, expert) pair only to the rank holding the expert, and back)",
            choices=("allgather_reducescatter", "all_to_all"),
        ),
    )
    nnodes: int = field(
        default=1, metadata=flag("machines the worker ranks of one engine core span")
    )
    node_rank: int = field(
        default=0, metadata=flag("this machine's place among --nnodes (0 runs the server)")
    )
    master_addr: str = field(
        default="127.0.0.1",
        metadata=flag("node 0's address: the torch.distributed store and, across nodes, the plans"),
    )
    master_port: int | None = field(
        default=None, metadata=flag("port of that store (default: a free one)")
    )
    distributed_executor_backend: str = field(
        default="mp",
        metadata=flag(
            "how an engine core's worker ranks start: mp (processes on this machine; "
            "--nnodes with --headless nodes) or ray (actors placed on a Ray cluster: "
            "launch/ray_ranks.py)",
            choices=("mp", "ray"),
        ),
    )
    data_parallel_backend: str = field(
        default="mp",
        metadata=flag(
            "how data-parallel engine cores start: mp (on this machine, and --headless "
            "engine nodes) or ray (each an actor on a Ray cluster, running an engine node)",
            choices=("mp", "ray"),
            aliases=("-dpb",),
        ),
    )
    distributed_timeout: float = field(
        default=120.0,
        metadata=flag(
            "seconds the ranks wait for each other, to form the group or in a collective"
        ),
    )

    @property
    def ranks_on_ray(self) -> bool:
        return self.distributed_executor_backend == "ray"

    @property
    def engines_on_ray(self) -> bool:
        return self.data_parallel_backend == "ray"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the experts spread over (vLLM's EP size: TP x DP); 1 without
        ``--enable-expert-parallel``."""
        if not self.enable_expert_parallel:
            return 1
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def dp_lockstep(self) -> bool:
        """The engine cores' ranks form one torch.distributed group and step together
        through the MoE layers (expert parallelism over data-parallel engines)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def group_world_size(self) -> int:
        """Ranks in one torch.distributed group: one engine core's, or with
        ``dp_lockstep`` every engine core's (engine d's rank r is ``d * world_size + r``)."""
        return self.world_size * (self.data_parallel_size if self.dp_lockstep else 1)

    @property
    def local_engines(self) -> range:
        """The data-parallel engine cores this machine runs."""
        start = self.data_parallel_start_rank
        local = self.data_parallel_size_local
        return range(start, start + (self.data_parallel_size if local is None else local))

    @property
    def engines_span_nodes(self) -> bool:
        """Some engine cores run on other machines (``--headless`` engine nodes)."""
        return len(self.local_engines) < self.data_parallel_size

    @property
    def local_ranks(self) -> range:
        """The worker ranks this node runs: node k holds the k-th equal share."""
        per_node = self.world_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def stage_layers(self, num_layers: int) -> list[tuple[int, int]]:
        """Each pipeline stage's layers ``[start, end)``: ``--pp-layer-partition``, else an
        even split whose remainder goes to the first stages (the last one also samples)."""
        pp = self.pipeline_parallel_size
        if self.pp_layer_partition is not None:
            sizes = [int(x) for x in self.pp_layer_partition.split(",")]
        else:
            sizes = [num_layers // pp + (i < num_layers % pp) for i in range(pp)]
        if len(sizes) != pp or sum(sizes) != num_layers or min(sizes) < 1:
            raise ConfigError(
                f"--pp-layer-partition {self.pp_layer_partition} must give each of the {pp} "
                f"stages at least one layer, {num_layers} in all"
            )
        starts = [sum(sizes[:i]) for i in range(pp)]
        return [(a, a + n) for a, n in zip(starts, sizes, strict=True)]

    def validate(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.data_parallel_size < 1:
            raise ConfigError(
                f"--data-parallel-size must be at least 1, got {self.data_parallel_size}"
            )
        if self.pipeline_parallel_size < 1:
            raise ConfigError(
                f"--pipeline-parallel-size must be at least 1, got {self.pipeline_parallel_size}"
            )
        if self.pp_layer_partition is not None and not re.fullmatch(
            r"\d+(,\d+)*", self.pp_layer_partition
        ):
            raise ConfigError(
                f"--pp-layer-partition must be comma-separated layer counts, got "
                f"{self.pp_layer_partition!r}"
            )
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank must be in [0, --nnodes), got {self.node_rank} of {self.nnodes}"
            )
        if self.nnodes > 1:
            if self.world_size % self.nnodes:
                raise ConfigError(
                    f"the {self.world_size} worker ranks (tensor x pipeline parallel size) must "
                    f"divide evenly over --nnodes {self.nnodes}"
                )
            if self.master_port is None:
                raise ConfigError("--nnodes > 1 needs --master-port: every node must give the same")
            if self.data_parallel_size > 1 or self.data_parallel_size_local is not None:
                raise ConfigError(
                    "--nnodes > 1 spreads one engine core's ranks over machines; to spread "
                    "data-parallel engine cores use --data-parallel-size-local (and "
                    "--headless on the other machines) instead"
                )
        local, start = self.data_parallel_size_local, self.data_parallel_start_rank
        if local is not None and not 0 <= local <= self.data_parallel_size:
            raise ConfigError(
                f"--data-parallel-size-local must be in [0, {self.data_parallel_size}], got {local}"
            )
        if start < 0 or start + len(self.local_engines) > self.data_parallel_size:
            raise ConfigError(
                f"--data-parallel-start-rank {start} with {len(self.local_engines)} local "
                f"engine cores goes past --data-parallel-size {self.data_parallel_size}"
            )
        if self.master_port is not None:
            # engine d's ranks meet at master_port + d; across nodes plans, results and
            # control use the three ports after it
            after = (
                3
                if self.nnodes > 1 or self.ranks_on_ray
                else 0
                if self.dp_lockstep
                else self.data_parallel_size - 1
            )
            if not 1 <= self.master_port <= 65535 - after:
                used = f": the {after} after it are used too" if after else ""
                raise ConfigError(
                    f"--master-port must be a port number (1-{65535 - after}{used}), "
                    f"got {self.master_port}"
                )
        if self.ranks_on_ray and (self.nnodes > 1 or self.data_parallel_size > 1):
            raise ConfigError(
                "--distributed-executor-backend ray places one engine core's ranks on the "
                "Ray cluster itself: no --nnodes, and no --data-parallel-size > 1"
            )
        if self.engines_on_ray and (self.ranks_on_ray or self.nnodes > 1):
            raise ConfigError(
                "--data-parallel-backend ray runs each engine core (its scheduler and ranks) "
                "in one Ray actor on one node: not with --distributed-executor-backend ray "
                "or --nnodes"
            )
        if not 0 < self.data_parallel_rpc_port < 65535:
            raise ConfigError(
                f"--data-parallel-rpc-port must be a port number, got {self.data_parallel_rpc_port}"
            )
        if self.distributed_timeout <= 0:
            raise ConfigError("--distributed-timeout must be positive")
        if self.enable_expert_parallel:
            if self.pipeline_parallel_size > 1:
                raise ConfigError(
                    "--enable-expert-parallel with --pipeline-parallel-size > 1 is not "
                    "supported; split the model with --tensor-parallel-size and "
                    "--data-parallel-size"
                )
            if self.dp_lockstep and self.engines_span_nodes:
                raise ConfigError(
                    "--enable-expert-parallel over engine cores on other machines "
                    "(--data-parallel-size-local < --data-parallel-size) is not supported; "
                    "run every engine core on this machine"
                )

    def check_fits(self, arch: ModelArchConfig, device: str) -> None:
        """The split must divide the model's heads and MLP, and the ranks must find devices."""
        tp = self.tensor_parallel_size
        heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
        if heads % tp:
            raise ConfigError(
                f"Total number of attention heads ({heads}) must be divisible by tensor "
                f"parallel size ({tp})."
            )
        # vLLM's rule: KV heads are split when there are at least as many as ranks,
        # else each is replicated on tp / num_kv_heads ranks.
        if (kv_heads >= tp and kv_heads % tp) or (kv_heads < tp and tp % kv_heads):
            raise ConfigError(
                f"the model's {kv_heads} KV heads can be neither split over nor replicated "
                f"on {tp} tensor-parallel ranks; use a size that divides {kv_heads} or that "
                f"{kv_heads} divides"
            )
        dense = any(not arch.is_moe_layer(i) for i in range(arch.num_hidden_layers))
        if arch.intermediate_size % tp and (dense or not self.enable_expert_parallel):
            raise ConfigError(
                f"the MLP width ({arch.intermediate_size}) must be divisible by tensor "
                f"parallel size ({tp})"
            )
        if arch.moe_intermediate_size % tp and not self.enable_expert_parallel:
            raise ConfigError(
                f"the experts' MLP width ({arch.moe_intermediate_size}) must be divisible by "
                f"tensor parallel size ({tp})"
            )
        if self.enable_expert_parallel:
            ep = self.expert_parallel_size
            if not arch.is_moe:
                raise ConfigError(
                    f"--enable-expert-parallel needs a mixture-of-experts model; "
                    f"{arch.architecture} has no experts"
                )
            if arch.num_experts % ep:
                raise ConfigError(
                    f"the model's {arch.num_experts} experts cannot be split evenly over the "
                    f"{ep} expert-parallel ranks (tensor x data parallel size); use sizes "
                    f"whose product divides {arch.num_experts}"
                )
        self.stage_layers(arch.num_hidden_layers)  # raises when the partition does not fit
        ranks = len(self.local_ranks) * len(self.local_engines)  # on this machine
        if ranks == 1:
            return
        if device == "cuda":
            import torch

            if ranks > torch.cuda.device_count():
                raise ConfigError(
                    f"{ranks} worker ranks need {ranks} GPUs; torch sees "
                    f"{torch.cuda.device_count()}"
                )
        elif device == "cpu" and ranks > (os.cpu_count() or 1):
            logger.warning(
                "%d worker ranks on %d CPU cores: each rank gets one thread and they share "
                "cores, so this is a test of the code path, not a speed-up",
                ranks,
                os.cpu_count(),
            )
