"""The paged KV cache's bookkeeping, below the scheduler: block hashes, the block pool
with its free-block queue and prefix cache, the manager that gives requests their blocks,
KV events (vLLM's wire format), residency metrics and the capacity check.

Nothing here knows about scheduling; the scheduler asks the manager for blocks, the
router and the tokenizers' balancer hash tokens with the same ``BlockHasher``.
"""
