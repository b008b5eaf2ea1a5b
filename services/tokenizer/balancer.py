"""Choosing the data-parallel engine core for a request (``--data-parallel-size`` > 1).

Each engine core publishes an ``EngineState`` after a step that changed it: its
waiting and running counts, KV cache usage, and the blocks that entered or left
its prefix cache. The balancer keeps the latest load of each engine and an exact
index of which engine caches which block hash (the same chained hashes the
scheduler computes, so a prompt's blocks can be looked up before it is sent).

The rule, for a prompt whose leading ``hit[d]`` blocks are cached on engine d:

    load[d] = 4 * waiting[d] + running[d] + 4 * routed[d]
    candidates = engines with load[d] <= min(load) + 4
    choose the candidate with the most hit blocks, then the least load, then the lowest rank

``4 * waiting + running`` is vLLM's DP load score (a waiting request costs a prefill
and a queue slot, a running one only a decode row); ``routed[d]`` counts the requests
this tokenizer sent to d since d last reported, so a burst does not all land on the
engine that looked idle. The slack of one waiting request lets prefix affinity win
while loads are close, and never against a clearly busier engine. An
``X-data-parallel-rank`` header pins a request and bypasses the rule.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from services.kv_cache.block_hash import BlockHash, BlockHasher
from services.protocol import AllBlocksCleared, BlockRemoved, BlockStored, EngineState

_WAITING_WEIGHT = 4
_SLACK = _WAITING_WEIGHT  # one waiting request's worth of load


class DataParallelBalancer:
    """Routes requests over ``num_engines`` engine cores; fed with their ``EngineState``s."""

    def __init__(self, num_engines: int, block_size: int, hash_algo: str) -> None:
        self.num_engines = num_engines
        self.hasher = BlockHasher(block_size, hash_algo)
        self.waiting = [0] * num_engines
        self.running = [0] * num_engines
        self.routed = [0] * num_engines
        self.kv_cache_usage = [0.0] * num_engines
        # block hash -> engine -> how many of its blocks hold it (usually 1)
        self._cached: defaultdict[BlockHash, Counter[int]] = defaultdict(Counter)

    def on_state(self, state: EngineState) -> None:
        d = state.dp_rank
        self.waiting[d], self.running[d] = state.num_waiting, state.num_running
        self.kv_cache_usage[d] = state.kv_cache_usage
        self.routed[d] = 0
        for event in state.events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    self._cached[h][d] += 1
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    engines = self._cached.get(h)
                    if engines is not None and engines[d] > 0:
                        engines[d] -= 1
                        if not +engines:
                            del self._cached[h]
            elif isinstance(event, AllBlocksCleared):
                for h in [h for h, engines in self._cached.items() if d in engines]:
                    del self._cached[h][d]
                    if not self._cached[h]:
                        del self._cached[h]

    def load(self, d: int) -> int:
        return _WAITING_WEIGHT * (self.waiting[d] + self.routed[d]) + self.running[d]

    def cached_blocks(self, token_ids: list[int], cache_salt: str | None) -> list[int]:
        """For each engine, how many leading blocks of the prompt it has cached."""
        hits = [0] * self.num_engines
        alive = set(range(self.num_engines))
        for h in self.hasher.hash_blocks(token_ids, cache_salt):
            engines = self._cached.get(h, Counter())
            alive = {d for d in alive if engines[d] > 0}
            if not alive:
                break
            for d in alive:
                hits[d] += 1
        return hits

    def choose(self, token_ids: list[int], cache_salt: str | None, pinned: int | None) -> int:
        """The engine for a new request (counted as routed to it); ``pinned`` wins."""
        if pinned is not None:
            self.routed[pinned] += 1
            return pinned
        if self.num_engines == 1:
            return 0
        loads = [self.load(d) for d in range(self.num_engines)]
        hits = self.cached_blocks(token_ids, cache_salt)
        floor = min(loads)
        best = min(
            (d for d in range(self.num_engines) if loads[d] <= floor + _SLACK),
            key=lambda d: (-hits[d], loads[d], d),
        )
        self.routed[best] += 1
        return best
