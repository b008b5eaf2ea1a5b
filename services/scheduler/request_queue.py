"""The waiting queue, one class per scheduling policy."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from services.registry import SCHEDULING_POLICIES, load
from services.request import Request


class RequestQueue(Protocol):
    """Waiting requests in admission order: ``peek`` is the next one to admit."""

    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, requests: Iterable[Request]) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """First come, first served; a preempted request goes back to the head."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in gone)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Lowest (priority, arrival_time) first, as vLLM; a preempted request keeps its place by key."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def add(self, request: Request) -> None:
        key = (request.priority, request.arrival_time, next(self._tiebreak), request)
        heapq.heappush(self._heap, key)

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._heap = [e for e in self._heap if id(e[3]) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In heap order, not admission order."""
        return (e[3] for e in self._heap)


def create_request_queue(policy: str) -> RequestQueue:
    """``--scheduling-policy``'s queue (services/registry.py names one class per policy)."""
    queue: RequestQueue = load("scheduling policy", SCHEDULING_POLICIES, policy)()
    return queue
