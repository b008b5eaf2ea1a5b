"""Pluggable worker-side backends, registered by name and imported only when chosen.

Each registry maps a flag value to ``"module:Class"``; the modules are imported
lazily, so choosing a backend never drags another's dependencies (triton, CUDA)
into a process, and ``services.config`` can check a flag against the names
without importing torch. Adding a backend is one new file and one line here.
"""

from __future__ import annotations

import importlib
from typing import Any

# --attention-backend: how a layer attends over the paged KV cache.
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "services.gpu_worker.attention.torch_backend:TorchAttentionBackend",
    "triton": "services.gpu_worker.attention.triton_backend:TritonAttentionBackend",
}

# --worker-backend: what a worker rank runs a StepPlan with (services/gpu_worker/base.py).
WORKER_BACKENDS: dict[str, str] = {
    "torch": "services.gpu_worker.model_runner:ModelRunner",
    "sim": "services.gpu_worker.sim.worker:SimWorker",
}


def load_backend(registry: dict[str, str], kind: str, name: str, base: type) -> Any:
    """The class registered under ``name``; ValueError naming the choices otherwise."""
    try:
        target = registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {', '.join(registry)}") from None
    module_name, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{target} is not a {base.__name__}")
    return cls
