"""The launcher of one machine's server: starts every child process in order, supervises
them, restarts the engine group or shuts everything down.

Start-up order follows what each process needs: the worker (it measures the
KV capacity) together with the detokenizer and tokenizers (they need nothing
from it, and their start-up hides behind the model load), then the scheduler
(which sizes its block pool from the worker's READY), and last the api_server,
so that the port opens only when the engine behind it can serve. Each child
reports READY on the control socket.

Supervision: if any child dies (or is stopped by a signal), the api_server is
told (every in-flight request ends with an error, ``/health`` turns 503), the
rest are stopped and the launcher exits non-zero. With ``--restart-on-failure``
a dead engine process (anything but the api_server) instead restarts the engine
group: every child but the api_server is stopped and started again, while the
api_server keeps its port and answers 503 (``/health``: ``restarting``); once all
are READY it serves again (and with ``--retry-waiting-on-restart`` sends the
requests that were still waiting to the new engine). Restarts are limited as
systemd limits a unit's: at most ``--max-restarts`` within ``--restart-window``
seconds, a restart that fails to start counting as one, the k-th of them after
``--restart-backoff`` x 2^(k-1) seconds (at most 60); one failure more stops the
server (exit 1).

SIGTERM (or Ctrl-C) drains: the api_server stops accepting (503, ``/health``
too), lets in-flight requests finish for up to ``--shutdown-timeout`` seconds,
aborts the rest; then the launcher stops the others (``STOP_SIGNAL``) and
everything exits 0. The same holds for a SIGTERM to the whole process group
(``timeout``, systemd): the children leave it to the launcher (``launch/child.py``).
"""

from __future__ import annotations

import signal
import time
from collections import Counter, deque
from collections.abc import Callable

import msgspec

from launch.child import CONTROL_ENV
from launch.engine_nodes import EngineNodes
from launch.process import Child, ProcessGroup
from launch.workers import (
    missing_ranks,
    resolve_master_port,
    start_worker_ranks,
)
from services.config import (
    KVEventPublisherInfo,
    ServeConfig,
)
from services.config.serve import load_chat_template as load_chat_template
from services.ipc import IpcDir, PullSocket, PushSocket
from services.logging_utils import init_logger
from services.metrics.registry import (
    forget_process_gauges,
)
from services.protocol import ApiServerInput, EngineDead, EngineRestarted, Ready

logger = init_logger(__name__)

_POLL_MS = 200
_MAX_BACKOFF_S = 60.0  # the longest wait before a restart (--restart-backoff doubles)


class StartupError(RuntimeError):
    """A child died or never reported READY during start-up."""


class Launcher:
    """Owns the children and the control socket of one server."""

    def __init__(self, config: ServeConfig, ipc: IpcDir) -> None:
        self.config = config
        self.group = ProcessGroup()
        self.control = PullSocket[Ready](config.endpoints.control, Ready, bind=True)
        self._env = {CONTROL_ENV: config.endpoints.control}
        self._stop_requested = False
        self._ready: list[Ready] = []  # READYs received, not yet waited for
        self.nodes: EngineNodes | None = None  # node 0's engine nodes, if any
        self.tick: Callable[[], None] | None = None  # called while waiting (an engine node's)
        self._api_socket: PushSocket[ApiServerInput] | None = None  # to the api_server
        # --restart-on-failure picks a new rendezvous port only if one was chosen at start
        self.master_port_chosen = False
        self._restarts: deque[float] = deque()  # when each recent restart began

    def _start(self, role: str, *extra: str, name: str | None = None) -> Child:
        return self.group.start(
            name or role,
            "launch.child",
            msgspec.json.encode(self.config),
            self._env,
            args=(role, *extra),
        )

    def _wait_ready(self, expected: Counter[str], timeout_s: float) -> list[Ready]:
        """Wait for READY from the ``expected`` roles; other roles' READYs wait for a later call."""
        got: list[Ready] = []
        deadline = time.monotonic() + timeout_s
        while True:
            for msg in [m for m in self._ready if expected[m.role] > 0]:
                self._ready.remove(msg)
                expected[msg.role] -= 1
                got.append(msg)
            if not sum(expected.values()):
                return got
            # A stop request first: Ctrl-C also reaches children still starting
            # (same process group), and their exit is then not a start-up failure.
            if self._stop_requested:
                raise KeyboardInterrupt
            if (stopped := self.group.first_stopped()) is not None:
                raise StartupError(f"the {stopped.name} process was stopped during start-up")
            dead = self.group.first_dead()
            if dead is not None:
                not_ready = ""
                if expected["worker"]:
                    workers = [r for r in got if r.role == "worker"]
                    names = missing_ranks(workers, self.config.engine.parallel)
                    others = [n for n in names if n != dead.name]
                    if others:
                        not_ready = f"; not ready: {', '.join(others)}"
                raise StartupError(
                    f"the {dead.name} process exited with code {dead.popen.returncode} "
                    f"during start-up (its error is above){not_ready}"
                )
            if self.nodes is not None:
                self._ready += self.nodes.poll()
                if (failure := self.nodes.failure()) is not None:
                    raise StartupError(f"{failure} during start-up")
            if self.tick is not None:
                self.tick()
            if time.monotonic() > deadline:
                what = ", ".join(f"{n} {role}" for role, n in (+expected).items())
                if expected["engine address"] and self.nodes is not None:
                    what = f"the engine nodes of {self.nodes.describe()}"
                if expected["worker"]:
                    workers = [r for r in got if r.role == "worker"]
                    what = ", ".join(missing_ranks(workers, self.config.engine.parallel))
                raise StartupError(f"timed out waiting for {what} to start")
            ready = self.control.recv(timeout_ms=_POLL_MS)
            if ready is not None:
                self._ready.append(ready)

    def start(self) -> None:
        """Node 0: every process of the server (and the engine nodes' engine cores)."""
        if self.config.engine.parallel.engines_span_nodes:
            self.nodes = EngineNodes(self.config)
        self._start_engine_group()
        self._start("api_server")
        self._wait_ready(Counter(api_server=1), 120)
        ep = self.config.endpoints
        if ep.kv_events == "auto":  # a restarted engine core binds the same ports again
            ep.kv_events_bound = {
                p.data_parallel_rank: (p.endpoint, p.replay_endpoint)
                for p in self.config.kv_event_publishers
            }

    def _start_engine_group(self) -> None:
        """Every process but the api_server: worker ranks, detokenizer, tokenizers, schedulers."""
        parallel = self.config.engine.parallel
        for d in parallel.local_engines:
            start_worker_ranks(self.group, self.config, self._env, d)
        if parallel.engines_on_ray:  # the engine cores as Ray actors (engine nodes)
            from launch.ray_ranks import RayRanks

            self.group.ray_ranks = self.group.ray_ranks or RayRanks()
            self.group.ray_ranks.start_engine_cores(self.group, self.config)
        if self.nodes is not None:
            # The front end connects to every engine core: it needs their addresses first.
            logger.info("waiting for %s on other machines", self.nodes.describe())
            self._wait_ready(Counter({"engine address": len(self.nodes.remote)}), 900)
        self._start("detokenizer")
        for _ in range(self.config.tokenizer_workers):
            self._start("tokenizer")
        self._start_schedulers()
        remote = len(self.nodes.remote) if self.nodes is not None else 0
        expected = {"detokenizer": 1, "tokenizer": self.config.tokenizer_workers}
        self._wait_ready(Counter({**expected, "remote engine": remote}), 900)

    def start_engines(self) -> None:
        """An engine node: the worker ranks and schedulers of its engine cores only."""
        for d in self.config.engine.parallel.local_engines:
            start_worker_ranks(self.group, self.config, self._env, d)
        self._start_schedulers()

    def _start_schedulers(self) -> None:
        parallel = self.config.engine.parallel
        local = parallel.local_engines
        dp = parallel.data_parallel_size
        workers = self._wait_ready(Counter(worker=parallel.world_size * len(local)), 900)
        for d in local:
            # Every rank holds its shard of every block: the smallest rank sets the pool.
            self.config.num_blocks = min(w.num_blocks for w in workers if w.engine == d)
            self.config.kv_block_bytes = sum(w.kv_block_bytes for w in workers if w.engine == d)
            self._start(
                "scheduler", "0", str(d), name="scheduler" if dp == 1 else f"engine {d} scheduler"
            )
        schedulers = self._wait_ready(Counter(scheduler=len(local)), 300)
        ep = self.config.endpoints
        self.config.kv_event_publishers = [
            KVEventPublisherInfo(r.kv_events, r.kv_events_replay, ep.kv_events_topic, r.engine)
            for r in sorted(schedulers, key=lambda r: r.engine)
            if r.kv_events
        ]

    def supervise(self) -> int:
        """Block until a child dies (exit 1, or a restart with ``--restart-on-failure``) or
        a drain completes (exit 0)."""
        api = next(c for c in self.group.children if c.name == "api_server")
        while True:
            if self._stop_requested:
                return self._drain(api)
            failed, reason = self._failure()
            if reason is not None:
                if not self.config.restart_on_failure or failed is api:
                    return self._on_death(reason, api)
                if (code := self._restart(reason, api)) is not None:
                    return code
            time.sleep(_POLL_MS / 1000)

    def _failure(self) -> tuple[Child | None, str | None]:
        """The child that died or was stopped and why; an engine node's failure (no child)."""
        dead = self.group.first_dead()
        if dead is not None:
            return dead, f"the {dead.name} process died (exit code {dead.popen.returncode})"
        stopped = self.group.first_stopped()
        if stopped is not None:
            return stopped, f"the {stopped.name} process was stopped (pid {stopped.popen.pid})"
        if self.nodes is not None:
            self.nodes.poll()  # statuses: liveness and metrics
            return None, self.nodes.failure()
        return None, None

    def _restart(self, reason: str, api: Child) -> int | None:
        """``--restart-on-failure``: stop every child but the api_server (503s meanwhile),
        start them again after the backoff, tell the api_server; a restart that does not
        start is retried the same way. None once serving again; the exit code when the
        restarts are spent (1), the api_server died, or a stop was asked for meanwhile."""
        began = time.monotonic()
        logger.error("%s; restarting the engine (--restart-on-failure)", reason)
        self._tell_api(EngineDead(f"The engine stopped: {reason}.", restarting=True))
        self._stop_engine(api)
        stopped_s = time.monotonic() - began
        parallel = self.config.engine.parallel
        while True:
            if (delay := self._next_restart()) is None:
                n, window = self.config.max_restarts, self.config.restart_window
                return self._on_death(
                    f"{reason}; not restarting the engine again: {n} restart(s) within "
                    f"{window:g} s already (--max-restarts {n}, --restart-window {window:g})",
                    api,
                )
            attempt = len(self._restarts)
            logger.warning(
                "restart %d of at most %d within %g s: starting the engine in %.1f s",
                attempt,
                self.config.max_restarts,
                self.config.restart_window,
                delay,
            )
            try:
                self._sleep_or_stop(delay, api)
                logger.info("restart %d: starting the engine processes", attempt)
                if self.master_port_chosen:  # the old rendezvous port may be in TIME_WAIT
                    parallel.master_port = None
                    resolve_master_port(parallel)
                self._start_engine_group()
                break
            except KeyboardInterrupt:  # SIGTERM while restarting: nothing left to finish
                self._tell_api(EngineDead("The server is shutting down."))
                return self._drain(api)
            except Exception as e:  # a process that died starting, no free port, no fork...
                if api.popen.poll() is not None:
                    reason = f"the api_server process died (exit code {api.popen.returncode})"
                    return self._on_death(reason, api)
                reason = f"restart {attempt} failed: {e}"
                logger.error("%s", reason)
                self._stop_engine(api)
        recovery_s = time.monotonic() - began
        logger.warning(
            "the engine restarted in %.1f s (old processes stopped in %.1f s); serving again",
            recovery_s,
            stopped_s,
        )
        self._tell_api(EngineRestarted(recovery_s))
        return None

    def _next_restart(self) -> float | None:
        """Count a restart: the seconds to wait before it (``--restart-backoff`` x 2^(k-1)
        for the k-th within ``--restart-window``), or None when ``--max-restarts`` are
        spent."""
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > self.config.restart_window:
            self._restarts.popleft()
        if len(self._restarts) >= self.config.max_restarts:
            return None
        self._restarts.append(now)
        doublings = min(len(self._restarts) - 1, 30)
        return min(self.config.restart_backoff * 2.0**doublings, _MAX_BACKOFF_S)

    def _sleep_or_stop(self, delay_s: float, api: Child) -> None:
        """Wait ``delay_s``; KeyboardInterrupt on a stop request, StartupError if the
        api_server dies meanwhile."""
        deadline = time.monotonic() + delay_s
        while True:
            if self._stop_requested:
                raise KeyboardInterrupt
            if api.popen.poll() is not None:
                raise StartupError("the api_server process died")
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, _POLL_MS / 1000))

    def _stop_engine(self, api: Child) -> None:
        """Stop every child but the api_server and forget them, with any READY they sent."""
        engine = [c for c in self.group.children if c is not api]
        self.group.stop(engine)
        if self.group.ray_ranks is not None:  # its ranks' bundles, for the next placement
            self.group.ray_ranks.close()
        self.group.children = [c for c in self.group.children if c not in engine]
        for child in engine:
            forget_process_gauges(child.popen.pid)
        self._ready.clear()
        while self.control.recv_nowait() is not None:
            pass  # a READY of a process just stopped: it must not count for the next one

    def _tell_api(self, msg: ApiServerInput) -> None:
        if self._api_socket is None:
            self._api_socket = PushSocket[ApiServerInput](
                self.config.endpoints.api_outputs, ApiServerInput
            )
        self._api_socket.send(msg)

    def _drain(self, api: Child) -> int:
        logger.info(
            "shutting down: draining in-flight requests (up to %.0f s)",
            self.config.shutdown_timeout,
        )
        api.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.shutdown_timeout + 10
        while api.popen.poll() is None and time.monotonic() < deadline:
            dead = self.group.first_dead()
            if dead is not None and dead is not api:
                reason = f"the {dead.name} process died (exit code {dead.popen.returncode})"
                return self._on_death(reason, api)
            time.sleep(0.05)
        api.expected_exit = True
        self.group.stop_all()
        # A clean drain means every child exited 0 (none crashed nor needed SIGKILL).
        unclean = [
            f"{c.name} ({c.popen.returncode})"
            for c in self.group.children
            if c.popen.returncode != 0
        ]
        if unclean:
            logger.error("processes that did not exit cleanly: %s", ", ".join(unclean))
            return 1
        return 0

    def _on_death(self, reason: str, api: Child) -> int:
        """A child, or an engine node, died: fail every request, stop everything."""
        logger.error("%s; shutting the server down", reason)
        if api.popen.poll() is None:
            self._tell_api(EngineDead(f"The engine stopped: {reason}."))
            self.close_api_socket()
            time.sleep(1.0)  # let in-flight requests receive their error
        self.group.stop_all()
        return 1

    def close_api_socket(self) -> None:
        if self._api_socket is not None:
            # Our sockets close with linger 0, which would drop a message if the
            # connection is not up yet: wait for it to leave instead.
            self._api_socket.socket.close(linger=2000)
            self._api_socket = None

    def request_stop(self, *_: object) -> None:
        self._stop_requested = True

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested
