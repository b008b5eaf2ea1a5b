"""``multi``: several connectors in order (vLLM's MultiConnector).

``kv_connector_extra_config.connectors``: a list of connector configs (the same JSON as
``--kv-transfer-config``, role and engine id inherited), e.g. host offload in front of a
file store, or p2p with offload. A request loads from the connector that supplies most of
its prompt, the first of those on a tie (vLLM takes the first that supplies any: a host
tier listed before p2p would then load a few blocks and leave the prefill instance's KV
unpulled), and the others that offered give it up (``drop_load``: p2p releases the
prefill instance's hold); every connector sees every block-pool change (each saves what it
keeps); a finished request's blocks are held while any connector holds them, and its
``kv_transfer_params`` are the first connector's that gives some. Worker halves bind
their metadata in order, all before any starts a load, and report tagged with their
place in the list.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from services.config.kv_transfer import KVTransferConfig
from services.flags import ConfigError
from services.kv_transfer.base import (
    KVConnectorScheduler,
    KVConnectorWorker,
    TransferOutcome,
    connector_class,
)
from services.protocol import KVCacheEvent, KVLayout, KVTransferDone

if TYPE_CHECKING:
    import torch

    from services.config import EngineConfig
    from services.kv_cache.free_block_queue import KVCacheBlock
    from services.protocol import BlockHash
    from services.request import Request

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[bytes])


def child_configs(config: KVTransferConfig) -> list[KVTransferConfig]:
    raw = config.kv_connector_extra_config.get("connectors")
    if not isinstance(raw, list) or not raw:
        raise ConfigError(
            "--kv-transfer-config multi needs kv_connector_extra_config.connectors: a list of "
            "connector configs"
        )
    children = []
    for item in raw:
        if not isinstance(item, dict):
            raise ConfigError("--kv-transfer-config multi: each of connectors must be an object")
        item = {"kv_role": config.kv_role, **item}
        child = KVTransferConfig.from_json(msgspec.json.encode(item).decode())
        if child.kv_connector == "multi":
            raise ConfigError("--kv-transfer-config multi: connectors cannot nest multi")
        if "engine_id" not in item:
            child.engine_id = config.engine_id
        children.append(child)
    return children


class MultiConnectorScheduler(KVConnectorScheduler):
    moves_blocks_between_servers = False  # its connectors say

    def __init__(
        self, config: KVTransferConfig, engine: EngineConfig, kv_block_bytes: int = 0
    ) -> None:
        super().__init__(config, engine, kv_block_bytes)
        self.children = [
            connector_class(c.kv_connector, 0)(c, engine, kv_block_bytes)
            for c in child_configs(config)
        ]
        self.keeps_blocks = any(child.keeps_blocks for child in self.children)
        self._chosen: dict[str, int] = {}  # request -> the child that loads it
        self._offered: dict[str, list[int]] = {}  # request -> the children that could
        self._holders: dict[str, set[int]] = {}  # finished request -> children holding it

    @classmethod
    def check_params(
        cls, params: dict[str, Any], config: KVTransferConfig, engine: EngineConfig
    ) -> None:
        for child in child_configs(config):
            connector_class(child.kv_connector, 0).check_params(params, child, engine)

    def enable_events(self, enabled: bool) -> None:
        for child in self.children:
            child.enable_events(enabled)

    def request_added(self, request: Request) -> None:
        for child in self.children:
            child.request_added(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        best, best_i, offered = (0, False), -1, []
        for i, child in enumerate(self.children):
            found = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if found[0]:
                offered.append(i)
            if found[0] > best[0]:
                best, best_i = found, i
        if best_i >= 0:
            self._chosen[request.req_id] = best_i
            self._offered[request.req_id] = offered
        return best

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if (i := self._chosen.pop(request.req_id, None)) is not None:
            self.children[i].update_state_after_alloc(request, block_ids, num_external_tokens)
            for other in self._offered.pop(request.req_id, []):
                if other != i:
                    self.children[other].drop_load(request)

    def build_connector_meta(self) -> bytes:
        self._chosen.clear()
        self._offered.clear()
        metas = [child.build_connector_meta() for child in self.children]
        return _encoder.encode(metas) if any(metas) else b""

    def request_finished(
        self, request: Request, blocks: list[KVCacheBlock]
    ) -> tuple[bool, dict[str, Any] | None]:
        holders: set[int] = set()
        params: dict[str, Any] | None = None
        for i, child in enumerate(self.children):
            hold, child_params = child.request_finished(request, blocks)
            if hold:
                holders.add(i)
            if params is None:
                params = child_params
        if holders:
            self._holders[request.req_id] = holders
        return bool(holders), params

    def update_connector_output(self, done: KVTransferDone) -> TransferOutcome:
        if not 0 <= done.connector < len(self.children):
            return TransferOutcome()
        out = self.children[done.connector].update_connector_output(done)
        sent = []
        for req_id in out.sent:
            holders = self._holders.get(req_id)
            if holders is None:
                continue
            holders.discard(done.connector)
            if not holders:
                del self._holders[req_id]
                sent.append(req_id)
        # A request aborted while loading is held by the loading child: its load's end
        # frees it (the scheduler looks in its held requests first).
        for req_id in [*out.loaded, *out.failed]:
            self._holders.pop(req_id, None)
        return TransferOutcome(sent, out.loaded, out.failed)

    def has_pending_metadata(self) -> bool:
        return any(child.has_pending_metadata() for child in self.children)

    def on_block_cached(self, block_hash: BlockHash, block_id: int) -> None:
        for child in self.children:
            child.on_block_cached(block_hash, block_id)

    def on_block_evicted(self, block_hash: BlockHash, block_id: int) -> None:
        for child in self.children:
            child.on_block_evicted(block_hash, block_id)

    def reset_prefix_cache(self) -> None:
        for child in self.children:
            child.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        return [e for child in self.children for e in child.take_events()]


class MultiConnectorWorker(KVConnectorWorker):
    def __init__(
        self,
        config: KVTransferConfig,
        engine: EngineConfig,
        rank: int,
        report: Callable[[KVTransferDone], None],
    ) -> None:
        super().__init__(config, engine, rank, report)
        self.children = [
            connector_class(c.kv_connector, 1)(c, engine, rank, self._reporter(i))
            for i, c in enumerate(child_configs(config))
        ]

    def _reporter(self, index: int) -> Callable[[KVTransferDone], None]:
        def report(done: KVTransferDone) -> None:
            done.connector = index
            self.report(done)

        return report

    def register_kv_caches(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout
    ) -> None:
        for child in self.children:
            child.simulated_link = self.simulated_link
            child.register_kv_caches(kv_caches, layout)

    def bind_connector_metadata(self, metadata: bytes) -> None:
        if not metadata:
            return
        for child, meta in zip(self.children, _decoder.decode(metadata), strict=True):
            child.bind_connector_metadata(meta)

    def start_load_kv(self) -> None:
        for child in self.children:
            child.start_load_kv()

    def shutdown(self) -> None:
        for child in self.children:
            child.shutdown()
