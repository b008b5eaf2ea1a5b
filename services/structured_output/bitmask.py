"""Applying a token bitmask to logits: plain torch, so the worker needs no grammar engine."""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[rows[i], t]`` to -inf for every token ``t`` that ``bitmask[i]`` does not
    allow (bit ``t % 32`` of int32 word ``t // 32`` clear); in place. Columns past the
    bitmask's ``32 * words`` are disallowed; rows not listed are left alone."""
    vocab = logits.shape[-1]
    allowed = (bitmask.to(logits.device).unsqueeze(-1) >> _BITS.to(logits.device)) & 1
    allowed = allowed.flatten(1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        pad = torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool)
        allowed = torch.cat([allowed, pad.to(allowed.device)], dim=1)
    picked = logits[rows]
    logits[rows] = picked.masked_fill(~allowed, float("-inf"))


def bitmask_rows(bitmask: bytes, num_rows: int) -> torch.Tensor:
    """A plan's ``grammar_bitmask`` bytes as [rows, words] int32 (a copy: bytes are
    read-only)."""
    return torch.frombuffer(bytearray(bitmask), dtype=torch.int32).view(num_rows, -1)
