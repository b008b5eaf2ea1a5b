"""p2p's scheduler half: which requests hold blocks for a decode instance, which pull them
from a prefill instance, and when every worker rank is done (the flow: ``__init__.py``)."""

from __future__ import annotations

import array
import hashlib
import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from services.config.kv_transfer import KVTransferConfig
from services.flags import ConfigError
from services.kv_transfer.base import KVConnectorScheduler, TransferOutcome
from services.kv_transfer.side_channel import ControlSender
from services.protocol import KVRelease, KVRenew, KVTransferDone, P2PHold, P2PLoad, P2PMetadata

if TYPE_CHECKING:
    from services.config import EngineConfig
    from services.kv_cache.free_block_queue import KVCacheBlock
    from services.request import Request

logger = logging.getLogger(__name__)

_meta_encoder = msgspec.msgpack.Encoder()


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
    """p2p's scheduler half. Prefill side: holds a finished request's blocks for the
    workers to serve and names them in the params the client gets. Decode side: renews
    the hold while the request waits, asks its ranks to pull, and releases a hold it will
    not pull."""

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
        self._control = ControlSender()

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
            self._control.send(remote.host, remote.port + rank, KVRelease(remote.request_id))

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
                    self._control.send(remote.host, remote.port + rank, KVRenew(remote.request_id))
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
