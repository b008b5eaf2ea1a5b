"""Paged attention in plain torch: the reference backend, correct on CPU and CUDA.

Per step (once, shared by all layers) the batch is split into at most two groups,
decode rows (one query token) and prefill rows, so a long prefill chunk does not
pad every decode row to its length. Per layer and group: gather the group's K/V
from the paged cache through the block table into [B, S, kv_heads, D], scatter its
queries into [B, max_q, heads, D], and run one ``scaled_dot_product_attention``
with a causal + length mask. No Python loop over tokens or requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.gpu_worker.attention.base import AttentionBackend, AttentionMetadata, KVCache


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V to its cache slot; tokens with slot -1 (padding) are skipped."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    key_cache.view(-1, num_kv_heads, head_dim)[slots] = key[: slot_mapping.shape[0]][valid]
    value_cache.view(-1, num_kv_heads, head_dim)[slots] = value[: slot_mapping.shape[0]][valid]


@dataclass
class _Group:
    """Index tensors for one group of requests, built once per step."""

    token_idx: torch.Tensor | None  # [Tg] rows of the batch's query; None = rows 0..Tg-1
    num_reqs: int
    max_q: int
    req_of_token: torch.Tensor  # [Tg] group-local request of each query token
    pos_in_req: torch.Tensor  # [Tg] index of the token among its request's queries
    kv_slots: torch.Tensor  # [Bg, S] cache slot of each context position (clamped)
    mask: torch.Tensor  # [Bg, 1, max_q, S] True = attend


def _build_group(
    meta: AttentionMetadata, reqs: torch.Tensor | None, block_size: int, whole_batch: bool
) -> _Group:
    """``reqs``: CPU indices of the group's requests (None = all requests)."""
    device = meta.seq_lens.device
    qsl_cpu, seq_cpu = meta.query_start_loc_cpu.long(), meta.seq_lens_cpu.long()
    if reqs is None:
        reqs = torch.arange(seq_cpu.shape[0])
    starts, q_lens = qsl_cpu[reqs], qsl_cpu[reqs + 1] - qsl_cpu[reqs]
    seq_lens = seq_cpu[reqs]
    num_reqs, max_q, max_s = reqs.shape[0], int(q_lens.max()), int(seq_lens.max())
    # Token-level indices, built on the host from the host copies: no device sync.
    req_of_token = torch.repeat_interleave(torch.arange(num_reqs), q_lens)
    offsets = torch.cumsum(q_lens, 0) - q_lens
    pos_in_req = torch.arange(int(q_lens.sum())) - offsets[req_of_token]
    token_idx = None if whole_batch else (starts[req_of_token] + pos_in_req).to(device)

    reqs_dev = reqs.to(device)
    seq_dev = meta.seq_lens[reqs_dev].long()
    positions = torch.arange(max_s, device=device)
    # Positions past a request's context are clamped to its last one, so every
    # block-table read is of a real block; the mask hides them.
    clamped = torch.minimum(positions[None, :], (seq_dev - 1)[:, None])
    blocks = torch.gather(meta.block_table[reqs_dev].long(), 1, clamped // block_size)
    kv_slots = blocks * block_size + clamped % block_size
    ctx = (seq_dev - q_lens.to(device))[:, None, None]  # tokens before this step's queries
    q_pos = ctx + torch.arange(max_q, device=device)[None, :, None]
    k_pos = positions[None, None, :]
    mask = (k_pos <= q_pos) & (k_pos < seq_dev[:, None, None])
    return _Group(
        token_idx=token_idx,
        num_reqs=num_reqs,
        max_q=max_q,
        req_of_token=req_of_token.to(device),
        pos_in_req=pos_in_req.to(device),
        kv_slots=kv_slots,
        mask=mask[:, None],
    )


def _plan(meta: AttentionMetadata, block_size: int) -> list[_Group]:
    q_lens = meta.query_start_loc_cpu[1:] - meta.query_start_loc_cpu[:-1]
    decode = q_lens == 1
    if bool(decode.all()) or not bool(decode.any()):
        return [_build_group(meta, None, block_size, whole_batch=True)]
    return [
        _build_group(meta, torch.nonzero(decode).flatten(), block_size, whole_batch=False),
        _build_group(meta, torch.nonzero(~decode).flatten(), block_size, whole_batch=False),
    ]


class TorchAttentionBackend(AttentionBackend):
    """Reference paged attention with ``scaled_dot_product_attention``; see the module doc."""

    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        attn_meta: AttentionMetadata,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        reshape_and_cache(key, value, key_cache, value_cache, attn_meta.slot_mapping)
        groups = attn_meta.backend_state.get(self.name)
        if groups is None:
            groups = _plan(attn_meta, key_cache.shape[1])
            attn_meta.backend_state[self.name] = groups
        flat_k = key_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = value_cache.view(-1, self.num_kv_heads, self.head_dim)
        out = torch.zeros_like(query)
        for g in groups:
            num_tokens = g.req_of_token.shape[0]
            q = query[:num_tokens] if g.token_idx is None else query[g.token_idx]
            if g.max_q == 1:
                q_pad = q.view(g.num_reqs, 1, self.num_heads, self.head_dim)
            else:
                q_pad = q.new_zeros(g.num_reqs, g.max_q, self.num_heads, self.head_dim)
                q_pad[g.req_of_token, g.pos_in_req] = q
            o = F.scaled_dot_product_attention(
                q_pad.transpose(1, 2),
                flat_k[g.kv_slots].transpose(1, 2),
                flat_v[g.kv_slots].transpose(1, 2),
                attn_mask=g.mask,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            ).transpose(1, 2)
            o = o[g.req_of_token, g.pos_in_req]
            if g.token_idx is None:
                out[:num_tokens] = o
            else:
                out[g.token_idx] = o
        return out
