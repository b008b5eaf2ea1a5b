"""``p2p``: a decode instance pulls a prefill instance's KV blocks straight from its workers.

The flow (``actorserve pd-proxy`` drives it, as vLLM's NixlConnector proxy does):

1. The prefill instance gets the request with ``max_tokens=1`` and
   ``kv_transfer_params: {"do_remote_decode": true}``. When it finishes, its scheduler
   does not free the blocks: it *holds* them (``P2PHold`` to every worker rank) and
   answers with params naming them: ``remote_request_id``, ``remote_block_ids``,
   ``remote_block_generations``, ``remote_host``/``remote_port`` (rank r's side channel
   is ``remote_port + r``), ``tp_size``, ``remote_engine_id``.
2. The decode instance gets the original request with those params. While it is queued,
   its scheduler renews the lease (``KVRenew``, every third of ``lease_s``). Once it has
   blocks for the prompt (all but the last token, which it computes itself to sample),
   the request waits (``WAITING_FOR_REMOTE_KVS``) while each worker rank pulls its shard
   layer by layer (``KVPull``; K and V of one layer per message, into the decode
   cache as each arrives) and then acknowledges (``KVRelease``).
3. A prefill rank stops serving a hold when it is released, or when ``lease_s`` passes
   with no pull or renewal, and reports it; once every rank has, the prefill scheduler
   frees the blocks. A pull for a hold that is gone, or for blocks whose generation
   differs from the hold's (freed and reused), is refused: the decode side then computes
   the prompt itself. It never decodes from KV it did not get whole.

The data goes worker to worker over ZeroMQ TCP (never through the proxy or a scheduler).
``kv_connector_extra_config``: ``lease_s`` (60), ``pull_timeout_s`` (30: the longest
wait for the next layer before the pull counts as failed), ``transport`` ("zmq"; "nixl":
the decode rank READs the blocks over NIXL, ``nixl_transport.py``, both sides need it).
"""

from __future__ import annotations

import array
import hashlib
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from services.config.kv_transfer import KVTransferConfig
from services.flags import ConfigError
from services.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker, TransferOutcome
from services.kv_transfer.nixl_transport import NixlAgent, NixlError
from services.model_arch import DTYPE_BYTES
from services.protocol import (
    KVLayout,
    KVPull,
    KVPullLayer,
    KVPullNixl,
    KVPullRefused,
    KVRelease,
    KVRenew,
    KVSideChannelInput,
    KVSideChannelReply,
    KVTransferDone,
    P2PHold,
    P2PLoad,
    P2PMetadata,
)

if TYPE_CHECKING:
    import torch

    from services.config import EngineConfig
    from services.kv_cache.free_block_queue import KVCacheBlock
    from services.request import Request

logger = logging.getLogger(__name__)

_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(P2PMetadata)
_input_decoder = msgspec.msgpack.Decoder(KVSideChannelInput)
_reply_decoder = msgspec.msgpack.Decoder(KVSideChannelReply)
_FORGOTTEN_KEPT = 4096  # holds that ended, remembered to refuse late pulls with a reason
_HOLD_WAIT_S = 10.0
_LOADS_AT_ONCE = 4
_TRANSPORTS = ("zmq", "nixl")
# Layers travel in messages of at least this many bytes: one message per layer cost a short
# prompt's pull a ZeroMQ round per layer (15 tokens of 30 layers: 3.5-4.5 ms grouped against
# 5-7.8 ms, interleaved runs), while a long prompt's layers are this big alone.
_MESSAGE_BYTES = (
    4 << 20
)  # a pull that overtook its hold (plan not yet at this rank) waits this long


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _dealer(ctx: zmq.Context[Any], host: str, port: int) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(_tcp(host, port))
    return sock


@dataclass
class RemotePrefill:
    """A decode request's ``kv_transfer_params``: where its prompt's KV waits."""

    request_id: str
    block_ids: list[int]
    generations: list[int]
    host: str
    port: int
    tp_size: int
    block_size: int  # the prefill side's (0: not said)
    lease_s: float  # the prefill side's: renew every third of it
    prompt_hash: str  # the prompt the blocks hold (checked against this request's)
    renewed_at: float = 0.0

    @classmethod
    def parse(cls, p: dict[str, Any]) -> RemotePrefill:
        def need(key: str, kind: type) -> Any:
            value = p.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                what = {list: "a list", str: "a string", int: "an integer"}[kind]
                raise ValueError(f"kv_transfer_params.{key} must be {what}, got {value!r}")
            return value

        block_ids = need("remote_block_ids", list)
        generations = p.get("remote_block_generations", [0] * len(block_ids))
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids + generations):
            raise ValueError("kv_transfer_params: remote_block_ids must be integers")
        if len(generations) != len(block_ids):
            raise ValueError("kv_transfer_params: one remote_block_generation per block")
        return cls(
            request_id=need("remote_request_id", str),
            block_ids=block_ids,
            generations=generations,
            host=need("remote_host", str),
            port=need("remote_port", int),
            tp_size=int(p.get("tp_size") or 1),
            block_size=int(p.get("remote_block_size") or 0),
            lease_s=float(p.get("remote_lease_s") or 60.0),
            prompt_hash=str(p.get("remote_prompt_hash") or ""),
        )


def prompt_hash(token_ids: list[int]) -> str:
    """What a hold's prompt is, so that KV computed for one prompt never serves another."""
    return hashlib.sha256(array.array("q", token_ids).tobytes()).hexdigest()[:32]


class P2PConnectorScheduler(KVConnectorScheduler):
    def __init__(
        self, config: KVTransferConfig, engine: EngineConfig, kv_block_bytes: int = 0
    ) -> None:
        super().__init__(config, engine, kv_block_bytes)
        self.engine = engine
        parallel = engine.parallel
        unsupported = {
            "pipeline parallelism": parallel.pipeline_parallel_size > 1,
            "data parallelism": parallel.data_parallel_size > 1,
            "--nnodes > 1": parallel.nnodes > 1,
        }
        if found := [name for name, on in unsupported.items() if on]:
            raise ConfigError(
                f"--kv-transfer-config p2p does not support {' or '.join(found)} yet: run one "
                "engine per instance (tensor parallelism on one machine works)"
            )
        if config.kv_ip in ("0.0.0.0", "::", "*", ""):
            raise ConfigError(
                f"--kv-transfer-config: kv_ip {config.kv_ip!r} is where the decode side "
                "connects: give this machine's address, not a wildcard"
            )
        self.block_size = engine.cache.block_size
        self.tp_size = parallel.tensor_parallel_size
        self.lease_s = config.extra("lease_s", 60.0)
        self._meta = P2PMetadata()
        self._queued: dict[str, RemotePrefill] = {}  # decode requests not yet given blocks
        self._loading: dict[str, RemotePrefill] = {}  # renewed until every rank has pulled
        self._holding: set[str] = set()
        self._reported: dict[str, set[int]] = {}  # request -> ranks that reported it
        self._failed: set[str] = set()
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._sockets: dict[tuple[str, int], zmq.Socket[Any]] = {}

    # ---------------------------------------------------------------- decode side

    @classmethod
    def check_params(
        cls, params: dict[str, Any], config: KVTransferConfig, engine: EngineConfig
    ) -> None:
        if params.get("do_remote_prefill"):
            if not config.is_consumer:
                raise ValueError(
                    "kv_transfer_params asks for a remote prefill; kv_role is kv_producer"
                )
            remote = RemotePrefill.parse(params)
            tp = engine.parallel.tensor_parallel_size
            if remote.tp_size != tp:
                raise ValueError(
                    f"the prefill instance has tensor parallel size {remote.tp_size} and this "
                    f"one {tp}: p2p moves each rank's shard to the same rank"
                )
            block_size = engine.cache.block_size
            if remote.block_size not in (0, block_size):
                raise ValueError(
                    f"the prefill instance has KV blocks of {remote.block_size} tokens and this "
                    f"one of {block_size}: p2p moves whole blocks (give both --block-size "
                    f"{block_size})"
                )
        elif params.get("do_remote_decode") and not config.is_producer:
            raise ValueError("kv_transfer_params asks for a remote decode; kv_role is kv_consumer")

    def request_added(self, request: Request) -> None:
        p = request.kv_transfer_params
        if not p:
            return
        self.check_params(p, self.config, self.engine)
        if not p.get("do_remote_prefill"):
            return
        remote = RemotePrefill.parse(p)
        why = None
        if remote.prompt_hash and remote.prompt_hash != prompt_hash(request.prompt_token_ids):
            why = "its kv_transfer_params name the KV of another prompt"
        elif request.skip_reading_prefix_cache:  # prompt logprobs: every position computed
            why = "it asks for prompt logprobs"
        if why is not None:
            logger.warning("request %s: computing its prompt here: %s", request.req_id, why)
            self._release(remote)
            return
        remote.renewed_at = time.monotonic()
        self._queued[request.req_id] = remote

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        remote = self._queued.get(request.req_id)
        if remote is None:
            return 0, False
        # The last prompt token is computed here: its logits sample the first output token.
        num_external = request.num_prompt_tokens - 1 - num_computed_tokens
        needed = -(-(request.num_prompt_tokens - 1) // self.block_size)
        if num_external > 0 and len(remote.block_ids) < needed:
            logger.warning(
                "request %s: the prefill instance names %d blocks, the prompt needs %d; "
                "computing it here",
                request.req_id,
                len(remote.block_ids),
                needed,
            )
            num_external = 0
        if num_external <= 0:  # all of it cached here: the remote blocks are not needed
            self._release(self._queued.pop(request.req_id))
            return 0, False
        return num_external, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        remote = self._queued.pop(request.req_id)
        local = request.num_prompt_tokens - 1 - num_external_tokens  # a whole number of blocks
        first = local // self.block_size
        end = -(-(request.num_prompt_tokens - 1) // self.block_size)
        self._meta.loads.append(
            P2PLoad(
                request.req_id,
                block_ids[first:end],
                remote.request_id,
                remote.block_ids[first:end],
                remote.generations[first:end],
                remote.host,
                remote.port,
            )
        )
        self._loading[request.req_id] = remote
        self._reported[request.req_id] = set()

    def drop_load(self, request: Request) -> None:
        if (remote := self._queued.pop(request.req_id, None)) is not None:
            self._release(remote)

    def _release(self, remote: RemotePrefill) -> None:
        """Tell every prefill rank to free a hold this instance will not pull."""
        for rank in range(remote.tp_size):
            self._send(remote.host, remote.port + rank, KVRelease(remote.request_id))

    def _send(self, host: str, port: int, msg: KVRelease | KVRenew) -> None:
        sock = self._sockets.get((host, port))
        if sock is None:
            sock = self._sockets[host, port] = _dealer(self._ctx, host, port)
        try:
            sock.send(_meta_encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # the prefill instance is not taking messages: its lease lapses
            logger.warning("p2p: could not reach %s:%d", host, port)

    # ---------------------------------------------------------------- prefill side

    def request_finished(
        self, request: Request, blocks: list[KVCacheBlock]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.req_id
        if (remote := self._queued.pop(req_id, None)) is not None:
            self._release(remote)  # finished (aborted) before it was given blocks
            return False, None
        if req_id in self._loading:  # aborted mid-load: the blocks wait for the ranks
            self._meta.cancels.append(req_id)
            return True, None
        p = request.kv_transfer_params
        if (
            not p
            or not p.get("do_remote_decode")
            or request.finish_reason not in ("stop", "length")
        ):
            return False, None
        block_ids = [b.block_id for b in blocks]
        generations = [b.generation for b in blocks]
        prompt = prompt_hash(request.prompt_token_ids)
        self._meta.holds.append(P2PHold(req_id, block_ids, generations, self.lease_s))
        self._holding.add(req_id)
        self._reported[req_id] = set()
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": req_id,
            "remote_block_ids": block_ids,
            "remote_block_generations": generations,
            "remote_host": self.config.kv_ip,
            "remote_port": self.config.kv_port,
            "tp_size": self.tp_size,
            "remote_block_size": self.engine.cache.block_size,
            "remote_lease_s": self.lease_s,
            "remote_prompt_hash": prompt,
        }

    # ---------------------------------------------------------------- per step

    def build_connector_meta(self) -> bytes:
        now = time.monotonic()
        for remote in itertools.chain(self._queued.values(), self._loading.values()):
            if now - remote.renewed_at >= remote.lease_s / 3:
                remote.renewed_at = now
                for rank in range(remote.tp_size):
                    self._send(remote.host, remote.port + rank, KVRenew(remote.request_id))
        meta = self._meta
        if not (meta.holds or meta.loads or meta.cancels):
            return b""
        self._meta = P2PMetadata()
        return _meta_encoder.encode(meta)

    def update_connector_output(self, done: KVTransferDone) -> TransferOutcome:
        out = TransferOutcome()
        self._failed.update(r for r in done.failed_recving if r in self._loading)
        for req_id in itertools.chain(
            done.finished_sending, done.finished_recving, done.failed_recving
        ):
            ranks = self._reported.get(req_id)
            if ranks is None:
                continue
            ranks.add(done.rank)
            if len(ranks) < self.tp_size:
                continue
            del self._reported[req_id]
            if req_id in self._holding:
                self._holding.discard(req_id)
                out.sent.append(req_id)
            elif req_id in self._loading:
                del self._loading[req_id]
                if req_id in self._failed:
                    self._failed.discard(req_id)
                    out.failed.append(req_id)
                else:
                    out.loaded.append(req_id)
        return out

    def has_pending_metadata(self) -> bool:
        return bool(self._meta.holds or self._meta.loads or self._meta.cancels)


@dataclass
class _Lease:
    hold: P2PHold
    expires_at: float


class P2PConnectorWorker(KVConnectorWorker):
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
        self._nixl: NixlAgent | None = None
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._forgotten: OrderedDict[str, str] = OrderedDict()  # hold -> why it ended
        self._to_start: list[P2PLoad] = []  # bound, started by start_load_kv
        # Loads run in parallel (one slow or dead prefill instance must not hold up the
        # others); at most this many at once.
        self._pool = ThreadPoolExecutor(_LOADS_AT_ONCE, thread_name_prefix="p2p-load")
        self._pending: set[str] = set()  # loads started, not yet reported
        self._cancelled: set[str] = set()
        self._released_early: OrderedDict[str, None] = OrderedDict()  # releases before holds
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.layout: KVLayout | None = None
        self.bound_port: int | None = None

    def register_kv_caches(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout
    ) -> None:
        self.kv_caches, self.layout = kv_caches, layout
        if self.transport == "nixl":
            if self.simulated_link is not None:
                raise ConfigError("transport nixl moves KV tensors; the simulated backend has none")
            self._nixl = NixlAgent(f"p2p-{self.config.engine_id}-{self.rank}", kv_caches)
        if self.config.is_producer:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            port = self.config.kv_port + self.rank
            try:
                sock.bind(_tcp(self.config.kv_ip, port))
            except zmq.ZMQError as e:
                raise ConfigError(
                    f"p2p side channel: cannot listen on {self.config.kv_ip}:{port} ({e}); "
                    "choose another kv_port in --kv-transfer-config"
                ) from None
            self.bound_port = port
            self._start(self._serve, sock)

    def _start(self, target: Callable[..., None], *args: Any) -> None:
        t = threading.Thread(target=target, args=args, name=f"p2p-{target.__name__}", daemon=True)
        t.start()
        self._threads.append(t)

    def bind_connector_metadata(self, metadata: bytes) -> None:
        if not metadata:
            return
        meta = _meta_decoder.decode(metadata)
        now = time.monotonic()
        released: list[str] = []
        with self._lock:
            for hold in meta.holds:
                self._leases[hold.req_id] = _Lease(hold, now + hold.lease_s)
                if self._released_early.pop(hold.req_id, "absent") is None:
                    # The decode side let it go before it got here (all of it cached there).
                    self._end_lease(hold.req_id, "released")
                    released.append(hold.req_id)
            for req_id in meta.cancels:
                if self._end_lease(req_id, "released by an abort"):
                    released.append(req_id)
                if req_id in self._pending:
                    self._cancelled.add(req_id)
            for load in meta.loads:
                self._pending.add(load.req_id)
        self._to_start.extend(meta.loads)
        if released:
            self.report(KVTransferDone(self.rank, finished_sending=released))

    def start_load_kv(self) -> None:
        for load in self._to_start:
            self._pool.submit(self._load, load)
        self._to_start.clear()

    def _end_lease(self, req_id: str, why: str) -> bool:
        """Forget a hold (lock held); False if there was none."""
        if self._leases.pop(req_id, None) is None:
            return False
        self._forgotten[req_id] = why
        while len(self._forgotten) > _FORGOTTEN_KEPT:
            self._forgotten.popitem(last=False)
        return True

    # ---------------------------------------------------------------- prefill side

    def _serve(self, sock: zmq.Socket[Any]) -> None:
        # A pull that arrives before its hold (the plan carrying it is still on the way
        # to this rank) waits for it, up to _HOLD_WAIT_S.
        waiting: list[tuple[bytes, KVPull, float]] = []
        try:
            while not self._stop.is_set():
                if sock.poll(50):
                    frames = sock.recv_multipart()
                    try:
                        msg = _input_decoder.decode(frames[-1])
                    except msgspec.DecodeError:
                        logger.warning("p2p: dropping an undecodable side-channel message")
                        continue
                    try:
                        self._handle(sock, frames[0], msg, waiting)
                    except Exception:  # one bad pull must not end the side channel
                        logger.exception("p2p: side-channel message %s failed", type(msg).__name__)
                        if isinstance(msg, KVPull):
                            self._refuse(sock, frames[0], "the prefill side failed to serve it")
                now = time.monotonic()
                still: list[tuple[bytes, KVPull, float]] = []
                for identity, pull, deadline in waiting:
                    with self._lock:
                        ready = pull.remote_request_id in self._leases
                    if ready:
                        self._serve_pull(sock, identity, pull)
                    elif now >= deadline:
                        self._refuse(sock, identity, f"no hold for {pull.remote_request_id}")
                    else:
                        still.append((identity, pull, deadline))
                waiting[:] = still
                self._expire(now)
        finally:
            sock.close()

    def _handle(
        self,
        sock: zmq.Socket[Any],
        identity: bytes,
        msg: KVPull | KVRenew | KVRelease,
        waiting: list[tuple[bytes, KVPull, float]],
    ) -> None:
        now = time.monotonic()
        with self._lock:
            lease = self._leases.get(msg.remote_request_id)
            gone = self._forgotten.get(msg.remote_request_id)
            if isinstance(msg, KVRenew) and lease is not None:
                lease.expires_at = now + lease.hold.lease_s
            released = isinstance(msg, KVRelease) and self._end_lease(
                msg.remote_request_id, "released"
            )
            if isinstance(msg, KVRelease) and lease is None and gone is None:
                self._released_early[msg.remote_request_id] = None
                while len(self._released_early) > _FORGOTTEN_KEPT:
                    self._released_early.popitem(last=False)
        if released:
            self.report(KVTransferDone(self.rank, finished_sending=[msg.remote_request_id]))
        if isinstance(msg, KVPull):
            if lease is not None:
                self._serve_pull(sock, identity, msg)
            elif gone is not None:
                self._refuse(
                    sock,
                    identity,
                    f"stale pull: the hold of {msg.remote_request_id} ended ({gone})",
                )
            else:
                waiting.append((identity, msg, now + _HOLD_WAIT_S))

    def _refuse(self, sock: zmq.Socket[Any], identity: bytes, reason: str) -> None:
        sock.send_multipart([identity, _meta_encoder.encode(KVPullRefused(reason))])

    def _serve_pull(self, sock: zmq.Socket[Any], identity: bytes, pull: KVPull) -> None:
        import torch

        with self._lock:
            lease = self._leases.get(pull.remote_request_id)
            if lease is None:
                why = self._forgotten.get(pull.remote_request_id, "unknown")
                reason: str | None = f"stale pull: the hold ended ({why})"
            else:
                lease.expires_at = time.monotonic() + lease.hold.lease_s
                held = dict(zip(lease.hold.block_ids, lease.hold.generations, strict=True))
                reason = None
                if len(pull.block_ids) != len(pull.generations):
                    reason = "one generation per block"
                elif pull.layout != self.layout:
                    reason = f"KV layouts differ: this side {self.layout}, the puller {pull.layout}"
                for block_id, generation in zip(pull.block_ids, pull.generations, strict=False):
                    if reason is None and held.get(block_id) != generation:
                        reason = (
                            f"stale pull: block {block_id} generation {generation} is not held "
                            f"(holding {held.get(block_id)})"
                        )
        if reason is not None:
            self._refuse(sock, identity, reason)
            return
        if pull.transport == "nixl":
            if self._nixl is None:
                self._refuse(sock, identity, 'this prefill instance does not serve NIXL '
                             '(give it "transport": "nixl" too)')  # fmt: skip
            else:
                sock.send_multipart([identity, _meta_encoder.encode(self._nixl.describe())])
            return
        if self.simulated_link is not None:  # no tensors: headers and empty frames
            assert self.layout is not None
            n = self.layout.num_layers
            header = _meta_encoder.encode(KVPullLayer(0, n))
            sock.send_multipart([identity, header, *([b""] * (2 * n))])
            return
        index = torch.tensor(pull.block_ids, dtype=torch.long, device=self.kv_caches[0][0].device)
        pending: list[Any] = []
        first, size, last = 0, 0, len(self.kv_caches) - 1
        for layer, (k, v) in enumerate(self.kv_caches):
            for cache in (k, v):  # a GPU cache is staged through host memory
                data = cache.index_select(0, index).cpu().view(torch.uint8).numpy()
                pending.append(data)
                size += data.nbytes
            if size >= _MESSAGE_BYTES or layer == last:
                header = _meta_encoder.encode(KVPullLayer(first, layer - first + 1))
                sock.send_multipart([identity, header, *pending], copy=False)
                pending, first, size = [], layer + 1, 0

    def _expire(self, now: float) -> None:
        with self._lock:
            lapsed = [r for r, lease in self._leases.items() if lease.expires_at <= now]
            for req_id in lapsed:
                self._end_lease(req_id, "its lease lapsed")
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
            seconds = time.monotonic() - start
            if self.simulated_link is not None:
                seconds /= self.simulated_link[2]  # in simulated seconds, as every sim time
            done = KVTransferDone(self.rank, finished_recving=[load.req_id],
                                  num_bytes=num_bytes, seconds=seconds)  # fmt: skip
        except _PullFailed as e:
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
        import torch

        assert self.layout is not None
        sock = _dealer(self._ctx, load.remote_host, load.remote_port + self.rank)
        try:
            sock.send(
                _meta_encoder.encode(
                    KVPull(
                        load.remote_request_id,
                        load.remote_block_ids,
                        load.remote_generations,
                        self.layout,
                        self.transport,
                    )
                )
            )
            if self.simulated_link is not None:
                return self._pull_simulated(sock, load)
            if self._nixl is not None:
                return self._pull_nixl(sock, load, self._nixl)
            device = self.kv_caches[0][0].device
            index = torch.tensor(load.block_ids, dtype=torch.long, device=device)
            num_bytes = 0
            for first, frames in self._layer_messages(sock, load, len(self.kv_caches)):
                for i, frame in enumerate(frames):
                    layer = first + i // 2
                    cache = self.kv_caches[layer][i % 2]
                    shape = (len(load.block_ids), *cache.shape[1:])
                    expected = cache.element_size() * len(load.block_ids) * cache[0].numel()
                    if len(frame.buffer) != expected:
                        raise _PullFailed(
                            f"layer {layer}: {len(frame.buffer)} bytes, expected {expected}"
                        )
                    data = _read_only_tensor(frame.buffer, cache.dtype).view(shape)
                    cache.index_copy_(0, index, data.to(device))  # reads it only
                    num_bytes += expected
            return num_bytes
        finally:
            sock.send(_meta_encoder.encode(KVRelease(load.remote_request_id)), zmq.NOBLOCK)
            sock.close(linger=1000)  # let the release leave

    def _pull_nixl(self, sock: zmq.Socket[Any], load: P2PLoad, nixl: NixlAgent) -> int:
        """Ask where the held blocks are, then READ them over NIXL."""
        if not sock.poll(int(self.pull_timeout_s * 1000)):
            raise _PullFailed(f"no answer from the prefill instance in {self.pull_timeout_s:g} s")
        reply = _reply_decoder.decode(sock.recv())
        if isinstance(reply, KVPullRefused):
            raise _PullFailed(f"refused: {reply.reason}")
        if not isinstance(reply, KVPullNixl):
            raise _PullFailed(f"expected where the blocks are, got {type(reply).__name__}")

        def cancelled() -> bool:
            with self._lock:
                return load.req_id in self._cancelled

        try:
            return nixl.read(
                reply, load.remote_block_ids, load.block_ids, self.pull_timeout_s, cancelled
            )
        except NixlError as e:
            raise _PullFailed(f"NIXL: {e}") from None

    def _layer_messages(
        self, sock: zmq.Socket[Any], load: P2PLoad, num_layers: int
    ) -> Iterator[tuple[int, list[zmq.Frame]]]:
        """(first layer, its 2 x count raw frames) per message, in layer order, until every
        layer came; ``_PullFailed`` on a refusal, a timeout, an abort or a malformed reply."""
        layer = 0
        while layer < num_layers:
            with self._lock:
                if load.req_id in self._cancelled:
                    raise _PullFailed("aborted")
            if not sock.poll(int(self.pull_timeout_s * 1000)):
                raise _PullFailed(f"no data from the prefill instance in {self.pull_timeout_s:g} s")
            frames = sock.recv_multipart(copy=False)
            reply = _reply_decoder.decode(frames[0].buffer)
            if isinstance(reply, KVPullRefused):
                raise _PullFailed(f"refused: {reply.reason}")
            if not isinstance(reply, KVPullLayer):
                raise _PullFailed(f"expected layers, got {type(reply).__name__}")
            n = reply.count
            if reply.layer != layer or n < 1 or layer + n > num_layers or len(frames) != 1 + 2 * n:
                raise _PullFailed(f"expected layer {layer}, got {reply.layer} (+{n})")
            yield layer, frames[1:]
            layer += n

    def _pull_simulated(self, sock: zmq.Socket[Any], load: P2PLoad) -> int:
        """The same exchange with no data, then the modelled time of moving it: what a
        real rank of the simulated model would move (its layout), over the simulated
        device's interconnect, in simulated time (``--sim-speed``)."""
        assert self.layout is not None and self.simulated_link is not None
        start = time.monotonic()
        layout = self.layout
        for _ in self._layer_messages(sock, load, layout.num_layers):
            pass  # no data: the exchange and its checks only
        with self._lock:
            if load.req_id in self._cancelled:
                raise _PullFailed("aborted")
        element = DTYPE_BYTES[layout.dtype.removeprefix("sim-")]
        num_bytes = (2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * element
                     * layout.block_size * len(load.block_ids))  # fmt: skip
        bandwidth, latency, speed = self.simulated_link
        # The modelled time from the start (the exchange above is part of it, as the
        # device's timeline in the sim worker); longer only when this host is slower.
        time.sleep(max(0.0, start + (num_bytes / bandwidth + latency) * speed - time.monotonic()))
        return num_bytes

    def shutdown(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for t in self._threads:
            t.join(timeout=2)


class _PullFailed(Exception):
    pass


def _read_only_tensor(buffer: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over a received frame without copying it (torch warns that the buffer is
    read-only: the tensor is only ever a copy source)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=dtype)
