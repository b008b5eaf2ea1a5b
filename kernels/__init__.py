"""Triton kernels: unified paged attention and the paged KV-cache write.

Triton compiles only for GPUs. On a machine without one the kernels run in Triton's
interpreter (numpy, slow, but the same code), which is how the CPU test suite checks
them. Triton decides between compiling and interpreting when ``@triton.jit`` decorates a
function, i.e. when the kernel modules below are imported, so the choice is made here,
before they are: whoever imports ``kernels`` first, in whatever order, gets kernels that
can run in this process. Set ``TRITON_INTERPRET=1`` yourself to interpret on a GPU host.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.attention import num_kv_splits, paged_attention  # noqa: E402
from kernels.kv_cache import reshape_and_cache  # noqa: E402

__all__ = ["num_kv_splits", "paged_attention", "reshape_and_cache"]
