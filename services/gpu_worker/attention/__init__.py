"""Attention backends, chosen by name (``--attention-backend``) and imported lazily."""

from __future__ import annotations

from services.gpu_worker.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    KVScales,
    MetadataBuilder,
)
from services.registry import ATTENTION_BACKENDS, load_backend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "KVCache",
    "KVScales",
    "MetadataBuilder",
    "ATTENTION_BACKENDS",
    "get_attention_backend",
]


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered under ``name``; ValueError naming the choices otherwise."""
    return load_backend(ATTENTION_BACKENDS, "attention backend", name, AttentionBackend)  # type: ignore[no-any-return]
