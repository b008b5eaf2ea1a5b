"""p2p for the simulated worker backend, which has no KV tensors: the same exchange as
ZeroMQ's (holds, pulls, checks, releases; a header per layer, empty frames), then the
modelled time of moving what a real rank of the simulated model would move (its layout)
over the simulated device's interconnect, in simulated time (``--sim-speed``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.kv_transfer.transport import KVTransport, PullFailed
from services.kv_transfer.zmq_transport import receive_layers
from services.model_arch import DTYPE_BYTES, kv_row_bytes
from services.protocol import KVLayout, KVPull, KVPullLayer, P2PLoad

if TYPE_CHECKING:
    from services.kv_transfer.side_channel import PullChannel, Reply


class SimTransport(KVTransport):
    """``link``: the link a transfer crosses (bytes/s, latency s) and --sim-speed."""

    name = "zmq"  # its pulls are ZeroMQ's, with empty frames

    def __init__(
        self, layout: KVLayout, link: tuple[float, float, float], pull_timeout_s: float
    ) -> None:
        self.layout = layout
        self.link = link
        self.pull_timeout_s = pull_timeout_s

    def serve(self, reply: Reply, pull: KVPull) -> None:
        n = self.layout.num_layers
        reply.send(KVPullLayer(0, n), [b""] * (2 * n))

    def pull(self, channel: PullChannel, load: P2PLoad, cancelled: Callable[[], bool]) -> int:
        start = time.monotonic()
        layout = self.layout
        for _ in receive_layers(channel, layout.num_layers, self.pull_timeout_s, cancelled):
            pass  # no data: the exchange and its checks only
        if cancelled():
            raise PullFailed("aborted")
        # "sim-<dtype>-kv-<kv cache dtype>", as the sim worker names its layout
        dtype, _, kv_dtype = layout.dtype.removeprefix("sim-").partition("-kv-")
        row = kv_row_bytes(kv_dtype or "auto", layout.head_dim, DTYPE_BYTES[dtype])
        num_bytes = (2 * layout.num_layers * layout.num_kv_heads * row
                     * layout.block_size * len(load.block_ids))  # fmt: skip
        bandwidth, latency, speed = self.link
        # The modelled time from the start (the exchange above is part of it, as the
        # device's timeline in the sim worker); longer only when this host is slower.
        time.sleep(max(0.0, start + (num_bytes / bandwidth + latency) * speed - time.monotonic()))
        return num_bytes

    def seconds(self, wall_s: float) -> float:
        return wall_s / self.link[2]  # in simulated seconds, as every sim time
