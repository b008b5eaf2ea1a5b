"""p2p's worker half: a prefill rank serves its holds on the side channel, a decode rank
pulls blocks into its cache; the bytes move by the configured transport
(``services/kv_transfer/transport.py``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import msgspec

from services.config.kv_transfer import KVTransferConfig
from services.flags import ConfigError
from services.kv_transfer.base import KVConnectorWorker
from services.kv_transfer.nixl_transport import NixlTransport
from services.kv_transfer.p2p.holds import Holds
from services.kv_transfer.side_channel import PullChannel, Reply, SideChannelServer
from services.kv_transfer.sim_transport import SimTransport
from services.kv_transfer.transport import KVTransport, PullFailed
from services.kv_transfer.zmq_transport import ZmqTransport
from services.protocol import (
    KVLayout,
    KVPull,
    KVRelease,
    KVRenew,
    KVTransferDone,
    P2PLoad,
    P2PMetadata,
)

if TYPE_CHECKING:
    import torch

    from services.config import EngineConfig

logger = logging.getLogger(__name__)

_meta_decoder = msgspec.msgpack.Decoder(P2PMetadata)
_HOLD_WAIT_S = 10.0  # a pull that overtook its hold (plan not yet at this rank) waits this long
_LOADS_AT_ONCE = 4
_TRANSPORTS = ("zmq", "nixl")


class P2PConnectorWorker(KVConnectorWorker):
    """p2p's worker half. Prefill rank: holds the blocks the plans name, serves pulls that
    match a hold, ends holds on release or lapse. Decode rank: pulls each load's blocks
    (several loads at once), reports each loaded or failed, releases each hold after."""

    def __init__(
        self,
        config: KVTransferConfig,
        engine: EngineConfig,
        rank: int,
        report: Callable[[KVTransferDone], None],
    ) -> None:
        super().__init__(config, engine, rank, report)
        self.pull_timeout_s = config.extra("pull_timeout_s", 30.0)
        self.transport = config.kv_connector_extra_config.get("transport", "zmq")
        if self.transport not in _TRANSPORTS:
            raise ConfigError(
                f"--kv-transfer-config: kv_connector_extra_config.transport must be one of "
                f"{', '.join(_TRANSPORTS)}, got {self.transport!r}"
            )
        self._tensors: KVTransport | None = None  # zmq or nixl, once the caches exist
        self._holds = Holds()
        self._lock = threading.Lock()
        self._to_start: list[P2PLoad] = []  # bound, started by start_load_kv
        # Loads run in parallel (one slow or dead prefill instance must not hold up the
        # others); at most this many at once.
        self._pool = ThreadPoolExecutor(_LOADS_AT_ONCE, thread_name_prefix="p2p-load")
        self._pending: set[str] = set()  # loads started, not yet reported
        self._cancelled: set[str] = set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.layout: KVLayout | None = None
        self.bound_port: int | None = None

    def register_kv_caches(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout
    ) -> None:
        self.layout = layout
        if self.transport == "nixl":
            if self.simulated_link is not None:
                raise ConfigError("transport nixl moves KV tensors; the simulated backend has none")
            name = f"p2p-{self.config.engine_id}-{self.rank}"
            self._tensors = NixlTransport(name, kv_caches, self.pull_timeout_s)
        else:
            self._tensors = ZmqTransport(kv_caches, self.pull_timeout_s)
        if self.config.is_producer:
            port = self.config.kv_port + self.rank
            server = SideChannelServer(self.config.kv_ip, port)
            self.bound_port = port
            self._start(self._serve, server)

    def _transport(self) -> KVTransport:
        """The transport of this rank's pulls and answers: a simulated backend has no
        tensors (the worker gives ``simulated_link``, possibly after the caches)."""
        if self.simulated_link is not None:
            assert self.layout is not None
            return SimTransport(self.layout, self.simulated_link, self.pull_timeout_s)
        assert self._tensors is not None, "register_kv_caches first"
        return self._tensors

    def _start(self, target: Callable[..., None], *args: Any) -> None:
        t = threading.Thread(target=target, args=args, name=f"p2p-{target.__name__}", daemon=True)
        t.start()
        self._threads.append(t)

    def bind_connector_metadata(self, metadata: bytes) -> None:
        if not metadata:
            return
        meta = _meta_decoder.decode(metadata)
        now = time.monotonic()
        # The decode side may have let a hold go before it got here (all of it cached there).
        released = [hold.req_id for hold in meta.holds if self._holds.add(hold, now)]
        released += [r for r in meta.cancels if self._holds.end(r, "released by an abort")]
        with self._lock:
            self._cancelled.update(r for r in meta.cancels if r in self._pending)
            self._pending.update(load.req_id for load in meta.loads)
        self._to_start.extend(meta.loads)
        if released:
            self.report(KVTransferDone(self.rank, finished_sending=released))

    def start_load_kv(self) -> None:
        for load in self._to_start:
            self._pool.submit(self._load, load)
        self._to_start.clear()

    # ---------------------------------------------------------------- prefill side

    def _serve(self, server: SideChannelServer) -> None:
        # A pull that arrives before its hold (the plan carrying it is still on the way
        # to this rank) waits for it, up to _HOLD_WAIT_S.
        waiting: list[tuple[Reply, KVPull, float]] = []
        try:
            while not self._stop.is_set():
                if (got := server.recv(50)) is not None:
                    reply, msg = got
                    try:
                        self._handle(reply, msg, waiting)
                    except Exception:  # one bad pull must not end the side channel
                        logger.exception("p2p: side-channel message %s failed", type(msg).__name__)
                        if isinstance(msg, KVPull):
                            reply.refuse("the prefill side failed to serve it")
                now = time.monotonic()
                still: list[tuple[Reply, KVPull, float]] = []
                for reply, pull, deadline in waiting:
                    if self._holds.holds(pull.remote_request_id):
                        self._serve_pull(reply, pull)
                    elif now >= deadline:
                        reply.refuse(f"no hold for {pull.remote_request_id}")
                    else:
                        still.append((reply, pull, deadline))
                waiting[:] = still
                self._expire(now)
        finally:
            server.close()

    def _handle(
        self,
        reply: Reply,
        msg: KVPull | KVRenew | KVRelease,
        waiting: list[tuple[Reply, KVPull, float]],
    ) -> None:
        req_id = msg.remote_request_id
        if isinstance(msg, KVRenew):
            self._holds.renew(req_id)
        elif isinstance(msg, KVRelease):
            if self._holds.release(req_id):
                self.report(KVTransferDone(self.rank, finished_sending=[req_id]))
        elif self._holds.holds(req_id):
            self._serve_pull(reply, msg)
        elif (gone := self._holds.ended(req_id)) is not None:
            reply.refuse(f"stale pull: the hold of {req_id} ended ({gone})")
        else:
            waiting.append((reply, msg, time.monotonic() + _HOLD_WAIT_S))

    def _serve_pull(self, reply: Reply, pull: KVPull) -> None:
        if (reason := self._holds.check(pull, self.layout)) is not None:
            reply.refuse(reason)
            return
        transport = self._transport()
        if pull.transport == "nixl" and transport.name != "nixl":
            reply.refuse('this prefill instance does not serve NIXL '
                         '(give it "transport": "nixl" too)')  # fmt: skip
            return
        transport.serve(reply, pull)

    def _expire(self, now: float) -> None:
        lapsed = self._holds.expire(now)
        for req_id in lapsed:
            logger.warning("p2p: the lease of %s lapsed before a pull; freeing its blocks", req_id)
        if lapsed:
            self.report(KVTransferDone(self.rank, finished_sending=lapsed, num_expired=len(lapsed)))

    # ---------------------------------------------------------------- decode side

    def _load(self, load: P2PLoad) -> None:
        start = time.monotonic()
        done = KVTransferDone(self.rank, failed_recving=[load.req_id])
        try:
            num_bytes = self._pull(load)
            seconds = self._transport().seconds(time.monotonic() - start)
            done = KVTransferDone(self.rank, finished_recving=[load.req_id],
                                  num_bytes=num_bytes, seconds=seconds)  # fmt: skip
        except PullFailed as e:
            logger.warning("p2p: pull of %s failed: %s; computing it here", load.req_id, e)
        except Exception:  # whatever it was, the request must not wait forever
            logger.exception("p2p: pull of %s failed; computing it here", load.req_id)
        finally:
            with self._lock:
                self._pending.discard(load.req_id)
                self._cancelled.discard(load.req_id)
            self.report(done)

    def _pull(self, load: P2PLoad) -> int:
        """Copy the blocks into this rank's cache; the bytes moved. Always releases the hold."""
        assert self.layout is not None
        transport = self._transport()
        channel = PullChannel(load.remote_host, load.remote_port + self.rank)
        try:
            channel.send(KVPull(load.remote_request_id, load.remote_block_ids,
                                load.remote_generations, self.layout, transport.name))  # fmt: skip

            def cancelled() -> bool:
                with self._lock:
                    return load.req_id in self._cancelled

            return transport.pull(channel, load, cancelled)
        finally:
            channel.release(load.remote_request_id)

    def shutdown(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for t in self._threads:
            t.join(timeout=2)
        if self._tensors is not None:
            self._tensors.close()
