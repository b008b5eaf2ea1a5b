"""The scheduler's side of a KV connector: prompt KV loaded from outside, blocks held
for a transfer after their request finished."""

from __future__ import annotations

from services.kv_cache.free_block_queue import KVCacheBlock
from services.kv_cache.manager import KVCacheManager
from services.kv_cache.metrics import PrefixCacheStats
from services.kv_transfer.base import KVConnectorScheduler
from services.protocol import KVCacheEvent, KVTransferDone
from services.request import Request
from services.scheduler.request_table import RequestTable


class RemoteKV:
    """What the scheduler asks of its KV connector (``--kv-transfer-config``), and the moves
    of the request table that follow; with no connector every call is a no-op.

    A waiting request whose prompt KV the connector supplies asynchronously gets blocks
    for its whole prompt and waits in ``loading`` until every worker rank reports the
    load; then it is ``loaded`` (it runs as soon as a place is free), or, if the load
    failed, goes back to the head of the queue to compute its prompt. A finished request
    whose blocks the connector holds for a transfer stays in ``held`` until every rank
    reports the transfer over.
    """

    def __init__(
        self,
        connector: KVConnectorScheduler | None,
        kv_cache_manager: KVCacheManager,
        table: RequestTable,
        enable_kv_cache_events: bool,
    ) -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        self.table = table
        if connector is not None:
            if connector.keeps_blocks:  # per-block calls only where someone listens
                kv_cache_manager.block_pool.listener = connector
            connector.enable_events(enable_kv_cache_events)
        # Prompt tokens asked of the connector and supplied by it (vLLM's
        # vllm:external_prefix_cache_queries / _hits), once per admission.
        self._prefix_cache_stats = PrefixCacheStats()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return self._prefix_cache_stats if self.connector is not None else None

    def request_added(self, request: Request) -> None:
        if self.connector is not None:
            self.connector.request_added(request)

    def start_load(
        self, request: Request, hit_blocks: list[KVCacheBlock], num_hit: int
    ) -> bool | None:
        """Move the waiting request at the head into ``loading`` when the connector supplies
        part of its prompt asynchronously: True. None when it does not (or there is no
        connector: schedule the request as usual); False when its blocks do not fit
        (nothing changed; it waits, "capacity").

        The blocks cover the whole prompt (what is loaded, what it then computes, the last
        token's slot), so that once loaded the request runs without needing another
        block: loaded requests waiting for blocks that only their own admission could
        free would never run."""
        if self.connector is None:
            return None
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit)
        if not (num_external and load_async):
            return None
        manager = self.kv_cache_manager
        num_new = request.num_tokens - num_hit
        if manager.allocate_slots(request, num_new, hit_blocks, num_hit) is None:
            request.waiting_reason = "capacity"
            return False
        self.table.start_loading(request)
        self.record_prefix_cache_query(request, num_hit, num_external)
        self.connector.update_state_after_alloc(
            request, manager.get_block_ids(request.req_id), num_external
        )
        request.num_computed_tokens = num_hit + num_external
        return True

    def record_prefix_cache_query(self, request: Request, num_hit: int, num_external: int) -> None:
        """An admitted request's prefix lookups; its cached tokens count both (as vLLM)."""
        self.kv_cache_manager.record_prefix_cache_query(request, num_hit)
        if self.connector is not None and not request.skip_reading_prefix_cache:
            self._prefix_cache_stats.record(
                request.num_tokens, num_external, preempted=request.is_recomputing
            )
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit + num_external

    def request_finished(self, request: Request) -> bool:
        """Whether the connector holds the finished request's blocks (for a transfer)."""
        if self.connector is None:
            return False
        blocks = self.kv_cache_manager.req_to_blocks.get(request.req_id, [])
        hold, request.kv_transfer_params_out = self.connector.request_finished(request, blocks)
        return hold

    def transfers_done(self, done: KVTransferDone) -> None:
        """One worker rank's report of transfers that ended: free holds that are over,
        make loaded requests ready to run (``loaded``), queue failed ones to recompute."""
        if self.connector is None:
            return
        outcome = self.connector.update_connector_output(done)
        for req_id in outcome.sent:
            if (held := self.table.release_held(req_id)) is not None:
                self.kv_cache_manager.free(held)
        failed = set(outcome.failed)
        for req_id in outcome.loaded + outcome.failed:
            if (held := self.table.release_held(req_id)) is not None:  # aborted while loading
                self.kv_cache_manager.free(held)
                continue
            request = self.table.load_done(req_id, failed=req_id in failed)
            if request is not None and req_id in failed:
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0
                # It comes back as a preempted request does: its prompt lookup is counted
                # apart, and its cached tokens are what that lookup finds.
                request.num_cached_tokens = -1
                request.load_failed = True

    def build_meta(self) -> bytes:
        """What the workers' connectors need for the next plan."""
        return self.connector.build_connector_meta() if self.connector is not None else b""

    def has_pending_metadata(self) -> bool:
        return self.connector is not None and self.connector.has_pending_metadata()

    def take_events(self) -> list[KVCacheEvent]:
        return self.connector.take_events() if self.connector is not None else []

    def reset_prefix_cache(self) -> None:
        if self.connector is not None:
            self.connector.reset_prefix_cache()
