"""Paged attention with the Triton kernels in ``actorserve_kernels/``: the default backend on CUDA.

One ``reshape_and_cache`` launch writes the step's K/V (``rotary_and_cache`` also rotates q
and k in that pass, in the model's ``forward_rotary`` path), then one ``paged_attention`` launch
(two with split-KV decode) covers the whole varlen batch, prefill chunks and decodes
together. The only per-step decision, the split-KV count, is made once per step by
``TritonMetadataBuilder`` (per captured batch size under CUDA graphs), whose scratch for
the split partials is allocated once: nothing is allocated or synchronised in the forward,
so a decode step can be captured in a CUDA graph. Without a GPU the kernels run in
Triton's interpreter (``actorserve_kernels/__init__.py``): correct but slow, for tests only.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from actorserve_kernels import paged_attention, reshape_and_cache, rotary_and_cache
from services.gpu_worker.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    KVScales,
    MetadataBuilder,
)

logger = logging.getLogger(__name__)


@functools.cache  # once per process, not once per layer
def _warn_interpreted() -> None:
    logger.warning(
        "attention backend 'triton' without a GPU runs in Triton's interpreter: correct but "
        "very slow; use --attention-backend torch on CPU"
    )


@dataclass(frozen=True)
class _TritonPlan:
    num_splits: int
    split_buffer: torch.Tensor | None  # fp32 scratch, when splitting


class TritonMetadataBuilder(MetadataBuilder):
    """Chooses the step's split-KV count (``num_kv_splits``; for a CUDA graph from its batch
    size and ``meta.max_seq_len``, which the graph runner sets to the longest context) and
    hands out the split scratch, allocated once for the most splits any step can use."""

    _scratch: torch.Tensor | None = None

    def build(
        self, meta: AttentionMetadata, kv_cache: KVCache, graph_size: int | None = None
    ) -> None:
        from actorserve_kernels.attention import _num_sms, num_kv_splits

        device = kv_cache[0].device
        num_seqs = meta.num_reqs if graph_size is None else graph_size
        splits = num_kv_splits(
            num_seqs, self.num_kv_heads, meta.max_query_len, meta.max_seq_len, _num_sms(device)
        )
        buffer = self._scratch_on(device) if splits > 1 else None
        meta.backend_state[TritonAttentionBackend.name] = _TritonPlan(splits, buffer)

    def _scratch_on(self, device: torch.device) -> torch.Tensor:
        """Never freed once made: a captured graph keeps writing to it."""
        if self._scratch is None:
            from actorserve_kernels.attention import _num_sms, max_split_rows, split_buffer_numel

            rows = max_split_rows(self.num_kv_heads, _num_sms(device))
            numel = split_buffer_numel(rows, self.num_heads, 1, self.head_dim)
            self._scratch = torch.empty(numel, dtype=torch.float32, device=device)
        return self._scratch


class TritonAttentionBackend(AttentionBackend):
    """``AttentionBackend`` on the unified Triton kernel.

    Needs a power-of-two head_dim >= 16 (ValueError at construction); any block size.
    Output rows of padding tokens (past ``query_start_loc[B]``) are left uninitialised.
    """

    name = "triton"
    builder = TritonMetadataBuilder
    supports_cuda_graphs = True
    fuses_rotary = True

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
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        num_slots = attn_meta.slot_mapping.shape[0]
        k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)
        reshape_and_cache(
            key[:num_slots], value[:num_slots], key_cache, value_cache, attn_meta.slot_mapping,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        return self._attend(query, kv_cache, attn_meta, kv_scales)

    def forward_rotary(
        self,
        qk: torch.Tensor,
        value: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        attn_meta: AttentionMetadata,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        cos, sin = cos_sin
        k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)
        rotary_and_cache(
            qk, value, cos, sin, self.num_heads, key_cache, value_cache, attn_meta.slot_mapping,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        return self._attend(qk[:, : self.num_heads], kv_cache, attn_meta, kv_scales)

    def _attend(
        self,
        query: torch.Tensor,
        kv_cache: KVCache,
        attn_meta: AttentionMetadata,
        kv_scales: KVScales | None,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)
        plan: _TritonPlan | None = attn_meta.backend_state.get(self.name)
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
            num_splits=None if plan is None else plan.num_splits,
            split_buffer=None if plan is None else plan.split_buffer,
            k_scale=k_scale,
            v_scale=v_scale,
        )
