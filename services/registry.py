"""Every pluggable part, by the name a flag gives it: ``"module:attribute"`` strings.

This module sits at the bottom of the layers (it imports nothing of ours), so
configuration can check a flag against the names, and a lower layer can reach a
part that lives in a higher one at run time, without an import that runs upward:
``load("worker backend", WORKER_BACKENDS, name)`` imports the module only when it
is chosen, so choosing a backend never drags another's dependencies (triton,
CUDA, NIXL) into a process. Adding a worker backend, an attention backend, a KV
connector, a grammar engine, a tool-call parser, a hash or a scheduling policy is one
new module and one line here.
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

# --kv-transfer-config '{"kv_connector": NAME}': each connector's scheduler and worker half.
KV_CONNECTORS: dict[str, tuple[str, str]] = {
    "p2p": (
        "services.kv_transfer.p2p:P2PConnectorScheduler",
        "services.kv_transfer.p2p:P2PConnectorWorker",
    ),
    "offload": (
        "services.kv_transfer.offload:OffloadConnectorScheduler",
        "services.kv_transfer.offload:OffloadConnectorWorker",
    ),
    "storage": (
        "services.kv_transfer.storage:StorageConnectorScheduler",
        "services.kv_transfer.storage:StorageConnectorWorker",
    ),
    "multi": (
        "services.kv_transfer.multi:MultiConnectorScheduler",
        "services.kv_transfer.multi:MultiConnectorWorker",
    ),
}

# --structured-outputs-config '{"backend": NAME}': grammar engines ("auto" picks one of them).
GRAMMAR_BACKENDS: dict[str, str] = {
    "xgrammar": "services.structured_output.xgrammar_backend:XgrammarBackend",
    "guidance": "services.structured_output.guidance_backend:GuidanceBackend",
}

# --tool-call-parser: how "auto" tool choice finds calls in a chat completion's text.
TOOL_CALL_PARSERS: dict[str, str] = {
    "hermes": "services.api_server.tool_calls:HermesCalls",
    "llama3_json": "services.api_server.tool_calls:Llama3JsonCalls",
}

# --prefix-caching-hash-algo: the block hash (services/kv_cache/block_hash.py).
HASH_ALGORITHMS: dict[str, str] = {
    "sha256": "services.kv_cache.block_hash:sha256",
    "sha256_cbor": "services.kv_cache.block_hash:sha256_cbor",
    "builtin": "services.kv_cache.block_hash:builtin_hash",
}

# --scheduling-policy: the waiting queue's order (services/scheduler/request_queue.py).
SCHEDULING_POLICIES: dict[str, str] = {
    "fcfs": "services.scheduler.request_queue:FCFSQueue",
    "priority": "services.scheduler.request_queue:PriorityQueue",
}


def resolve(target: str) -> Any:
    """The object a ``"module:attribute"`` string names (its module imported now)."""
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name), attr)


def load(kind: str, registry: dict[str, str], name: str) -> Any:
    """The object registered under ``name``; ValueError naming the choices otherwise."""
    try:
        target = registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {', '.join(registry)}") from None
    return resolve(target)


def load_backend(registry: dict[str, str], kind: str, name: str, base: type) -> Any:
    """The class registered under ``name``, checked to be a ``base``."""
    cls = load(kind, registry, name)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{registry[name]} is not a {base.__name__}")
    return cls
