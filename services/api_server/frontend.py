"""The api_server's side of the engine: its sockets and one asyncio queue per live request.

Requests go to the tokenizer processes; aborts go to the scheduler; text
deltas (from the detokenizer) and errors and tokenize results (from the
tokenizers) all come back on one PULL socket, routed here by request id.

When the engine dies the launcher says so on the same socket (``EngineDead``): every live
request ends with a 503. With ``--restart-on-failure`` a new engine follows
(``EngineRestarted``); with ``--retry-waiting-on-restart`` a request group that had no
output yet is kept meanwhile and sent again to the new engine, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec

from services.ipc import AsyncPullSocket, AsyncPushSocket
from services.protocol import (
    Abort,
    ApiServerInput,
    DetokenizeRequest,
    DetokenizeResult,
    EngineCoreInput,
    EngineDead,
    EngineRestarted,
    GenerateBatch,
    GenerateRequest,
    RequestError,
    TextDelta,
    TextDeltaBatch,
    TokenizeRequest,
    TokenizeResult,
    TokenizerInput,
)

logger = logging.getLogger(__name__)


class EngineRequestError(Exception):
    """The engine rejected or failed a request; carries the HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, error_type: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.param = status, message, error_type, param

    @classmethod
    def from_msg(cls, e: RequestError) -> EngineRequestError:
        return cls(e.status, e.message, e.error_type, e.param)


@dataclass(frozen=True)
class FrontendEndpoints:
    tokenizer_requests: str  # bound here: PUSH -> tokenizers (TokenizerInput)
    outputs: str  # bound here: PULL <- tokenizers, detokenizer (ApiServerInput)
    engine_cores: tuple[str, ...]  # each scheduler's PULL (Abort, to all of them)


class _Marker:
    """What ``fail_all`` and ``restarted`` put in a kept group's queue."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


_KEPT = _Marker("KEPT")  # the engine died; the group waits for the next one
_RESEND = _Marker("RESEND")  # the next engine is up: send the group again

_Item = TextDelta | RequestError | TokenizeResult | DetokenizeResult | _Marker


@dataclass
class _Live:
    queue: asyncio.Queue[tuple[int, _Item]]
    index: int
    waiting: bool = True  # no output yet: counts against max_num_queued_reqs
    generates: bool = True  # an engine request (not a tokenize or detokenize call)
    kept: bool = False  # waiting for the restarted engine (--retry-waiting-on-restart)


class EngineFrontend:
    """Owns the api_server's sockets; ``generate`` streams one request group's deltas.

    Contract: call ``start()`` inside the server's event loop before use.
    ``generate`` yields ``(index, TextDelta)`` for the n sub-requests of a
    group until each has a delta with ``finish_reason``; an engine error raises
    ``EngineRequestError``; leaving early (client gone, error) aborts the
    unfinished sub-requests. ``draining`` is set on SIGTERM; ``errored`` by
    ``fail_all`` (an ``EngineDead`` message from the launcher), cleared by ``restarted``
    (``EngineRestarted``); the HTTP layer turns ``unavailable`` into 503s.
    """

    def __init__(
        self,
        endpoints: FrontendEndpoints,
        *,
        max_model_len: int,
        retry_waiting_on_restart: bool = False,
    ) -> None:
        self.endpoints = endpoints
        self.max_model_len = max_model_len
        self.retry_waiting_on_restart = retry_waiting_on_restart
        self.draining = False
        self.restarting = False  # the engine died and a new one is starting
        self._dead_message = "The engine is not running."
        # Called with the recovery time of each restart (the app's metrics).
        self.on_restarted: Callable[[float], object] | None = None
        self._live: dict[str, _Live] = {}
        self._num_waiting = 0
        self._num_generating = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._recv_task: asyncio.Task[None] | None = None
        self._dead = asyncio.Event()  # ``errored``; also wakes sends waiting for a tokenizer

    @property
    def errored(self) -> bool:
        """The engine died (``EngineDead``): every request gets a 503."""
        return self._dead.is_set()

    @errored.setter
    def errored(self, value: bool) -> None:
        if value:
            self._dead.set()
        else:
            self._dead.clear()

    @property
    def unavailable(self) -> str | None:
        """Why new requests get a 503 now, or None while the engine serves."""
        if self.restarting:
            return "The engine is restarting after a failure; retry shortly."
        if self.errored:
            return "The engine is not running."
        if self.draining:
            return "The server is shutting down."
        return None

    @property
    def status(self) -> str:
        """``unavailable`` in one word, for ``/health``: ``restarting``, ``dead`` (the engine
        stopped, the server with it), ``draining`` (SIGTERM: live requests finish, new ones
        are refused), or ``ok``."""
        if self.restarting:
            return "restarting"
        if self.errored:
            return "dead"
        return "draining" if self.draining else "ok"

    @property
    def num_waiting(self) -> int:
        """Requests sent that have produced no output yet (queued or prefilling)."""
        return self._num_waiting

    @property
    def num_live(self) -> int:
        """Everything awaiting the engine: requests and tokenize/detokenize calls."""
        return len(self._live)

    @property
    def num_in_flight(self) -> int:
        """Engine requests sent and not finished (waiting or running; tokenize calls not)."""
        return self._num_generating

    def live_request_ids(self) -> list[str]:
        return list(self._live)

    async def start(self) -> None:
        e = self.endpoints
        self._requests = AsyncPushSocket[TokenizerInput](
            e.tokenizer_requests, TokenizerInput, bind=True
        )
        self._outputs = AsyncPullSocket[ApiServerInput](e.outputs, ApiServerInput, bind=True)
        self._engines = [
            AsyncPushSocket[EngineCoreInput](a, EngineCoreInput) for a in e.engine_cores
        ]
        self._recv_task = asyncio.create_task(self._recv_loop())

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._recv_task
            self._requests.close()
            self._outputs.close()
            for engine in self._engines:
                engine.close()

    def fail_all(self, message: str, *, restarting: bool = False) -> None:
        """The engine died: mark it so and end every live request with a 503. If a new engine
        is coming and ``retry_waiting_on_restart``, keep the groups that had no output yet."""
        self.errored = True
        self.restarting = restarting
        self._dead_message = message
        groups: dict[int, list[tuple[str, _Live]]] = {}
        for req_id, live in self._live.items():
            groups.setdefault(id(live.queue), []).append((req_id, live))
        for members in groups.values():
            lives = [live for _, live in members]
            if (
                restarting
                and self.retry_waiting_on_restart
                and all(live.generates and live.waiting for live in lives)
            ):
                for live in lives:
                    live.kept = True
                lives[0].queue.put_nowait((lives[0].index, _KEPT))
                continue
            for req_id, live in members:
                live.kept = False
                live.queue.put_nowait(
                    (live.index, RequestError(req_id, 503, message, "ServiceUnavailableError"))
                )

    def restarted(self, recovery_s: float) -> None:
        """The new engine is up: serve again and send the kept groups to it."""
        self.errored = False
        self.restarting = False
        queues = {id(live.queue): live for live in self._live.values() if live.kept}
        for live in self._live.values():
            live.kept = False
        for live in queues.values():
            live.queue.put_nowait((live.index, _RESEND))
        logger.warning(
            "the engine is back after %.1f s; %d waiting request group(s) sent again",
            recovery_s,
            len(queues),
        )
        if self.on_restarted is not None:
            self.on_restarted(recovery_s)

    async def _recv_loop(self) -> None:
        while True:
            try:
                msg = await self._outputs.recv()
            except (msgspec.DecodeError, msgspec.ValidationError):
                logger.exception("dropping an undecodable message from the engine")
                continue
            try:
                if isinstance(msg, TextDeltaBatch):
                    for delta in msg.items:
                        self._deliver(delta.req_id, delta)
                elif isinstance(msg, EngineDead):
                    self.fail_all(msg.reason, restarting=msg.restarting)
                elif isinstance(msg, EngineRestarted):
                    self.restarted(msg.recovery_s)
                else:
                    self._deliver(msg.req_id, msg)
            except Exception:  # this loop serves every request: it must outlive any one message
                logger.exception("failed to route a message from the engine")

    def _deliver(self, req_id: str, item: _Item) -> None:
        live = self._live.get(req_id)
        if live is None:
            return  # aborted or finished already: late output is dropped
        if live.kept:
            return  # the dead engine's last words: the request runs again on the next one
        if live.waiting and live.generates:
            live.waiting = False
            self._num_waiting -= 1
        live.queue.put_nowait((live.index, item))

    def _register(
        self,
        req_id: str,
        queue: asyncio.Queue,  # type: ignore[type-arg]
        index: int,
        generates: bool = True,
    ) -> None:
        if self.errored:
            # Admitted just before EngineDead arrived: fail_all could not see it,
            # and no output will ever come for it.
            raise EngineRequestError(
                503, self.unavailable or self._dead_message, "ServiceUnavailableError"
            )
        if req_id in self._live:
            raise EngineRequestError(
                400, f"request id {req_id!r} is already in use", "BadRequestError"
            )
        self._live[req_id] = _Live(queue, index, waiting=generates, generates=generates)
        self._num_waiting += generates
        self._num_generating += generates

    def _release(self, req_id: str) -> None:
        live = self._live.pop(req_id, None)
        if live is not None and live.generates:
            self._num_waiting -= live.waiting
            self._num_generating -= 1

    async def generate(
        self,
        reqs: list[GenerateRequest],
        *,
        max_waiting: int | None = None,
        on_sent: Callable[[int], object] | None = None,
    ) -> AsyncIterator[tuple[int, TextDelta]]:
        """Send a request group and stream its deltas; a 429 if ``max_waiting`` requests or
        more already wait for their first output (checked and counted in one step).
        ``on_sent(len(reqs))`` runs once the group is on its way to a tokenizer."""
        queue: asyncio.Queue = asyncio.Queue()  # type: ignore[type-arg]
        if max_waiting is not None and self._num_waiting >= max_waiting:
            raise EngineRequestError(
                429,
                f"Too many queued requests (limit {max_waiting}); retry later.",
                "RateLimitError",
            )
        registered: list[str] = []
        sent = False
        finished: set[str] = set()
        yielded = kept = False

        async def send() -> None:
            nonlocal sent
            try:
                await self._send(GenerateBatch(reqs))  # one tokenizer checks the group whole
            except EngineRequestError:
                if not self._live[registered[0]].kept:
                    raise
                return  # the engine died before a tokenizer took it: it goes to the next one
            if not sent and on_sent is not None:
                on_sent(len(reqs))
            sent = True

        try:
            for i, req in enumerate(reqs):
                self._register(req.req_id, queue, i)
                registered.append(req.req_id)
            await send()
            while len(finished) < len(reqs):
                index, item = await queue.get()
                if item is _KEPT:
                    if yielded or kept:  # started already, or kept once: no second try
                        raise EngineRequestError(503, self._dead_message, "ServiceUnavailableError")
                    kept = True
                    continue  # until _RESEND, or an error if the restart fails
                if item is _RESEND:
                    if yielded:  # cannot happen: output of a kept group is dropped
                        raise EngineRequestError(503, self._dead_message, "ServiceUnavailableError")
                    await send()
                    continue
                if isinstance(item, RequestError):
                    raise EngineRequestError.from_msg(item)
                assert isinstance(item, TextDelta)
                if item.finish_reason is not None:
                    finished.add(item.req_id)
                    self._release(item.req_id)
                yielded = True
                yield index, item
        finally:
            for req_id in registered:
                self._release(req_id)
            if sent and (unfinished := [r for r in registered if r not in finished]):
                # May run inside a cancelled scope (client gone): send from a new task.
                task = asyncio.get_running_loop().create_task(self.abort(unfinished))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _send(self, msg: TokenizerInput) -> None:
        """Hand a message to the tokenizers. A send waits while no tokenizer is connected
        (start-up, or all of them dead): a 503 if the engine dies meanwhile."""
        sending = self._requests.send_nowait(msg)
        if not sending.done():
            dead = asyncio.ensure_future(self._dead.wait())
            try:
                await asyncio.wait((sending, dead), return_when=asyncio.FIRST_COMPLETED)
            finally:
                dead.cancel()
                if not sending.done():
                    sending.cancel()  # a queued send that is cancelled is never sent
        if sending.cancelled():
            raise EngineRequestError(
                503, self.unavailable or "The engine is not running.", "ServiceUnavailableError"
            )
        sending.result()

    async def abort(self, req_ids: list[str]) -> None:
        """Tell the scheduler to stop these requests (their clients get a final delta).
        With data parallelism every engine core is told: the one holding a request stops
        it, the others remember the ids briefly in case the request is still on its way."""
        for engine in self._engines:
            await engine.send(Abort(req_ids))

    async def _call(
        self, req: TokenizeRequest | DetokenizeRequest
    ) -> TokenizeResult | DetokenizeResult:
        queue: asyncio.Queue = asyncio.Queue()  # type: ignore[type-arg]
        self._register(req.req_id, queue, 0, generates=False)
        try:
            await self._send(req)
            _, item = await queue.get()
        finally:
            self._release(req.req_id)
        if isinstance(item, RequestError):
            raise EngineRequestError.from_msg(item)
        return item  # type: ignore[no-any-return]

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResult:
        return await self._call(req)  # type: ignore[return-value]

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResult:
        return await self._call(req)  # type: ignore[return-value]
