"""The scheduler's requests and the state each one is in."""

from __future__ import annotations

from services.request import Request, RequestEventType, RequestStatus
from services.scheduler.request_queue import create_request_queue


class RequestTable:
    """Every request the scheduler owns, each in exactly one state collection.

    ``compiling`` (its grammar compiles: ``WAITING_FOR_GRAMMAR``) -> ``waiting`` (the
    queue, in policy order: ``WAITING`` or ``PREEMPTED``) -> ``loading`` (a KV connector
    loads its prompt's KV: ``WAITING_FOR_REMOTE_KVS``) -> ``loaded`` (``WAITING``, its KV
    in place: it runs next) -> ``running`` (``RUNNING``, in admission order), and back to
    the queue when preempted or when its load failed. A finished request leaves
    ``requests``; while the connector still holds its blocks it stays in ``held``. Moves
    between states go through the methods here, which set ``status`` to match.
    """

    def __init__(self, scheduling_policy: str) -> None:
        self.scheduling_policy = scheduling_policy
        self.requests: dict[str, Request] = {}
        self.compiling: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduling_policy)
        self.loading: dict[str, Request] = {}
        self.loaded: dict[str, Request] = {}
        self.running: list[Request] = []
        self.held: dict[str, Request] = {}  # finished; not in ``requests``

    def add(self, request: Request, *, compiling: bool) -> None:
        self.requests[request.req_id] = request
        if compiling:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.compiling[request.req_id] = request
        else:
            request.status = RequestStatus.WAITING
            self.waiting.add(request)

    def compiled(self, request: Request) -> None:
        """Its grammar is ready: it joins the queue."""
        del self.compiling[request.req_id]
        request.status = RequestStatus.WAITING
        self.waiting.add(request)

    def start_loading(self, request: Request) -> None:
        """The head of the queue waits for its KV."""
        self._pop_head(request)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.req_id] = request

    def load_done(self, req_id: str, *, failed: bool) -> Request | None:
        """Its KV load ended: it runs next (``loaded``), or, if the load failed, goes back
        to the head of the queue (it waited longest). None if it is not loading."""
        request = self.loading.pop(req_id, None)
        if request is None:
            return None
        request.status = RequestStatus.WAITING
        if failed:
            self.waiting.prepend(request)
        else:
            self.loaded[req_id] = request
        return request

    def admit(self, request: Request, step_id: int) -> None:
        """The head of the queue, or a loaded request, starts running in step ``step_id``."""
        if self.loaded.pop(request.req_id, None) is None:
            self._pop_head(request)
        request.status = RequestStatus.RUNNING
        request.admitted_step_id = step_id
        request.record_event(RequestEventType.SCHEDULED)
        self.running.append(request)

    def preempt(self) -> Request:
        """Move the newest running request (priority policy: the lowest priority, then
        latest) back to the queue, where it keeps its place; the caller frees its KV."""
        if self.scheduling_policy == "priority":
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
            self.running.remove(victim)
        else:
            victim = self.running.pop()
        victim.status = RequestStatus.PREEMPTED
        self.waiting.prepend(victim)
        return victim

    def take_out(self, request: Request) -> None:
        """Remove a request from whatever state it is in, before it finishes (``retire``)."""
        req_id = request.req_id
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            del self.loading[req_id]
        elif request.status == RequestStatus.WAITING_FOR_GRAMMAR:
            del self.compiling[req_id]
        elif req_id in self.loaded:
            del self.loaded[req_id]
        else:
            self.waiting.remove([request])

    def retire(self, request: Request, *, held: bool) -> None:
        """A finished request (its status set) leaves the table, or waits in ``held`` while
        the connector holds its blocks. One still in ``running`` leaves it at
        ``drop_finished_running``."""
        del self.requests[request.req_id]
        if held:
            self.held[request.req_id] = request

    def drop_finished_running(self) -> None:
        self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]

    def release_held(self, req_id: str) -> Request | None:
        return self.held.pop(req_id, None)

    def _pop_head(self, request: Request) -> None:
        head = self.waiting.pop()
        if head is not request:
            raise RuntimeError(f"{request.req_id} left the queue but {head.req_id} was first")

    # ------------------------------------------------------------------ reading

    @property
    def num_waiting(self) -> int:
        """Requests not running: queued, compiling, loading or loaded."""
        return len(self.waiting) + len(self.compiling) + len(self.loading) + len(self.loaded)

    @property
    def num_seated(self) -> int:
        """Requests that hold a place among ``max_num_seqs``: running, and those whose KV
        is loading or loaded (they run once it has come)."""
        return len(self.running) + len(self.loading) + len(self.loaded)

    def waiting_by_reason(self) -> dict[str, int]:
        """vLLM counts requests waiting for their KV (or grammar) as deferred; loaded ones
        wait for a place."""
        deferred = len(self.loading) + len(self.compiling)
        by_reason = {"capacity": len(self.loaded), "deferred": deferred}
        for request in self.waiting:
            by_reason[request.waiting_reason] += 1
        return by_reason

    def problems(self, max_num_seqs: int) -> list[str]:
        """What is wrong with the collections (empty when they agree with ``requests``)."""
        problems: list[str] = []
        ids = [r.req_id for r in (*self.running, *self.waiting)]
        ids += [*self.compiling, *self.loading, *self.loaded]
        if sorted(ids) != sorted(self.requests):
            problems.append("running + waiting + compiling + loading + loaded != all requests")
        if len(self.running) > max_num_seqs:
            problems.append(f"{len(self.running)} running > max_num_seqs")
        expected = {
            RequestStatus.WAITING_FOR_GRAMMAR: self.compiling.values(),
            RequestStatus.WAITING_FOR_REMOTE_KVS: self.loading.values(),
            RequestStatus.WAITING: self.loaded.values(),
            RequestStatus.RUNNING: self.running,
        }
        for status, requests in expected.items():
            problems += [f"{r}: not {status.name}" for r in requests if r.status != status]
        for r in self.waiting:
            if r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                problems.append(f"{r}: bad waiting state")
            if r.num_computed_tokens != 0:
                problems.append(f"{r}: waiting with computed tokens")
        return problems
