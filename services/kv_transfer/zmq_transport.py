"""p2p's default transport: the held blocks' raw bytes as frames on the side channel.

The prefill rank copies each layer's K and V blocks (a GPU cache staged through host
memory) into zero-copy frames after a ``KVPullLayer`` header; the decode rank copies each
frame into its own blocks as it arrives, so layers land while later ones are in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from services.kv_transfer.transport import KVTransport, PullFailed
from services.protocol import KVPull, KVPullLayer, KVPullRefused, P2PLoad

if TYPE_CHECKING:
    import torch
    import zmq

    from services.kv_transfer.side_channel import PullChannel, Reply

# Layers travel in messages of at least this many bytes: one message per layer cost a short
# prompt's pull a ZeroMQ round per layer (15 tokens of 30 layers: 3.5-4.5 ms grouped against
# 5-7.8 ms, interleaved runs), while a long prompt's layers are this big alone.
MESSAGE_BYTES = 4 << 20


class ZmqTransport(KVTransport):
    """Raw KV bytes over ZeroMQ: ``kv_caches`` is this rank's (K, V) cache per layer."""

    name = "zmq"

    def __init__(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pull_timeout_s: float
    ) -> None:
        self.kv_caches = kv_caches
        self.pull_timeout_s = pull_timeout_s

    def serve(self, reply: Reply, pull: KVPull) -> None:
        import torch

        from actorserve_kernels.kv_quant import as_bytes

        index = torch.tensor(pull.block_ids, dtype=torch.long, device=self.kv_caches[0][0].device)
        pending: list[Any] = []
        first, size, last = 0, 0, len(self.kv_caches) - 1
        for layer, (k, v) in enumerate(self.kv_caches):
            for cache in (k, v):  # a GPU cache is staged through host memory
                data = as_bytes(cache).index_select(0, index).cpu().view(torch.uint8).numpy()
                pending.append(data)
                size += data.nbytes
            if size >= MESSAGE_BYTES or layer == last:
                reply.send(KVPullLayer(first, layer - first + 1), pending, copy=False)
                pending, first, size = [], layer + 1, 0

    def pull(self, channel: PullChannel, load: P2PLoad, cancelled: Callable[[], bool]) -> int:
        import torch

        from actorserve_kernels.kv_quant import as_bytes

        device = self.kv_caches[0][0].device
        index = torch.tensor(load.block_ids, dtype=torch.long, device=device)
        num_bytes = 0
        layers = receive_layers(channel, len(self.kv_caches), self.pull_timeout_s, cancelled)
        for first, frames in layers:
            for i, frame in enumerate(frames):
                layer = first + i // 2
                cache = self.kv_caches[layer][i % 2]
                shape = (len(load.block_ids), *cache.shape[1:])
                expected = cache.element_size() * len(load.block_ids) * cache[0].numel()
                if len(frame.buffer) != expected:
                    raise PullFailed(
                        f"layer {layer}: {len(frame.buffer)} bytes, expected {expected}"
                    )
                cache = as_bytes(cache)  # a quantized cache's blocks move as stored
                data = _read_only_tensor(frame.buffer, cache.dtype).view(shape)
                cache.index_copy_(0, index, data.to(device))  # reads it only
                num_bytes += expected
        return num_bytes


def receive_layers(
    channel: PullChannel, num_layers: int, timeout_s: float, cancelled: Callable[[], bool]
) -> Iterator[tuple[int, list[zmq.Frame]]]:
    """(first layer, its 2 x count raw frames) per message, in layer order, until every
    layer came; ``PullFailed`` on a refusal, a timeout, an abort or a malformed reply."""
    layer = 0
    while layer < num_layers:
        if cancelled():
            raise PullFailed("aborted")
        got = channel.recv(timeout_s)
        if got is None:
            raise PullFailed(f"no data from the prefill instance in {timeout_s:g} s")
        reply, frames = got
        if isinstance(reply, KVPullRefused):
            raise PullFailed(f"refused: {reply.reason}")
        if not isinstance(reply, KVPullLayer):
            raise PullFailed(f"expected layers, got {type(reply).__name__}")
        n = reply.count
        if reply.layer != layer or n < 1 or layer + n > num_layers or len(frames) != 2 * n:
            raise PullFailed(f"expected layer {layer}, got {reply.layer} (+{n})")
        yield layer, frames
        layer += n


def _read_only_tensor(buffer: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over a received frame without copying it (torch warns that the buffer is
    read-only: the tensor is only ever a copy source)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=dtype)
