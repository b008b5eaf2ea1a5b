"""``python -m kernels.cpu``: build the CPU kernels ahead of first use (``make install``)."""

from kernels.cpu import load_cpu_ops

print("CPU kernels:", "ready" if load_cpu_ops() else "unavailable, the SDPA path will be used")
