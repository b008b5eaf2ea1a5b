"""Attention backends, chosen by name (``--attention-backend``) and imported lazily."""

from __future__ import annotations

import importlib

from services.gpu_worker.attention.base import AttentionBackend, AttentionMetadata, KVCache

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "KVCache",
    "ATTENTION_BACKENDS",
    "get_attention_backend",
]

# name -> "module:Class"; importing lazily keeps triton off the CPU-only path.
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "services.gpu_worker.attention.torch_backend:TorchAttentionBackend",
    "triton": "services.gpu_worker.attention.triton_backend:TritonAttentionBackend",
}


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered under ``name``; ValueError naming the choices otherwise."""
    try:
        target = ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
        ) from None
    module_name, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(f"{target} is not an AttentionBackend")
    return cls
