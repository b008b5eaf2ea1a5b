"""The engine core: requests, the continuous-batching scheduler and the paged KV cache.

request.py (Request, stop rules) -> request_queue.py (waiting queue per policy)
-> scheduler.py (Scheduler: StepPlan out, StepResult in) -> kv_cache_manager.py
(block tables) -> block_pool.py (blocks, prefix cache, KV events) ->
free_block_queue.py (LRU free list); block_hash.py (prefix hashes),
kv_cache_metrics.py (sampled residency), stats.py, capacity.py (start-up check).
"""
