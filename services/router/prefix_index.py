"""The ``prefix_approx`` index: which prompt blocks the router sent to which replica.

The router hashes a prompt's full blocks exactly as the engine does
(``services/kv_cache/block_hash.py``: same function, root and ``cache_salt`` rule) and
remembers, per replica, the blocks of the requests it sent there in an LRU of the
replica's size (its ``num_gpu_blocks`` from ``vllm:cache_config_info``). A prompt's
score on a replica is the number of its leading blocks in that replica's LRU.

It needs nothing from the engine, and so it drifts from the truth:

- it cannot see evictions caused by other traffic (another router, direct clients) or by
  the replica's own decode blocks and preemptions, so it over-estimates after a replica
  filled up; sizing each LRU to the replica's pool bounds the error to what one pool holds;
- a restarted replica comes back empty while the index still lists its blocks: the router
  forgets a replica's blocks when it leaves the rotation, which covers restarts the health
  check notices, not a restart between two checks;
- blocks a replica computed for the generated text are not recorded (only prompts are).

``prefix_precise`` follows the replicas' KV events instead and has none of these errors.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from services.protocol import BlockHash

DEFAULT_CAPACITY = 1 << 20  # blocks per replica when the replica does not say its pool size


class ApproxPrefixIndex:
    """Per replica, an LRU of block hashes sent there."""

    def __init__(self) -> None:
        self._blocks: dict[str, OrderedDict[BlockHash, None]] = {}
        self._capacity: dict[str, int] = {}

    def set_capacity(self, replica: str, num_blocks: int) -> None:
        self._capacity[replica] = num_blocks if num_blocks > 0 else DEFAULT_CAPACITY

    def matched_blocks(
        self, hashes: Sequence[BlockHash], replicas: Iterable[str]
    ) -> dict[str, int]:
        """For each replica, how many leading blocks of ``hashes`` it is believed to hold."""
        out = {}
        for replica in replicas:
            lru = self._blocks.get(replica)
            n = 0
            if lru:
                for h in hashes:
                    if h not in lru:
                        break
                    n += 1
            out[replica] = n
        return out

    def record(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        """``hashes`` were sent to ``replica``: most recently used, the LRU's tail evicted."""
        lru = self._blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        capacity = self._capacity.get(replica, DEFAULT_CAPACITY)
        while len(lru) > capacity:
            lru.popitem(last=False)

    def forget(self, replica: str) -> None:
        """The replica left the rotation (down, restarted or removed): it holds nothing."""
        self._blocks.pop(replica, None)

    def size(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))
