"""How p2p's held KV blocks move from a prefill rank to a decode rank: one interface, a
transport per way of moving them (``kv_connector_extra_config.transport``).

The p2p connector (the ``p2p`` package) does everything else, the same for every transport, over
the side channel (``side_channel.py``): holds and their leases, renewals, the check of a
pull against its hold (blocks, generations, layout), the release after it, and the
reports to the scheduler. A transport is only the bytes:

- ``zmq`` (``zmq_transport.py``): the layers' raw bytes as frames on the side channel;
- ``nixl`` (``nixl_transport.py``): the answer says where the blocks are, the decode rank
  READs them over NIXL;
- the simulated link (``sim_transport.py``): the sim worker has no tensors; the same
  exchange with empty frames, then the modelled time of moving the bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.kv_transfer.side_channel import PullChannel, Reply
    from services.protocol import KVPull, P2PLoad


class PullFailed(Exception):
    """A pull that did not deliver every block (refused, timed out, aborted, malformed):
    the decode side computes the prompt itself. The message says why, for the log."""


class KVTransport(ABC):
    """One worker rank's way of moving KV blocks, both directions.

    Serving (prefill rank): ``serve`` answers a pull the connector has checked against its
    hold; it may run on the side channel's thread only. Pulling (decode rank): ``pull``
    runs on a load thread, several at once, after the connector sent the ``KVPull``
    (``name`` is its ``transport``); it fills ``load.block_ids`` from
    ``load.remote_block_ids``, returns the bytes moved, and raises ``PullFailed`` when it
    cannot; it stops early once ``cancelled()`` (the request was aborted) and never leaves
    a transfer running into the blocks when it returns. The connector releases the hold
    after ``pull`` returns or raises. ``close`` frees what the transport holds."""

    # What a pull asks the serving rank for (``KVPull.transport``).
    name: str = "zmq"

    @abstractmethod
    def serve(self, reply: Reply, pull: KVPull) -> None:
        """Answer ``pull`` (already checked) through ``reply``."""

    @abstractmethod
    def pull(self, channel: PullChannel, load: P2PLoad, cancelled: Callable[[], bool]) -> int:
        """Receive the answer to ``load``'s pull on ``channel`` and put the blocks in place;
        the bytes moved."""

    def seconds(self, wall_s: float) -> float:
        """A pull's duration as reported (the simulated link reports simulated time)."""
        return wall_s

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free what the transport holds (nothing for most)."""
