"""Kernels: Triton paged attention, KV-cache write and fused elementwise ops (GPU), a C++
paged-attention op (CPU).

Triton compiles only for GPUs. On a machine without one the kernels run in Triton's
interpreter (numpy, slow, but the same code), which is how the CPU test suite checks
them. Triton decides between compiling and interpreting when ``@triton.jit`` decorates a
function, i.e. when the kernel modules are imported, so the choice is made here, before
they are: whoever imports ``kernels`` first, in whatever order, gets kernels that can run
in this process. Set ``TRITON_INTERPRET=1`` yourself to interpret on a GPU host.

The Triton names are exported lazily, so the CPU path (``actorserve_kernels.cpu``) never imports
triton.
"""

import os
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

__all__ = [
    "num_kv_splits",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_and_cache",
    "silu_and_mul",
]


def __getattr__(name: str) -> Any:
    if name in ("num_kv_splits", "paged_attention"):
        from actorserve_kernels import attention

        return getattr(attention, name)
    if name == "reshape_and_cache":
        from actorserve_kernels.kv_cache import reshape_and_cache

        return reshape_and_cache
    if name in ("rms_norm", "rotary_and_cache", "silu_and_mul"):
        from actorserve_kernels import fused

        return getattr(fused, name)
    raise AttributeError(f"module 'actorserve_kernels' has no attribute {name!r}")
