"""NIXL as p2p's transport (``kv_connector_extra_config.transport: "nixl"``).

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

import contextlib
import importlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.flags import ConfigError
from services.kv_transfer.transport import PullFailed
from services.kv_transfer.zmq_transport import ZmqTransport
from services.protocol import KVPull, KVPullNixl, KVPullRefused, P2PLoad

if TYPE_CHECKING:
    import torch

    from services.kv_transfer.side_channel import PullChannel, Reply

logger = logging.getLogger(__name__)
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
        # Unique per process: two instances given the same engine_id must still differ
        # (NIXL refuses a remote agent named as the local one).
        self.name = f"{name}-{uuid.uuid4().hex[:8]}"
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=["UCX"]))
        tensors = [t for kv in kv_caches for t in kv]
        if not all(t.is_contiguous() for t in tensors):
            raise ConfigError("transport nixl: the KV cache tensors must be contiguous")
        self.agent.register_memory(tensors)
        self._tensors = tensors  # registered memory must outlive the agent's use of it
        first = tensors[0]
        self.mem_type = "VRAM" if first.is_cuda else "DRAM"
        self.device = (first.device.index or 0) if first.is_cuda else 0
        self.bases = [t.data_ptr() for t in tensors]
        self.block_bytes = [t.stride(0) * t.element_size() for t in tensors]
        self.metadata: bytes = self.agent.get_agent_metadata()
        self._remotes: dict[str, str] = {}  # agent name -> the name NIXL gave it here
        # A NIXL agent is not thread-safe by default: its calls take turns; reads in
        # flight from several load threads progress together.
        self._lock = threading.Lock()

    def describe(self) -> KVPullNixl:
        """Where this rank's blocks are: the reply to a pull over NIXL."""
        return KVPullNixl(
            self.name, self.metadata, self.bases, self.block_bytes, self.mem_type, self.device
        )

    def _remote(self, where: KVPullNixl) -> str:
        """The remote agent (lock held); its name is unique per process, so a restarted
        prefill instance is a new agent."""
        name = self._remotes.get(where.agent)
        if name is None:
            name = self._remotes[where.agent] = self.agent.add_remote_agent(where.metadata)
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
        moved. ``NixlError`` on a mismatch, a failed transfer, or a cancel before it
        started.

        A started read is waited for until NIXL says it is done or failed, past
        ``timeout_s`` too (with a warning): it writes into the local blocks, and reads
        from the prefill instance's held ones, so neither may be handed back before it
        ends (releasing the handle does not stop an RMA read already posted). A peer
        that is gone ends it with an error."""
        if len(where.bases) != len(self.bases) or where.block_bytes != self.block_bytes:
            raise NixlError("the two sides' KV caches differ in layers or block size")
        if cancelled():
            raise NixlError("aborted")
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
        try:
            with self._lock:
                handle = self.agent.initialize_xfer(
                    "READ",
                    self.agent.get_xfer_descs(local_descs, self.mem_type),
                    self.agent.get_xfer_descs(remote_descs, where.mem_type),
                    self._remote(where),
                )
                state = self.agent.transfer(handle)
        except Exception as e:  # nothing was posted: the blocks are untouched
            raise NixlError(f"{type(e).__name__}: {e}") from None
        deadline = time.monotonic() + timeout_s
        warned = False
        try:
            while state not in ("DONE", "ERR"):
                if not warned and time.monotonic() > deadline:
                    logger.warning(
                        "NIXL: a read from %s is still running after %g s; waiting for it to "
                        "end (its blocks stay held)",
                        where.agent,
                        timeout_s,
                    )
                    warned = True
                time.sleep(0.0002)
                with self._lock:
                    state = self.agent.check_xfer_state(handle)
        finally:
            with self._lock, contextlib.suppress(Exception):
                self.agent.release_xfer_handle(handle)
        if state == "ERR":
            raise NixlError("the read failed")
        return sum(size * len(local_block_ids) for size in self.block_bytes)


class NixlTransport(ZmqTransport):
    """NIXL's transport: a NIXL pull is answered with where the blocks are and READ by the
    puller; a ZeroMQ pull is still served as ZeroMQ's transport serves it."""

    name = "nixl"

    def __init__(
        self,
        agent_name: str,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        pull_timeout_s: float,
    ) -> None:
        super().__init__(kv_caches, pull_timeout_s)
        self.agent = NixlAgent(agent_name, kv_caches)

    def serve(self, reply: Reply, pull: KVPull) -> None:
        if pull.transport == "nixl":
            reply.send(self.agent.describe())
        else:
            super().serve(reply, pull)

    def pull(self, channel: PullChannel, load: P2PLoad, cancelled: Callable[[], bool]) -> int:
        """Ask where the held blocks are, then READ them over NIXL."""
        got = channel.recv(self.pull_timeout_s)
        if got is None:
            raise PullFailed(f"no answer from the prefill instance in {self.pull_timeout_s:g} s")
        reply = got[0]
        if isinstance(reply, KVPullRefused):
            raise PullFailed(f"refused: {reply.reason}")
        if not isinstance(reply, KVPullNixl):
            raise PullFailed(f"expected where the blocks are, got {type(reply).__name__}")
        try:
            return self.agent.read(
                reply, load.remote_block_ids, load.block_ids, self.pull_timeout_s, cancelled
            )
        except NixlError as e:
            raise PullFailed(f"NIXL: {e}") from None


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
