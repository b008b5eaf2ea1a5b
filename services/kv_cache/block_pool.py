"""The pool of KV cache blocks: allocation, freeing, and the prefix cache over them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from services.kv_cache.free_block_queue import FreeBlockQueue, KVCacheBlock
from services.kv_cache.metrics import KVCacheMetrics, PrefixCacheStats
from services.protocol import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVCacheEvent

NULL_BLOCK_ID = 0


class BlockListener(Protocol):
    """Told of blocks entering and leaving the prefix cache (a KV connector that keeps
    blocks beyond the pool: ``offload``, ``storage``)."""

    def on_block_cached(self, block_hash: BlockHash, block_id: int) -> None: ...

    def on_block_evicted(self, block_hash: BlockHash, block_id: int) -> None: ...


class BlockPool:
    """All ``num_blocks`` KV blocks; every block is in use, cached-free or free.

    - in use: ``ref_cnt > 0`` (held by that many block tables), not in the free queue;
    - cached-free: ``ref_cnt == 0`` with a hash, in the free queue, still a prefix hit;
    - free: ``ref_cnt == 0`` without a hash, in the free queue.

    ``get_new_blocks`` takes blocks from the free queue's head and evicts a
    cached one lazily, only when it is handed out again (``BlockRemoved``).
    ``touch`` takes hit blocks out of the free queue. ``free_blocks`` puts
    blocks at the tail in the order given, so callers pass the block to evict
    first first. At most one block per hash is cached: block tables are
    append-only, so a block that fills with content already cached stays
    uncached rather than replacing the other.

    Block ``NULL_BLOCK_ID`` (0) is reserved, as in vLLM: it is never handed
    out, so a worker may point padding slots (CUDA graphs, padded block
    tables) at it without corrupting anyone's KV. ``num_usable_blocks`` is
    ``num_blocks - 1``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_kv_cache_events: bool = False,
        metrics: KVCacheMetrics | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"a block pool needs at least 2 blocks (one is reserved), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.enable_kv_cache_events = enable_kv_cache_events
        self._events: list[KVCacheEvent] = []
        self.metrics = metrics
        self.prefix_cache_stats = PrefixCacheStats()
        self.listener: BlockListener | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free plus cached-free."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Share of usable blocks in use (cached-free blocks count as free), in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out ``num_blocks`` blocks with ``ref_cnt == 1``, evicting cached ones at the head."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        evicted: list[BlockHash] = []
        for block in blocks:
            if self.metrics is not None:
                self.metrics.on_evicted(block.block_id)
                self.metrics.on_allocated(block.block_id)
            if block.block_hash is not None:
                del self.cached_block_hash_to_block[block.block_hash]
                evicted.append(block.block_hash)
                if self.listener is not None:
                    self.listener.on_block_evicted(block.block_hash, block.block_id)
                block.block_hash = None
            block.ref_cnt = 1
            block.generation += 1
        if evicted and self.enable_kv_cache_events:
            self._events.append(BlockRemoved(block_hashes=evicted))
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks; a cached-free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            if self.metrics is not None:
                self.metrics.on_hit(block.block_id)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; those no one holds go to the free queue's tail in order."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
                if self.metrics is not None:
                    self.metrics.on_released(block.block_id)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int],
    ) -> None:
        """Enter ``blocks[num_cached_blocks:num_full_blocks]`` (now full and computed) in the cache.

        ``block_hashes`` and ``token_ids`` are the owning request's. One
        ``BlockStored`` event goes out per run of blocks actually stored.
        """
        run: list[BlockHash] = []
        run_start = num_cached_blocks
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is None and block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block
                if self.listener is not None:
                    self.listener.on_block_cached(block_hash, block.block_id)
                if not run:
                    run_start = i
                run.append(block_hash)
                continue
            self._emit_stored(run, run_start, block_hashes, token_ids)
            run = []
        self._emit_stored(run, run_start, block_hashes, token_ids)

    def _emit_stored(
        self,
        run: list[BlockHash],
        start: int,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
    ) -> None:
        if not run or not self.enable_kv_cache_events:
            return
        bs = self.block_size
        self._events.append(
            BlockStored(
                block_hashes=run,
                parent_block_hash=block_hashes[start - 1] if start else None,
                token_ids=list(token_ids[start * bs : (start + len(run)) * bs]),
                block_size=bs,
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is in use."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.metrics is not None:
            self.metrics.reset()
        if self.enable_kv_cache_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events since the last call, in order."""
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` if the pool's own invariants do not hold."""
        free = list(self.free_block_queue)
        problems: list[str] = []
        if len(free) != self.free_block_queue.num_free_blocks:
            problems.append(
                f"free queue holds {len(free)} blocks but counts {self.free_block_queue.num_free_blocks}"
            )
        if len({b.block_id for b in free}) != len(free):
            problems.append("a block is in the free queue twice")
        if any(b.block_id == NULL_BLOCK_ID for b in free):
            problems.append("the null block is in the free queue")
        for block in self.blocks[1:]:
            in_queue = block.prev_free_block is not None
            if (block.ref_cnt == 0) != in_queue:
                problems.append(f"{block}: in free queue={in_queue}")
            if block.ref_cnt < 0:
                problems.append(f"{block}: negative ref_cnt")
            if block.block_hash is not None and (
                self.cached_block_hash_to_block.get(block.block_hash) is not block
            ):
                problems.append(f"{block}: hash not mapped to it")
        for block_hash, block in self.cached_block_hash_to_block.items():
            if block.block_hash != block_hash:
                problems.append(f"{block}: mapped under a hash it does not carry")
        in_use = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        cached_free = sum(1 for b in free if b.block_hash is not None)
        plain_free = len(free) - cached_free
        if plain_free + in_use + cached_free != self.num_usable_blocks:
            problems.append(
                f"free {plain_free} + in use {in_use} + cached-free {cached_free} "
                f"!= {self.num_usable_blocks} usable blocks"
            )
        if problems:
            raise RuntimeError("block pool integrity: " + "; ".join(problems))
