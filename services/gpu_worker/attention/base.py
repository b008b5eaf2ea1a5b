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

# One layer's cache: (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim].
KVCache = tuple[torch.Tensor, torch.Tensor]


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
    a device sync. ``backend_state`` is scratch space for tensors a backend derives
    from the metadata once per step and reuses in every layer.
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

    @property
    def num_reqs(self) -> int:
        return self.seq_lens_cpu.shape[0]

    @property
    def num_actual_tokens(self) -> int:
        return int(self.query_start_loc_cpu[-1])


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
    padding tokens are unspecified.
    """

    name: ClassVar[str]

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
    ) -> torch.Tensor: ...
