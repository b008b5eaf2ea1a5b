"""Per-request block tables on top of the block pool: prefix hits, slot allocation, freeing."""

from __future__ import annotations

from services.kv_cache.block_pool import BlockPool
from services.kv_cache.free_block_queue import KVCacheBlock
from services.kv_cache.metrics import KVCacheMetrics
from services.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Gives each request a block table covering its computed tokens.

    Blocks enter the prefix cache only once their KV is computed
    (``cache_blocks``, called after a step ran), so a hit never points at KV
    that has not been written. The price: two requests with the same new
    prefix admitted in one step both compute it; the second one's copy stays
    out of the cache.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        *,
        enable_kv_cache_events: bool = False,
        metrics: KVCacheMetrics | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(
            num_blocks,
            block_size,
            enable_kv_cache_events=enable_kv_cache_events,
            metrics=metrics,
        )
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request not yet holding blocks, and its length in tokens.

        The hit is capped one token short of the end so that a token can be
        sampled: a fully cached prompt computes only its last token. That
        token's KV is then rewritten in place in the last hit block, which
        other requests may share; it is the same value (same tokens at the same
        positions), so they are unaffected. vLLM v1 instead recomputes the
        whole last block; we save up to ``block_size - 1`` tokens of prefill.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, min(len(blocks) * self.block_size, request.num_tokens - 1)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Grow the request's table to hold ``num_new_tokens`` more tokens; None if the pool is short.

        ``new_computed_blocks`` (a prefix hit, for a request being admitted)
        are added to the table first. Returns only the newly allocated blocks.
        On None nothing has changed.
        """
        hits = new_computed_blocks or []
        table = self.req_to_blocks.get(request.req_id)
        is_new = table is None
        if table is None:
            table = []
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_to_allocate = cdiv(num_tokens, self.block_size) - len(table) - len(hits)
        if num_to_allocate <= 0 and not is_new:
            return []  # most decode steps: the last block still has room
        # Touching a cached-free hit takes it out of the free queue.
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_to_allocate > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None
        if is_new:
            self.req_to_blocks[request.req_id] = table
            self._num_cached_blocks[request.req_id] = len(hits)
        if hits:
            self.block_pool.touch(hits)
            table.extend(hits)
        new_blocks = self.block_pool.get_new_blocks(max(num_to_allocate, 0))
        table.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request) -> None:
        """Enter the request's blocks that are full of computed tokens in the prefix cache."""
        if not self.enable_caching:
            return
        table = self.req_to_blocks.get(request.req_id)
        if table is None:
            return
        num_cached = self._num_cached_blocks[request.req_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(
                table, request.block_hashes, num_cached, num_full, request.all_token_ids
            )
            self._num_cached_blocks[request.req_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, last first, so its chain's tail is evicted first."""
        table = self.req_to_blocks.pop(request.req_id, None)
        self._num_cached_blocks.pop(request.req_id, None)
        if table:
            self.block_pool.free_blocks(reversed(table))

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]

    def record_prefix_cache_query(self, request: Request, num_hit_tokens: int) -> None:
        if self.enable_caching and not request.skip_reading_prefix_cache:
            self.block_pool.prefix_cache_stats.record(
                request.num_tokens, num_hit_tokens, preempted=request.is_recomputing
            )

    def check_integrity(self) -> None:
        """Pool invariants, plus: every block's ref_cnt equals the number of tables holding it."""
        self.block_pool.check_integrity()
        holders: dict[int, int] = {}
        for table in self.req_to_blocks.values():
            for block in table:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        wrong = [
            f"block {b.block_id}: ref_cnt {b.ref_cnt}, in {holders.get(b.block_id, 0)} tables"
            for b in self.block_pool.blocks[1:]
            if b.ref_cnt != holders.get(b.block_id, 0)
        ]
        if self.block_pool.null_block.block_id in holders:
            wrong.append("the null block is in a block table")
        if wrong:
            raise RuntimeError("KV cache integrity: " + "; ".join(wrong))
