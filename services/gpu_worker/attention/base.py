"""The attention backend contract: paged KV cache in, attention output out.

A flattened varlen batch mixes prefill chunks and decode tokens. Request ``b``
owns query tokens ``query_start_loc[b]:query_start_loc[b+1]`` of the batch; they
are the last ``q_len_b`` tokens of its ``seq_lens[b]`` tokens of context, so
query token ``i`` of request ``b`` sits at position ``seq_lens[b] - q_len_b + i``
and attends causally to every context position up to and including its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

# One layer's cache: (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]
# (or quantized, as actorserve_kernels/kv_quant.py stores it: --kv-cache-dtype).
KVCache = tuple[torch.Tensor, torch.Tensor]
# One layer's fp8 KV cache scales: (k_scale, v_scale), fp32 tensors of shape [1].
KVScales = tuple[torch.Tensor, torch.Tensor]


@dataclass
class AttentionMetadata:
    """Per-step description of the batch, shared by every layer.

    Device tensors:
      ``query_start_loc`` [B+1] int32: cumulative query lengths; ``query_start_loc[B]``
          is the number of real tokens (tokens past it, if any, are padding).
      ``seq_lens`` [B] int32: context length of each request *including* this step's tokens.
      ``block_table`` [B, max_blocks] int32: physical block ids, in order; entries past
          a request's last block are unspecified (must not be read).
      ``slot_mapping`` [T] int64: cache slot (``block_id * block_size + offset``) each
          token's K/V is written to; -1 marks a padding token whose K/V is dropped.
    Host-side copies (``*_cpu``) let a backend size grids and split the batch without
    a device sync. ``backend_state`` holds what the backend's ``MetadataBuilder`` derived
    from the rest once per step, before the first layer, and every layer reuses.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    backend_state: dict[str, Any] = field(default_factory=dict)
    # --calculate-kv-scales: this step's K/V set each layer's fp8 scales (the first prompt's)
    compute_kv_scales: bool = False

    @property
    def num_reqs(self) -> int:
        return self.seq_lens_cpu.shape[0]

    @property
    def num_actual_tokens(self) -> int:
        return int(self.query_start_loc_cpu[-1])


class MetadataBuilder:
    """Derives, once per step and before the first layer, what every layer of one backend
    reuses (into ``AttentionMetadata.backend_state``); the model owns one per backend.

    ``build(meta, kv_cache, graph_size=None)``: ``kv_cache`` is the first layer's (its
    block size, dtype and device are every layer's); ``graph_size`` is the batch size of the CUDA graph
    the step is captured into (or replays): what the backend derives from the step must
    then depend on that size alone, since a replay runs no Python. Builders keep any
    scratch memory they need allocated across steps (no allocation inside the forward).
    The default derives nothing.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def build(
        self, meta: AttentionMetadata, kv_cache: KVCache, graph_size: int | None = None
    ) -> None:
        meta.backend_state["built"] = True


class AttentionBackend(ABC):
    """Paged attention for one layer.

    ``forward(query, key, value, kv_cache, attn_meta)`` must, in this order:
      1. write ``key[t]`` / ``value[t]`` into ``kv_cache`` at ``slot_mapping[t]`` for
         every token with ``slot_mapping[t] >= 0`` (the cache is updated in place);
      2. for every real query token, attend causally over its request's whole
         context read from the paged cache through ``block_table`` (so K/V written
         by earlier steps, or by other requests sharing prefix blocks, are used),
         with softmax scale ``scale`` and grouped-query heads (query head ``h``
         reads KV head ``h // (num_heads // num_kv_heads)``).
    Shapes: ``query`` [T, num_heads, head_dim], ``key``/``value`` [T, num_kv_heads,
    head_dim]; returns [T, num_heads, head_dim] in the query's dtype. Output rows of
    padding tokens are unspecified. A quantized cache (``--kv-cache-dtype``; its format is
    ``actorserve_kernels/kv_quant.py``) is written quantized and read dequantized, an fp8
    one with the layer's ``kv_scales``.
    """

    name: ClassVar[str]
    # The builder of this backend's per-step state, and whether a decode step on it can be
    # captured in a CUDA graph (no host sync, no allocation, grid fixed by the batch size).
    builder: ClassVar[type[MetadataBuilder]] = MetadataBuilder
    supports_cuda_graphs: ClassVar[bool] = False
    # The backend rotates q and k itself, in the pass that writes K/V to the cache
    # (``forward_rotary``): one launch instead of a rotary op and a cache write.
    fuses_rotary: ClassVar[bool] = False

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        attn_meta: AttentionMetadata,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor: ...

    def forward_rotary(
        self,
        qk: torch.Tensor,
        value: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        attn_meta: AttentionMetadata,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        """``forward`` of q and k not yet rotated, stacked in ``qk`` [T, num_heads +
        num_kv_heads, head_dim] (rotated in place); ``cos_sin`` as ``RotaryEmbedding.cos_sin``
        gives them. Only for backends with ``fuses_rotary``."""
        raise NotImplementedError(f"the {self.name} attention backend does not fuse rotary")
