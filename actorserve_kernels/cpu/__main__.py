"""``python -m actorserve_kernels.cpu``: build the CPU kernels ahead of first use (``make install``)."""

from actorserve_kernels.cpu import load_cpu_ops

print("CPU kernels:", "ready" if load_cpu_ops() else "unavailable, the SDPA path will be used")
