"""Paged attention with torch ops: the reference backend, and the CPU default.

Per step (once, shared by all layers) the batch is split into at most two groups,
decode rows (one query token) and prefill rows, so a long prefill chunk does not
pad every decode row to its length. Per layer and group: gather the group's K/V
from the paged cache through the block table into [B, S, kv_heads, D], scatter its
queries into [B, max_q, heads, D], and run one ``scaled_dot_product_attention``
with a causal + length mask. No Python loop over tokens or requests.

On CPU, decode rows instead go to a C++ op that reads the paged cache in place
(``actorserve_kernels.cpu``), as vLLM's CPU backend pairs SDPA for prefill with a C++
paged-attention decode kernel: the gather, which copies every request's whole
context each layer, was most of a decode step. ``ACTORSERVE_CPU_KERNELS=0`` (or no
C++ compiler) keeps the pure-torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from actorserve_kernels import kv_quant
from services.gpu_worker.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    KVScales,
    MetadataBuilder,
)

_KERNEL_HEAD_DIMS = (64, 128)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    write: tuple[torch.Tensor | None, torch.Tensor] | None = None,
    kv_scales: KVScales | None = None,
) -> None:
    """Write each token's K/V to its cache slot; tokens with slot -1 (padding) are skipped.
    A quantized cache gets them quantized (``kv_quant``; fp8 with ``kv_scales``).

    ``write`` is ``_write_indices(slot_mapping)``, passed when it was computed once per step.
    """
    rows, slots = write if write is not None else _write_indices(slot_mapping)
    if rows is not None:
        key, value = key.index_select(0, rows), value.index_select(0, rows)
    else:
        n = slots.shape[0]
        key, value = key[:n], value[:n]
    if kv_quant.kind(key_cache) != "auto":
        k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)
        if key_cache.device.type == "cpu" and _cpu_ops_loaded():
            from actorserve_kernels.cpu import write_kv_cache  # the same bytes, in one pass

            fp8 = {} if k_scale is None else {"k_scale": float(k_scale)}
            fp8 |= {} if v_scale is None else {"v_scale": float(v_scale)}
            write_kv_cache(key, value, key_cache, value_cache, slots, **fp8)
        else:
            kv_quant.write(key, value, key_cache, value_cache, slots, k_scale, v_scale)
        return
    num_kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)


def _write_indices(slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(token rows to write, or None for rows 0..n-1, their slots) for ``slot_mapping``."""
    valid = slot_mapping >= 0
    if bool(valid.all()):  # the usual case: no padding token
        return None, slot_mapping
    rows = torch.nonzero(valid).flatten()
    return rows, slot_mapping[rows]


@dataclass
class _Group:
    """Index tensors for one group of requests, built once per step."""

    token_idx: torch.Tensor | None  # [Tg] rows of the batch's query; None = rows 0..Tg-1
    num_reqs: int
    max_q: int
    req_of_token: torch.Tensor  # [Tg] group-local request of each query token
    pos_in_req: torch.Tensor  # [Tg] index of the token among its request's queries
    blocks: torch.Tensor  # [Bg * nb] physical blocks to gather, row-major per request
    stale_rows: torch.Tensor | None  # rows of the gathered [Bg * nb * bs] past each context
    # [Bg, 1, max_q, nb * bs] True = attend; None when the group is fresh (below).
    mask: torch.Tensor | None
    # Gather buffers reused by every layer: big fresh allocations cost page faults on CPU.
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def fresh(self) -> bool:
        """Every request's context is exactly this step's tokens (new prompts, no cached
        prefix): K/V come from the step's own projections, and the causal mask is SDPA's
        built-in one, so its flash kernel skips the masked half instead of computing it."""
        return self.mask is None


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
    num_reqs, max_q = reqs.shape[0], int(q_lens.max())
    num_blocks = -(-int(seq_lens.max()) // block_size)
    # Index tensors are built on the host from the host copies: no device sync.
    req_of_token = torch.repeat_interleave(torch.arange(num_reqs), q_lens)
    offsets = torch.cumsum(q_lens, 0) - q_lens
    pos_in_req = torch.arange(int(q_lens.sum())) - offsets[req_of_token]
    token_idx = None if whole_batch else (starts[req_of_token] + pos_in_req).to(device)
    # Whole blocks are gathered (far faster than per-slot gathers). Table columns past a
    # request's last block are clamped to it, so only real blocks are read; the slots
    # past its context are zeroed after the gather (they may hold stale K/V, even NaN
    # from another request) and masked.
    cols = torch.minimum(
        torch.arange(num_blocks)[None, :], (-(-seq_lens // block_size) - 1)[:, None]
    )
    blocks = torch.gather(meta.block_table[reqs.to(device)], 1, cols.to(device)).long().flatten()
    fresh = max_q > 1 and bool((seq_lens == q_lens).all())
    if fresh:
        stale, mask = torch.empty(0, dtype=torch.long), None
    else:
        k_pos = torch.arange(num_blocks * block_size)
        stale = torch.nonzero((k_pos[None, :] >= seq_lens[:, None]).flatten()).flatten()
        q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_q)[None, :]
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos < seq_lens[:, None, None])
    return _Group(
        token_idx=token_idx,
        num_reqs=num_reqs,
        max_q=max_q,
        req_of_token=req_of_token.to(device),
        pos_in_req=pos_in_req.to(device),
        blocks=blocks,
        stale_rows=stale.to(device) if stale.numel() else None,
        mask=None if mask is None else mask[:, None].to(device),
    )


@dataclass
class _DecodeRows:
    """Decode rows for the C++ op: query row, request and context length of each."""

    rows: torch.Tensor  # int64
    reqs: torch.Tensor  # int64
    ctx_lens: torch.Tensor  # int64


@dataclass
class _Plan:
    """What every layer reuses in one step: cache-write indices, the C++ op's decode
    rows (None when SDPA does them) and the SDPA groups."""

    write: tuple[torch.Tensor | None, torch.Tensor]
    decode: _DecodeRows | None
    groups: list[_Group]


def _plan(meta: AttentionMetadata, block_size: int, use_kernel: bool) -> _Plan:
    write = _write_indices(meta.slot_mapping)
    qsl = meta.query_start_loc_cpu.long()
    decode = (qsl[1:] - qsl[:-1]) == 1
    all_decode, any_decode = bool(decode.all()), bool(decode.any())
    if use_kernel and any_decode:
        reqs = torch.nonzero(decode).flatten()
        rows = _DecodeRows(qsl[reqs], reqs, meta.seq_lens_cpu.long()[reqs])
        prefill = [] if all_decode else [torch.nonzero(~decode).flatten()]
        groups = [_build_group(meta, r, block_size, whole_batch=False) for r in prefill]
        return _Plan(write, rows, groups)
    if all_decode or not any_decode:
        return _Plan(write, None, [_build_group(meta, None, block_size, whole_batch=True)])
    groups = [
        _build_group(meta, torch.nonzero(decode).flatten(), block_size, whole_batch=False),
        _build_group(meta, torch.nonzero(~decode).flatten(), block_size, whole_batch=False),
    ]
    return _Plan(write, None, groups)


def _cpu_ops_loaded() -> bool:
    from actorserve_kernels.cpu import load_cpu_ops

    return load_cpu_ops()


def _kernel_available(device: torch.device, head_dim: int) -> bool:
    """Whether decode rows go to the C++ op: on CPU, for its head dims, when it builds."""
    if device.type != "cpu" or head_dim not in _KERNEL_HEAD_DIMS:
        return False
    from actorserve_kernels.cpu import load_cpu_ops

    return load_cpu_ops()


class TorchMetadataBuilder(MetadataBuilder):
    """The step's ``_Plan`` (cache-write indices, decode rows, SDPA groups), once per step."""

    def build(
        self, meta: AttentionMetadata, kv_cache: KVCache, graph_size: int | None = None
    ) -> None:
        key_cache = kv_cache[0]
        use_kernel = _kernel_available(key_cache.device, self.head_dim)
        meta.backend_state[TorchAttentionBackend.name] = _plan(meta, key_cache.shape[1], use_kernel)


class TorchAttentionBackend(AttentionBackend):
    """Reference paged attention with ``scaled_dot_product_attention``; see the module doc.

    Its plan needs the batch's shape on the host (``torch.nonzero``, per-step index
    tensors): no CUDA graphs on it.
    """

    name = "torch"
    builder = TorchMetadataBuilder

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        use_cpu_kernel: bool | None = None,
    ) -> None:
        """``use_cpu_kernel``: False forces SDPA for every row; None (default) uses the
        C++ decode op on CPU when it builds."""
        super().__init__(num_heads, head_dim, num_kv_heads, scale)
        # None: decided on the first forward, from the device and whether the op builds.
        self._kernel: bool | None = None if use_cpu_kernel is not False else False

    def _use_kernel(self, query: torch.Tensor) -> bool:
        if self._kernel is None:
            self._kernel = _kernel_available(query.device, self.head_dim)
        return self._kernel

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
        plan = attn_meta.backend_state.get(self.name)
        if plan is None or (plan.decode is not None and not self._use_kernel(query)):
            # Called outside a model (which builds the plan before its first layer), or
            # with the C++ op turned off on this backend (tests): plan for this call alone.
            plan = _plan(attn_meta, key_cache.shape[1], self._use_kernel(query))
        reshape_and_cache(
            key, value, key_cache, value_cache, attn_meta.slot_mapping, plan.write, kv_scales
        )
        groups = plan.groups
        out = None if len(groups) == 1 and groups[0].token_idx is None else torch.zeros_like(query)
        if plan.decode is not None:
            from actorserve_kernels.cpu import paged_attention_rows

            assert out is not None
            d = plan.decode
            fp8_scales = {}
            if kv_scales is not None and kv_quant.kind(key_cache) == "fp8":
                fp8_scales = {"k_scale": float(kv_scales[0]), "v_scale": float(kv_scales[1])}
            paged_attention_rows(
                out, query, key_cache, value_cache, attn_meta.block_table,
                d.rows, d.reqs, d.ctx_lens, self.scale, **fp8_scales,
            )  # fmt: skip
            if not groups:  # every token was a decode row
                return out
        for g in groups:
            num_tokens = g.req_of_token.shape[0]
            q = query[:num_tokens] if g.token_idx is None else query[g.token_idx]
            q_pad = self._pad(q, g)
            if g.fresh:
                k = self._pad(key[:num_tokens] if g.token_idx is None else key[g.token_idx], g)
                v = self._pad(value[:num_tokens] if g.token_idx is None else value[g.token_idx], g)
            else:
                if g.buffers is None:
                    shape = (g.blocks.shape[0], *key_cache.shape[1:])
                    g.buffers = (key_cache.new_empty(shape), key_cache.new_empty(shape))
                scales = kv_scales if kv_scales is not None else (None, None)
                k = self._gather(key_cache, g, g.buffers[0], scales[0], query.dtype)
                v = self._gather(value_cache, g, g.buffers[1], scales[1], query.dtype)
            o = F.scaled_dot_product_attention(
                q_pad.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=g.mask,
                is_causal=g.fresh,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            ).transpose(1, 2)
            if g.max_q == 1 or g.num_reqs == 1:  # no padding rows: a reshape, not a gather
                o = o.reshape(num_tokens, self.num_heads, self.head_dim)
            else:
                o = o[g.req_of_token, g.pos_in_req]
            if out is None:  # the group is the whole batch
                if num_tokens == query.shape[0]:
                    return o
                out = torch.zeros_like(query)
            if g.token_idx is None:
                out[:num_tokens] = o
            else:
                out[g.token_idx] = o
        assert out is not None
        return out

    @staticmethod
    def _pad(x: torch.Tensor, g: _Group) -> torch.Tensor:
        """The group's rows of ``x`` [Tg, heads, D] as [Bg, max_q, heads, D], zero-padded."""
        if g.max_q == 1 or g.num_reqs == 1:
            return x.reshape(g.num_reqs, g.max_q, *x.shape[1:])
        padded = x.new_zeros(g.num_reqs, g.max_q, *x.shape[1:])
        padded[g.req_of_token, g.pos_in_req] = x
        return padded

    def _gather(
        self,
        cache: torch.Tensor,
        g: _Group,
        out: torch.Tensor,
        fp8_scale: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """[Bg, nb * block_size, kv_heads, D]: each request's context, zero past its end;
        a quantized cache's dequantized to ``dtype``."""
        torch.index_select(kv_quant.as_bytes(cache), 0, g.blocks, out=kv_quant.as_bytes(out))
        if kv_quant.kind(cache) != "auto":
            out = kv_quant.dequantize(out, fp8_scale, dtype)
        rows = out.view(-1, self.num_kv_heads, self.head_dim)
        if g.stale_rows is not None:
            rows.index_fill_(0, g.stale_rows, 0)
        return rows.view(g.num_reqs, -1, self.num_kv_heads, self.head_dim)
