"""KV cache blocks and the free-block queue: an intrusive doubly linked list in LRU order."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from services.protocol import BlockHash


class KVCacheBlock:
    """One block of ``block_size`` token slots in the paged KV cache.

    ``ref_cnt`` counts the block tables holding the block; ``block_hash`` is
    set while the block is in the prefix cache; ``generation`` counts the times it was
    handed out (a KV transfer checks it: a block freed and reused is not the one named). The prev/next links belong to
    ``FreeBlockQueue`` (the block is its own list node, so removal is O(1)).
    """

    __slots__ = (
        "block_id", "ref_cnt", "block_hash", "generation", "prev_free_block", "next_free_block",
    )  # fmt: skip

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.generation = 0
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else ", cached"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """The blocks with ``ref_cnt == 0``, head first: the head is the next to be handed out.

    Freed blocks go to the tail and cached ones keep their hash there, so the
    head is the least recently used block: allocation evicts in LRU order. A
    prefix hit takes a block out of the middle (``remove``), in O(1) because
    each block is its own node. Sentinel head and tail nodes remove every
    empty-list special case.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is None or block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None  # the sentinels are always linked
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Head to tail (eviction order); for checks and tests, not the hot path."""
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free_block

    def __len__(self) -> int:
        return self.num_free_blocks
