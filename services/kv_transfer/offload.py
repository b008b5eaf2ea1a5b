"""``offload``: a host-memory tier under the device KV pool (``--kv-offload-bytes``).

A prefix block the device pool evicts (to hand the block to another request) is copied
to host memory first, and a later request whose prompt continues past its device hit
with blocks the tier holds loads them instead of computing them (see ``block_store``).
The tier is LRU over its slots; a slot that this step loads from is never reused by it.
KV events name the tier ``medium: "CPU"`` (stored when a block goes in, removed when it
is evicted), so a KV-aware router can count it too.

On a GPU the tier is CPU RAM. On a CPU it is a second tier in the same memory, worth it
as a larger one: ``kv_connector_extra_config.kv_offload_dtype: "int8"`` keeps each block
as int8 with one scale per token and head (absmax / 127): 3.8x as many fp32 blocks in the
same bytes, at an accuracy cost that bench/RESULTS.md measures.

``kv_connector_extra_config``: ``kv_offload_bytes`` (the tier's size over all ranks, as
vLLM's ``--kv-offloading-size``), ``kv_offload_dtype`` ("auto": the cache's; "int8").
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from services.config.kv_transfer import KVTransferConfig
from services.flags import ConfigError
from services.kv_transfer.block_store import BlockStoreScheduler, BlockStoreWorker, Key

if TYPE_CHECKING:
    import torch

    from services.config import EngineConfig
    from services.protocol import BlockHash

_DTYPES = ("auto", "int8")
_CHUNK = 64  # host slots allocated at a time
_DTYPE_BYTES = {"float32": 4, "float": 4}  # the rest are 2-byte types


def _offload_dtype(config: KVTransferConfig) -> str:
    dtype = config.kv_connector_extra_config.get("kv_offload_dtype", "auto")
    if dtype not in _DTYPES:
        raise ConfigError(
            f"--kv-transfer-config: kv_connector_extra_config.kv_offload_dtype must be one of "
            f"{', '.join(_DTYPES)}, got {dtype!r}"
        )
    return str(dtype)


def slot_bytes(kv_block_bytes: int, dtype: str, engine: EngineConfig) -> int:
    """A block's bytes in the tier (all ranks): as in the cache, or int8 plus scales."""
    if dtype == "auto":
        return kv_block_bytes
    name = engine.model.dtype
    if name == "auto":
        elem = 2 if engine.worker.resolved_device() == "cuda" else 4
    else:
        elem = _DTYPE_BYTES.get(name, 2)
    elements = kv_block_bytes // elem
    # int8, and a float32 scale per head_dim values (>= 64 in the models served; with 32,
    # the tier would outgrow its size by 6 %)
    return elements + elements // 16


class OffloadConnectorScheduler(BlockStoreScheduler):
    moves_blocks_between_servers = False  # one server's host memory

    def __init__(
        self, config: KVTransferConfig, engine: EngineConfig, kv_block_bytes: int = 0
    ) -> None:
        super().__init__(config, engine, kv_block_bytes)
        if "kv_offload_bytes" not in config.kv_connector_extra_config:
            raise ConfigError(
                "--kv-transfer-config offload needs kv_connector_extra_config.kv_offload_bytes "
                "(or give --kv-offload-bytes)"
            )
        size = config.extra("kv_offload_bytes", 0.0)
        if kv_block_bytes <= 0:
            raise ConfigError("--kv-offload-bytes: this worker backend holds no KV cache")
        if _offload_dtype(config) == "int8" and engine.cache.kv_cache_dtype != "auto":
            raise ConfigError(
                "kv_offload_dtype int8 quantizes a float KV cache's blocks for the host tier; "
                f"with --kv-cache-dtype {engine.cache.kv_cache_dtype} they are stored as the "
                "cache holds them (leave kv_offload_dtype auto)"
            )
        per_slot = slot_bytes(kv_block_bytes, _offload_dtype(config), engine)
        self.capacity = int(size // per_slot)
        if self.capacity < 1:
            raise ConfigError(
                f"--kv-offload-bytes {int(size)} holds no KV block (one takes {per_slot} bytes)"
            )
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self._free = list(range(self.capacity - 1, -1, -1))
        self._kept: set[int] = set()  # slots this step loads from

    def key_of(self, block_hash: BlockHash) -> Key | None:
        return self._slots.get(block_hash)

    def touch(self, hashes: list[BlockHash]) -> None:
        for block_hash in hashes:
            self._slots.move_to_end(block_hash)

    def keep_for_load(self, key: Key) -> None:
        assert isinstance(key, int)
        self._kept.add(key)

    def forget(self, block_hash: BlockHash) -> None:
        if (slot := self._slots.pop(block_hash, None)) is not None:
            self._free.append(slot)
            self.removed(block_hash)

    def on_block_evicted(self, block_hash: BlockHash, block_id: int) -> None:
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return
        slot = self._free.pop() if self._free else self._evict()
        if slot is None:
            return  # every slot is being loaded from in this step: the block is lost
        self._slots[block_hash] = slot
        self.save(slot, block_id, block_hash)

    def _evict(self) -> int | None:
        """The least recently used slot no load of this step reads."""
        for block_hash, slot in self._slots.items():
            if slot not in self._kept:
                del self._slots[block_hash]
                self.removed(block_hash)
                return slot
        return None

    def build_connector_meta(self) -> bytes:
        self._kept.clear()
        return super().build_connector_meta()

    def reset_prefix_cache(self) -> None:
        # Only called with no block in use, so no load is in flight.
        self._slots.clear()
        self._free = list(range(self.capacity - 1, -1, -1))

    @property
    def num_stored(self) -> int:
        return len(self._slots)


class OffloadConnectorWorker(BlockStoreWorker):
    """This rank's host slots: chunks of ``_CHUNK`` blocks, allocated as first used (the
    scheduler bounds how many). int8 slots keep a float32 scale per (layer, K/V, token,
    head)."""

    def __init__(self, config: KVTransferConfig, engine: Any, rank: int, report: Any) -> None:
        super().__init__(config, engine, rank, report)
        self.int8 = _offload_dtype(config) == "int8"
        self._chunks: list[torch.Tensor] = []
        self._scales: list[torch.Tensor] = []

    def _slot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        import torch

        while slot >= len(self._chunks) * _CHUNK:
            k = self.kv_caches[0][0]
            shape = (_CHUNK, len(self.kv_caches), 2, *k.shape[1:])
            on_gpu = k.device.type == "cuda"
            self._chunks.append(
                torch.empty(shape, dtype=torch.int8 if self.int8 else k.dtype, pin_memory=on_gpu)
            )
            if self.int8:
                self._scales.append(torch.empty((_CHUNK, len(self.kv_caches), 2, *k.shape[1:3])))
        i, j = divmod(slot, _CHUNK)
        return self._chunks[i][j], (self._scales[i][j] if self.int8 else None)

    def put(self, key: Key, block: torch.Tensor) -> None:
        assert isinstance(key, int)
        data, scale = self._slot(key)
        if scale is None:
            data.copy_(block, non_blocking=False)
            return
        q, s = quantize_int8(block)
        data.copy_(q)
        scale.copy_(s)

    def get(self, key: Key) -> torch.Tensor:
        assert isinstance(key, int)
        data, scale = self._slot(key)
        if scale is None:
            return data
        return dequantize_int8(data, scale)

    def start_load_kv(self) -> None:
        # Host to device copies are quick: done here, before the forward, and reported.
        loads, self._loads = self._loads, []
        self.report_loads([(load.req_id, self.load(load)) for load in loads])


def quantize_int8(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[layers, 2, block_size, heads, dim]`` -> int8 of that shape and float32 scales
    ``[layers, 2, block_size, heads]``: one per token and head (absmax of its ``dim``
    values / 127), llama.cpp's Q8_0 idea over a head's vector."""
    import torch

    x = block.float()
    scale = x.abs().amax(dim=4).clamp_min(1e-12) / 127.0
    q = torch.round(x / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.cpu(), scale.cpu()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None]
