"""Start-up check: does the KV cache hold at least one request of max_model_len tokens?"""

from __future__ import annotations

import logging

from services.config import ConfigError


def check_kv_capacity(
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    logger: logging.Logger | None = None,
) -> float:
    """Log the KV cache size and maximum concurrency as vLLM does; return the concurrency.

    ``num_blocks`` is the whole pool; one block is reserved (the null block),
    so ``num_blocks - 1`` hold tokens. Raises ``ConfigError`` when not even one
    request of ``max_model_len`` tokens fits, since it could never finish.
    """
    usable_blocks = max(num_blocks - 1, 0)
    num_tokens = usable_blocks * block_size
    blocks_per_request = -(-max_model_len // block_size)
    concurrency = usable_blocks / blocks_per_request
    if logger is not None:
        logger.info("KV cache size: %s tokens", f"{num_tokens:,}")
        logger.info(
            "Maximum concurrency for %s tokens per request: %.2fx",
            f"{max_model_len:,}",
            concurrency,
        )
    if usable_blocks < blocks_per_request:
        raise ConfigError(
            f"the KV cache holds {num_tokens:,} tokens ({usable_blocks} blocks of {block_size}) "
            f"but one request of --max-model-len {max_model_len:,} needs "
            f"{blocks_per_request * block_size:,} ({blocks_per_request} blocks); "
            f"lower --max-model-len to at most {num_tokens:,}, or give the KV cache more memory "
            "(--gpu-memory-utilization, --kv-cache-memory-bytes, --cpu-kv-cache-fraction on CPU, "
            "--num-gpu-blocks-override)"
        )
    return concurrency
