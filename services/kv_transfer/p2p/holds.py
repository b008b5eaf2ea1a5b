"""A p2p prefill rank's holds: the blocks it keeps for decode instances to pull."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from services.protocol import KVLayout, KVPull, P2PHold

_FORGOTTEN_KEPT = 4096  # holds that ended, remembered to refuse late pulls with a reason


@dataclass
class _Lease:
    hold: P2PHold
    expires_at: float


class Holds:
    """Each hold's lease (extended by a renewal or a pull, ended by a release or when it
    lapses), the holds that ended (so a late pull is refused with the reason), and the
    releases that came before their hold (the hold then ends on arrival). Thread-safe:
    the step's thread adds holds, the side channel's thread serves them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._forgotten: OrderedDict[str, str] = OrderedDict()  # hold -> why it ended
        self._released_early: OrderedDict[str, None] = OrderedDict()

    def add(self, hold: P2PHold, now: float) -> bool:
        """Start ``hold``; True when the decode side released it before it came (all of
        it cached there): it has ended already."""
        with self._lock:
            self._leases[hold.req_id] = _Lease(hold, now + hold.lease_s)
            if self._released_early.pop(hold.req_id, "absent") is None:
                return self._end(hold.req_id, "released")
        return False

    def end(self, req_id: str, why: str) -> bool:
        """End a hold; False if there was none."""
        with self._lock:
            return self._end(req_id, why)

    def _end(self, req_id: str, why: str) -> bool:
        if self._leases.pop(req_id, None) is None:
            return False
        self._forgotten[req_id] = why
        while len(self._forgotten) > _FORGOTTEN_KEPT:
            self._forgotten.popitem(last=False)
        return True

    def renew(self, req_id: str) -> None:
        with self._lock:
            if (lease := self._leases.get(req_id)) is not None:
                lease.expires_at = time.monotonic() + lease.hold.lease_s

    def release(self, req_id: str) -> bool:
        """The decode side is done with ``req_id``: True if a hold ended. One not here yet
        (and never here) is remembered, to end when it comes."""
        with self._lock:
            if self._end(req_id, "released"):
                return True
            if req_id not in self._forgotten:
                self._released_early[req_id] = None
                while len(self._released_early) > _FORGOTTEN_KEPT:
                    self._released_early.popitem(last=False)
            return False

    def holds(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._leases

    def ended(self, req_id: str) -> str | None:
        """Why the hold of ``req_id`` ended; None if it is held or was never here."""
        with self._lock:
            return self._forgotten.get(req_id)

    def check(self, pull: KVPull, layout: KVLayout | None) -> str | None:
        """Why ``pull`` may not be served (None: it may); a pull renews its lease."""
        with self._lock:
            lease = self._leases.get(pull.remote_request_id)
            if lease is None:
                why = self._forgotten.get(pull.remote_request_id, "unknown")
                return f"stale pull: the hold ended ({why})"
            lease.expires_at = time.monotonic() + lease.hold.lease_s
            held = dict(zip(lease.hold.block_ids, lease.hold.generations, strict=True))
        if len(pull.block_ids) != len(pull.generations):
            return "one generation per block"
        if pull.layout != layout:
            return f"KV layouts differ: this side {layout}, the puller {pull.layout}"
        for block_id, generation in zip(pull.block_ids, pull.generations, strict=False):
            if held.get(block_id) != generation:
                return (
                    f"stale pull: block {block_id} generation {generation} is not held "
                    f"(holding {held.get(block_id)})"
                )
        return None

    def expire(self, now: float) -> list[str]:
        """End the holds whose lease lapsed by ``now``; their ids."""
        with self._lock:
            lapsed = [r for r, lease in self._leases.items() if lease.expires_at <= now]
            for req_id in lapsed:
                self._end(req_id, "its lease lapsed")
        return lapsed
