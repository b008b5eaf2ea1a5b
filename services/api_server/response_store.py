"""The Responses API's state (``serving_responses.py``): responses kept for
``previous_response_id``, ``GET`` and ``cancel``, in this server's memory, bounded in count
(``ACTORSERVE_RESPONSES_STORE_MAX``, default 1,024) and age
(``ACTORSERVE_RESPONSES_STORE_TTL_S`` seconds, default 3,600), oldest out first."""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Stored:
    response: dict[str, Any]
    history: list[dict[str, Any]]  # the conversation up to and including its output
    at: float = field(default_factory=time.monotonic)
    task: asyncio.Task[Any] | None = None  # the answer while in progress
    cancelled: bool = False  # by ``/cancel`` (not its client leaving)


class ResponseStore:
    """Responses kept for ``previous_response_id``, ``GET`` and ``cancel`` (bounded in
    count and age, oldest out first)."""

    def __init__(self, max_entries: int | None = None, ttl_s: float | None = None) -> None:
        env = os.environ
        self.max_entries = max_entries or int(env.get("ACTORSERVE_RESPONSES_STORE_MAX", "1024"))
        self.ttl_s = ttl_s or float(env.get("ACTORSERVE_RESPONSES_STORE_TTL_S", "3600"))
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._items:
            first = next(iter(self._items.values()))
            if now - first.at <= self.ttl_s and len(self._items) <= self.max_entries:
                break
            self._items.popitem(last=False)

    def put(self, key: str, stored: Stored) -> None:
        self._items[key] = stored
        self._items.move_to_end(key)
        self._expire()

    def get(self, key: str) -> Stored | None:
        self._expire()
        return self._items.get(key)

    def pop(self, key: str) -> Stored | None:
        return self._items.pop(key, None)
