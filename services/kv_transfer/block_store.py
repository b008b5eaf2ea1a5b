"""What the connectors that keep prefix blocks beyond the device pool share (``offload``:
host memory; ``storage``: files).

Scheduler half: an index of the block hashes the store holds. A waiting request whose
next prompt blocks (after its device-cache hit) are all stored gets them loaded instead
of computed: ``get_num_new_matched_tokens`` counts the stored run,
``update_state_after_alloc`` plans the copy into the request's new blocks, the request
waits in ``WAITING_FOR_REMOTE_KVS`` until every rank reports the copy, then computes
the rest of its prompt. What goes into the store is each connector's choice, from the
block pool's hooks (``on_block_evicted``: offload; ``on_block_cached``: storage), and
goes out in the same step's metadata, so the workers save it before the step's forward
can overwrite it. A failed load forgets the blocks it named (the request recomputes;
it will not try them again).

Worker half: ``bind_connector_metadata`` saves (synchronously, before the forward);
``start_load_kv`` copies stored blocks into the cache and reports each load. Blocks
travel as one tensor per block, ``[layers, 2 (K, V), block_size, heads, head_dim]``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

from services.config.kv_transfer import KVTransferConfig
from services.flags import ConfigError
from services.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker, TransferOutcome
from services.protocol import (
    BlockRemoved,
    BlockStored,
    BlockStoreLoad,
    BlockStoreMetadata,
    KVCacheEvent,
    KVLayout,
    KVTransferDone,
)

if TYPE_CHECKING:
    import torch

    from services.config import EngineConfig
    from services.kv_cache.free_block_queue import KVCacheBlock
    from services.protocol import BlockHash
    from services.request import Request

logger = logging.getLogger(__name__)
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(BlockStoreMetadata)

Key = int | str  # where a block is stored: a host slot, a file name
_GATHER_BLOCKS = 64


class BlockStoreScheduler(KVConnectorScheduler):
    """The index and the per-step work of a block store; subclasses say where a hash is
    stored (``key_of``) and when a block goes in."""

    medium = "CPU"  # the tier's name in KV events (vLLM's ``medium``)
    keeps_blocks = True

    def __init__(
        self, config: KVTransferConfig, engine: EngineConfig, kv_block_bytes: int = 0
    ) -> None:
        super().__init__(config, engine, kv_block_bytes)
        if not engine.cache.enable_prefix_caching:
            raise ConfigError(
                f"--kv-transfer-config {config.kv_connector} keeps prefix blocks by their "
                "hash: it needs prefix caching (drop --no-enable-prefix-caching)"
            )
        self.block_size = engine.cache.block_size
        self.num_ranks = engine.parallel.world_size
        self._meta = BlockStoreMetadata()
        self._start: dict[str, int] = {}  # request -> first stored block it matched
        self._loading: dict[str, list[BlockHash]] = {}  # request -> the hashes it loads
        self._reported: dict[str, set[int]] = {}  # request -> ranks done with its load
        self._failed: set[str] = set()
        self._events: list[KVCacheEvent] = []

    # ------------------------------------------------------------------ the index

    def key_of(self, block_hash: BlockHash) -> Key | None:
        """Where the block is stored; None if it is not."""
        raise NotImplementedError

    def forget(self, block_hash: BlockHash) -> None:
        """Drop a stored block (a load of it failed)."""
        raise NotImplementedError

    def touch(self, hashes: list[BlockHash]) -> None:  # noqa: B027 - optional hook
        """These blocks were asked for, in this order: recently used (LRU stores)."""

    def keep_for_load(self, key: Key) -> None:  # noqa: B027 - optional hook
        """``key`` is loaded by this step: keep it until the metadata is built."""

    def save(self, key: Key, block_id: int, block_hash: BlockHash) -> None:
        self._meta.save_keys.append(key)
        self._meta.save_block_ids.append(block_id)
        self.stored_event(BlockStored([block_hash], None, [], self.block_size, medium=self.medium))

    def stored_event(self, event: KVCacheEvent) -> None:
        if self.enable_kv_cache_events:
            self._events.append(event)

    def removed(self, block_hash: BlockHash) -> None:
        self.stored_event(BlockRemoved([block_hash], medium=self.medium))

    # ------------------------------------------------------------------ connector

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        bs = self.block_size
        if request.skip_reading_prefix_cache or num_computed_tokens % bs:
            return 0, False
        start = num_computed_tokens // bs
        keys, hashes = [], []
        for block_hash in request.block_hashes[start:]:
            if (key := self.key_of(block_hash)) is None:
                break
            keys.append(key)
            hashes.append(block_hash)
        self.touch(hashes[::-1])  # last first: a chain's head is evicted last
        # The last prompt token is always computed: it samples.
        num_tokens = min((start + len(keys)) * bs, request.num_tokens - 1) - num_computed_tokens
        if num_tokens <= 0:
            return 0, False
        for key in keys:
            self.keep_for_load(key)
        self._start[request.req_id] = start
        return num_tokens, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        start = self._start.pop(request.req_id, None)
        if start is None or not num_external_tokens:
            return
        end = start + -(-num_external_tokens // self.block_size)
        hashes = request.block_hashes[start:end]
        keys = [self.key_of(h) for h in hashes]
        assert None not in keys, "stored blocks matched this step went missing"
        self._meta.loads.append(BlockStoreLoad(request.req_id, keys, block_ids[start:end]))  # type: ignore[arg-type]
        self._loading[request.req_id] = hashes
        self._reported[request.req_id] = set()

    def build_connector_meta(self) -> bytes:
        self._start.clear()  # matched but not admitted: asked again next step
        meta, self._meta = self._meta, BlockStoreMetadata()
        if not (meta.save_keys or meta.loads):
            return b""
        return _encoder.encode(meta)

    def request_finished(
        self, request: Request, blocks: list[KVCacheBlock]
    ) -> tuple[bool, dict[str, Any] | None]:
        # A request aborted while its blocks are being written keeps them until the
        # workers report: the scheduler then frees them.
        return request.req_id in self._loading, None

    def update_connector_output(self, done: KVTransferDone) -> TransferOutcome:
        out = TransferOutcome()
        for req_id in done.failed_recving:
            if req_id in self._loading:
                self._failed.add(req_id)
        for req_id in [*done.finished_recving, *done.failed_recving]:
            ranks = self._reported.get(req_id)
            if ranks is None:
                continue
            ranks.add(done.rank)
            if len(ranks) < self.num_ranks:
                continue
            del self._reported[req_id]
            hashes = self._loading.pop(req_id)
            if req_id in self._failed:
                self._failed.discard(req_id)
                for block_hash in hashes:
                    self.forget(block_hash)
                out.failed.append(req_id)
            else:
                out.loaded.append(req_id)
        return out

    def has_pending_metadata(self) -> bool:
        return bool(self._meta.save_keys or self._meta.loads)

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events


class BlockStoreWorker(KVConnectorWorker):
    """Gathers the blocks a step saves (before its forward) and scatters loaded ones;
    subclasses keep them (``put``) and give them back (``get``)."""

    def __init__(self, config: KVTransferConfig, engine: Any, rank: int, report: Any) -> None:
        super().__init__(config, engine, rank, report)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.layout: KVLayout | None = None
        self._loads: list[BlockStoreLoad] = []

    def register_kv_caches(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout
    ) -> None:
        if not kv_caches:
            raise ConfigError(
                f"--kv-transfer-config {self.config.kv_connector} copies KV blocks; this "
                "worker backend holds none (the simulated backend models no KV data)"
            )
        self.kv_caches = kv_caches
        self.layout = layout

    def bind_connector_metadata(self, metadata: bytes) -> None:
        if not metadata:
            return
        meta = _decoder.decode(metadata)
        keys, ids = meta.save_keys, meta.save_block_ids
        for start in range(0, len(keys), _GATHER_BLOCKS):  # bounded device temporaries
            blocks = self.gather(ids[start : start + _GATHER_BLOCKS])
            for i, key in enumerate(keys[start : start + _GATHER_BLOCKS]):
                self.put(key, blocks[:, :, i])
        self._loads.extend(meta.loads)

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """The cache blocks, ``[layers, 2, len(block_ids), block_size, heads, head_dim]``."""
        import torch

        from actorserve_kernels.kv_quant import as_bytes

        k0 = self.kv_caches[0][0]
        ids = torch.tensor(block_ids, device=k0.device)
        # As bytes, then as the cache's dtype: a quantized cache's blocks move as stored.
        return torch.stack(
            [
                torch.stack((as_bytes(k).index_select(0, ids), as_bytes(v).index_select(0, ids)))
                for k, v in self.kv_caches
            ]
        ).view(k0.dtype)

    def scatter(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write ``[layers, 2, n, ...]`` into the cache blocks ``block_ids``."""
        import torch

        device = self.kv_caches[0][0].device
        ids = torch.tensor(block_ids, device=device)
        from actorserve_kernels.kv_quant import as_bytes

        blocks = as_bytes(blocks.to(device=device, dtype=self.kv_caches[0][0].dtype))
        for layer, (k, v) in enumerate(self.kv_caches):
            as_bytes(k).index_copy_(0, ids, blocks[layer, 0])
            as_bytes(v).index_copy_(0, ids, blocks[layer, 1])

    def put(self, key: Key, block: torch.Tensor) -> None:
        """Keep one block (``[layers, 2, block_size, heads, head_dim]``, a view: copy it)."""
        raise NotImplementedError

    def get(self, key: Key) -> torch.Tensor:
        """One stored block as ``put`` took it; raises if it cannot be read."""
        raise NotImplementedError

    def load(self, load: BlockStoreLoad) -> bool:
        """Copy one request's stored blocks into its cache blocks; False if any failed."""
        import torch

        try:
            for start in range(0, len(load.keys), _GATHER_BLOCKS):
                part = slice(start, start + _GATHER_BLOCKS)
                blocks = torch.stack([self.get(key) for key in load.keys[part]], dim=2)
                self.scatter(load.block_ids[part], blocks)
        except Exception:
            logger.exception(
                "%s: loading %d blocks of %s failed; it recomputes them",
                self.config.kv_connector,
                len(load.keys),
                load.req_id,
            )
            return False
        return True

    def report_loads(self, loads: list[tuple[str, bool]]) -> None:
        if loads:
            self.report(
                KVTransferDone(
                    self.rank,
                    finished_recving=[r for r, ok in loads if ok],
                    failed_recving=[r for r, ok in loads if not ok],
                )
            )
