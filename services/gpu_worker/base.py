"""The contract of a worker backend: what one worker rank does with StepPlans.

Backends register by name in ``services/registry.py``
(``--worker-backend``). The same object serves a rank in a worker process
(``worker.py``) and the single rank of the offline engine (``UniprocExecutor``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from services.config import EngineConfig
from services.gpu_worker.distributed import ParallelState
from services.protocol import KVLayout, StepPlan, StepResult


class WorkerBackend(ABC):
    """One worker rank: the model shard (or its stand-in), its KV cache, its persistent batch.

    Lifecycle: construct (load weights) -> ``determine_num_blocks()`` (what fits this
    rank's memory budget; the engine takes the minimum over ranks) ->
    ``initialize_kv_cache(num_blocks)`` -> ``capture_cuda_graphs()`` -> ``execute(plan)``
    per step, in step order.
    Every rank executes every plan (collectives pair up across ranks); every rank
    returns the same sampled tokens, and the engine reads the output rank's result.
    """

    # The ranks run torch.distributed collectives (False: no process group is formed).
    uses_collectives: bool = True

    @abstractmethod
    def __init__(self, config: EngineConfig, folder: Path | None, parallel: ParallelState) -> None:
        """Load what the rank needs; raise ``ConfigError`` for a user mistake."""

    @abstractmethod
    def determine_num_blocks(self) -> int: ...

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute(self, plan: StepPlan) -> StepResult: ...

    def capture_cuda_graphs(self) -> None:
        """Record what later steps replay (the model runner's decode graphs, on CUDA), once
        the KV cache exists; nothing where the backend has nothing to record."""
        return None

    def begin_dp_step(self, num_tokens: tuple[int, ...]) -> None:
        """Expert parallelism over data-parallel engines (``ParallelConfig.dp_lockstep``):
        before each step every rank of every engine core learns how many tokens each
        engine core's step holds (0 for an engine with nothing to run), in engine order.
        The MoE layers size their dispatch by it; nothing for a backend without them."""
        return None

    def execute_dummy(self) -> None:
        """This engine core has no tokens in a step the others run (``dp_lockstep``): take
        part in the expert layers' collectives with none of its own (vLLM's dummy
        forward), so the other engine cores' tokens reach this rank's experts."""
        return None

    def expert_load(self) -> list[int] | None:
        """Routed (token, expert) pairs per expert over every MoE layer since the last call,
        as this rank saw them; None for a model without experts."""
        return None

    def kv_cache_bytes_per_block(self) -> int:
        """This rank's bytes per KV block (its shard of every layer it holds); 0 where
        the backend holds no KV."""
        return 0

    def kv_caches_for_transfer(self) -> tuple[list[Any], KVLayout] | None:
        """This rank's (K, V) cache tensors per layer and their layout, for a KV connector
        (the simulated backend: no tensors, the layout it models; see
        ``simulated_kv_link``); None where the backend cannot take part in transfers."""
        return None

    def simulated_kv_link(self) -> tuple[float, float, float] | None:
        """Where the backend has no KV tensors but models them (the simulated one): the
        link a KV transfer crosses (bytes/s, latency s) and the simulated time's speed
        (``--sim-speed``); the connector then moves no data and takes the modelled time."""
        return None

    def device_seconds(self) -> tuple[float, float] | None:
        """(busy, idle) seconds of the device so far, where the backend models a device's
        timeline (the simulated one); None otherwise."""
        return None
