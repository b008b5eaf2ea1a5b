"""The two halves of a KV connector, named after vLLM's KVConnectorBase_V1 where they mean
the same.

Scheduler half (in the scheduler process), per request:
``request_added`` (check its ``kv_transfer_params``) -> ``get_num_new_matched_tokens``
(prompt tokens an outside source supplies, and whether they arrive asynchronously) ->
``update_state_after_alloc`` (the blocks they go into) -> ... -> ``request_finished``
(free its blocks now, or hold them for a transfer, with the params the client gets).
Per step: ``build_connector_meta`` (bytes the workers get in the StepPlan). When a
rank reports (``KVTransferDone``): ``update_connector_output``.

Worker half (in every worker rank): ``register_kv_caches`` once the cache exists,
``bind_connector_metadata`` at the start of every step (saves what the step may
overwrite), then ``start_load_kv`` (starts the step's loads), and a ``report`` callable
it calls, from any thread, when transfers end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from services.config.kv_transfer import KVTransferConfig
from services.flags import ConfigError
from services.protocol import KVLayout, KVTransferDone
from services.registry import KV_CONNECTORS, resolve

if TYPE_CHECKING:
    import torch

    from services.config import EngineConfig
    from services.kv_cache.free_block_queue import KVCacheBlock
    from services.protocol import BlockHash, KVCacheEvent
    from services.request import Request


@dataclass
class TransferOutcome:
    """Requests whose transfers every rank has finished (``update_connector_output``)."""

    sent: list[str] = field(default_factory=list)  # holds over: free their blocks
    loaded: list[str] = field(default_factory=list)  # KV in place: schedule them
    failed: list[str] = field(default_factory=list)  # load failed: recompute them


class KVConnectorScheduler(ABC):
    """``kv_block_bytes``: one KV block's bytes summed over the engine's worker ranks (what
    a connector that stores blocks sizes its store by)."""

    # Blocks reach other servers (p2p pulls, a shared storage directory): their fp8 KV
    # scales must then be the same everywhere, so never measured per server.
    moves_blocks_between_servers: ClassVar[bool] = True

    def __init__(
        self, config: KVTransferConfig, engine: EngineConfig, kv_block_bytes: int = 0
    ) -> None:
        if engine.cache.calculate_kv_scales and self.moves_blocks_between_servers:
            raise ConfigError(
                f"--calculate-kv-scales with the {config.kv_connector} KV connector: each "
                "server would measure its own fp8 scales and read the others' blocks with "
                "the wrong ones; use the checkpoint's scales (or 1.0)"
            )
        self.config = config
        self.kv_block_bytes = kv_block_bytes
        self.enable_kv_cache_events = False  # whether take_events is called (the scheduler's)

    def enable_events(self, enabled: bool) -> None:
        """The scheduler publishes KV events: keep those of the connector's tiers."""
        self.enable_kv_cache_events = enabled

    @classmethod  # noqa: B027 - optional hook
    def check_params(
        cls, params: dict[str, Any], config: KVTransferConfig, engine: EngineConfig
    ) -> None:
        """Refuse ``kv_transfer_params`` this connector cannot honour (ValueError with a
        message for the client). The tokenizer asks before the request is queued, so the
        client gets a 400."""

    def request_added(self, request: Request) -> None:  # noqa: B027 - optional hook
        """Take in a new request (its params already passed ``check_params``); ValueError
        refuses it."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Prompt tokens after the local ``num_computed_tokens`` that this connector can
        supply, and whether they load asynchronously (the request then waits for them)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request's block table now covers the external tokens: plan their load."""

    def drop_load(self, request: Request) -> None:  # noqa: B027 - optional hook
        """Another connector loads this request's prompt (``multi``): give up what this one
        offered (p2p releases the prefill instance's hold)."""

    @abstractmethod
    def build_connector_meta(self) -> bytes:
        """This step's work for the worker halves (b"" when there is none)."""

    @abstractmethod
    def request_finished(
        self, request: Request, blocks: list[KVCacheBlock]
    ) -> tuple[bool, dict[str, Any] | None]:
        """(hold the blocks until the workers report, ``kv_transfer_params`` for the client)."""

    @abstractmethod
    def update_connector_output(self, done: KVTransferDone) -> TransferOutcome:
        """Take in one rank's report; return what every rank has now finished."""

    def has_pending_metadata(self) -> bool:
        """Work for the workers not yet in a plan: worth a step with nothing to compute."""
        return False

    # The block pool's changes, for connectors that keep blocks beyond the pool (offload,
    # storage: ``keeps_blocks``). Called in ``schedule()`` / ``update_from_output``, so what
    # they ask of the workers goes out in the same plan's metadata: workers run it before
    # the forward that may overwrite the block.
    keeps_blocks = False

    def on_block_cached(self, block_hash: BlockHash, block_id: int) -> None:  # noqa: B027
        """A full, computed block entered the prefix cache under ``block_hash``."""

    def on_block_evicted(self, block_hash: BlockHash, block_id: int) -> None:  # noqa: B027
        """A cached-free block is about to be reused: its content is still intact."""

    def reset_prefix_cache(self) -> None:  # noqa: B027 - optional hook
        """The prefix cache was reset (/reset_prefix_cache): forget tiers kept beyond it."""

    def take_events(self) -> list[KVCacheEvent]:
        """KV events of the connector's own tiers since the last call (``medium`` names it)."""
        return []


class KVConnectorWorker(ABC):
    def __init__(
        self,
        config: KVTransferConfig,
        engine: EngineConfig,
        rank: int,
        report: Callable[[KVTransferDone], None],
    ) -> None:
        self.config = config
        self.rank = rank
        self.report = report
        # A simulated backend (no KV tensors): the link a transfer crosses (bytes/s,
        # latency s) and --sim-speed. Transfers then move no data and take modelled time.
        self.simulated_link: tuple[float, float, float] | None = None

    @abstractmethod
    def register_kv_caches(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout
    ) -> None:
        """This rank's (K, V) cache per layer, each [num_blocks, block_size, heads, dim]."""

    @abstractmethod
    def bind_connector_metadata(self, metadata: bytes) -> None:
        """A step's metadata, before it runs: take it in, and save the blocks it names
        before returning (the step may overwrite them)."""

    def start_load_kv(self) -> None:  # noqa: B027 - optional hook
        """Start the loads the bound metadata asks for (after every connector's
        ``bind_connector_metadata``, so no load writes a block another still saves)."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Stop the connector's threads and close its sockets."""


def connector_class(name: str, half: int) -> Any:
    """The registered connector's scheduler (0) or worker (1) half."""
    return resolve(KV_CONNECTORS[name][half])


def create_scheduler_connector(
    engine: EngineConfig, kv_block_bytes: int = 0
) -> KVConnectorScheduler | None:
    cfg = engine.kv_transfer
    return (
        None if cfg is None else connector_class(cfg.kv_connector, 0)(cfg, engine, kv_block_bytes)
    )  # type: ignore[no-any-return]


def params_check(engine: EngineConfig) -> Callable[[dict[str, Any]], None] | None:
    """``check_params`` of the configured connector, for the tokenizer; None without one."""
    cfg = engine.kv_transfer
    if cfg is None:
        return None
    cls = connector_class(cfg.kv_connector, 0)
    return lambda params: cls.check_params(params, cfg, engine)  # type: ignore[no-any-return]


def create_worker_connector(
    engine: EngineConfig, rank: int, report: Callable[[KVTransferDone], None]
) -> KVConnectorWorker | None:
    cfg = engine.kv_transfer
    return None if cfg is None else connector_class(cfg.kv_connector, 1)(cfg, engine, rank, report)  # type: ignore[no-any-return]
