"""NIXL as p2p's data path (``kv_connector_extra_config.transport: "nixl"``).

The side channel (holds, leases, generation checks, renewals, the release) stays as it is;
only the bytes move differently. Each worker rank registers its KV cache tensors with a
NIXL agent (UCX backend). A pull's reply is then not the layers but where they are: the
prefill rank's agent metadata and, per layer and K/V, the tensor's address and bytes per
block (``KVPullNixl``). The decode rank READs the held blocks straight from the prefill
rank's memory into its own blocks (one-sided; RDMA where the hardware has it, TCP or
shared memory here: ``UCX_TLS`` chooses), then releases the hold as with ZeroMQ.

NIXL ships on PyPI per CUDA major version (``nixl-cu12``, ``nixl-cu13``; the ``nixl``
package only depends on both, and on torch). ``pip install --no-deps nixl-cu12`` is enough
on a CPU: its wheel bundles UCX, and the UCX backend needs no GPU.
"""

from __future__ import annotations

import hashlib
import importlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.flags import ConfigError
from services.protocol import KVPullNixl

if TYPE_CHECKING:
    import torch

_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl._api")


class NixlError(Exception):
    """A NIXL read that failed or timed out (the pull then fails: the prompt is computed)."""


def load_nixl() -> Any:
    """NIXL's Python API module; ConfigError naming the wheel to install if absent."""
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ConfigError(
        '--kv-transfer-config p2p with "transport": "nixl" needs NIXL: pip install --no-deps '
        "nixl-cu12 (its UCX backend runs on a CPU too)"
    )


class NixlAgent:
    """One worker rank's NIXL agent over its KV cache (every layer's K and V tensor)."""

    def __init__(self, name: str, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        api = load_nixl()
        self.name = name
        self.agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        tensors = [t for kv in kv_caches for t in kv]
        if not all(t.is_contiguous() for t in tensors):
            raise ConfigError("transport nixl: the KV cache tensors must be contiguous")
        self.agent.register_memory(tensors)
        first = tensors[0]
        self.mem_type = "VRAM" if first.is_cuda else "DRAM"
        self.device = first.device.index or 0 if first.is_cuda else 0
        self.bases = [t.data_ptr() for t in tensors]
        self.block_bytes = [t.stride(0) * t.element_size() for t in tensors]
        self.metadata: bytes = self.agent.get_agent_metadata()
        self._remotes: dict[str, str] = {}  # metadata digest -> the remote agent's name
        # A NIXL agent is not thread-safe by default: one read at a time (the p2p load
        # threads take turns; a read is short next to the side-channel exchange).
        self._lock = threading.Lock()

    def describe(self) -> KVPullNixl:
        """Where this rank's blocks are: the reply to a pull over NIXL."""
        return KVPullNixl(
            self.name, self.metadata, self.bases, self.block_bytes, self.mem_type, self.device
        )

    def _remote(self, where: KVPullNixl) -> str:
        digest = hashlib.sha256(where.metadata).hexdigest()
        name = self._remotes.get(digest)
        if name is None:
            # A prefill instance restarted under the same name brings new metadata.
            for old_digest, old in list(self._remotes.items()):
                if old == where.agent:
                    self.agent.remove_remote_agent(old)
                    del self._remotes[old_digest]
            name = self._remotes[digest] = self.agent.add_remote_agent(where.metadata)
        return name

    def read(
        self,
        where: KVPullNixl,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        timeout_s: float,
        cancelled: Callable[[], bool],
    ) -> int:
        """READ the remote blocks into the local ones, every layer's K and V; the bytes
        moved. ``NixlError`` on a mismatch, a failed transfer, a timeout or a cancel before
        it started. A started read is waited for (it writes into the local blocks: they
        must not be handed back before it ends); past ``timeout_s`` its handle is
        released, which makes NIXL abort it."""
        if len(where.bases) != len(self.bases) or where.block_bytes != self.block_bytes:
            raise NixlError("the two sides' KV caches differ in layers or block size")
        if cancelled():
            raise NixlError("aborted")
        with self._lock:
            return self._read(where, remote_block_ids, local_block_ids, timeout_s)

    def _read(
        self,
        where: KVPullNixl,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        timeout_s: float,
    ) -> int:
        remote = self._remote(where)
        # One descriptor per run of blocks consecutive on both sides, per tensor.
        runs = _runs(local_block_ids, remote_block_ids)
        local_descs = [
            (base + b * size, n * size, self.device)
            for base, size in zip(self.bases, self.block_bytes, strict=True)
            for b, _, n in runs
        ]
        remote_descs = [
            (base + b * size, n * size, where.device)
            for base, size in zip(where.bases, where.block_bytes, strict=True)
            for _, b, n in runs
        ]
        handle = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(local_descs, self.mem_type),
            self.agent.get_xfer_descs(remote_descs, where.mem_type),
            remote,
        )
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise NixlError(f"the read did not complete in {timeout_s:g} s")
                time.sleep(0.0002)
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise NixlError("the read failed")
        finally:
            self.agent.release_xfer_handle(handle)
        return sum(size * len(local_block_ids) for size in self.block_bytes)


def _runs(local: list[int], remote: list[int]) -> list[tuple[int, int, int]]:
    """(first local block, first remote block, length) of the runs consecutive on both."""
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local, remote, strict=True):
        if runs:
            l0, r0, n = runs[-1]
            if lb == l0 + n and rb == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((lb, rb, 1))
    return runs
