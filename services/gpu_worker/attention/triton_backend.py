"""Paged attention with the Triton kernels in ``actorserve_kernels/``: the default backend on CUDA.

One ``reshape_and_cache`` launch writes the step's K/V, then one ``paged_attention`` launch
(two with split-KV decode) covers the whole varlen batch, prefill chunks and decodes
together: no per-step planning on the host, so nothing goes into ``backend_state``.
Without a GPU the kernels run in Triton's interpreter (``actorserve_kernels/__init__.py``): correct
but slow, for tests only.
"""

from __future__ import annotations

import functools
import logging

import torch

from actorserve_kernels import paged_attention, reshape_and_cache
from services.gpu_worker.attention.base import AttentionBackend, AttentionMetadata, KVCache

logger = logging.getLogger(__name__)


@functools.cache  # once per process, not once per layer
def _warn_interpreted() -> None:
    logger.warning(
        "attention backend 'triton' without a GPU runs in Triton's interpreter: correct but "
        "very slow; use --attention-backend torch on CPU"
    )


class TritonAttentionBackend(AttentionBackend):
    """``AttentionBackend`` on the unified Triton kernel.

    Needs a power-of-two head_dim >= 16 (ValueError at construction); any block size.
    Output rows of padding tokens (past ``query_start_loc[B]``) are left uninitialised.
    """

    name = "triton"

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__(num_heads, head_dim, num_kv_heads, scale)
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise ValueError(
                f"the triton attention backend needs a power-of-two head_dim >= 16, got "
                f"{head_dim}; use --attention-backend torch"
            )
        if not torch.cuda.is_available():
            _warn_interpreted()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        attn_meta: AttentionMetadata,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        num_slots = attn_meta.slot_mapping.shape[0]
        reshape_and_cache(
            key[:num_slots], value[:num_slots], key_cache, value_cache, attn_meta.slot_mapping
        )
        return paged_attention(
            query,
            key_cache,
            value_cache,
            attn_meta.block_table,
            attn_meta.query_start_loc,
            attn_meta.seq_lens,
            attn_meta.max_query_len,
            attn_meta.max_seq_len,
            scale=self.scale,
        )
