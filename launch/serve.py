"""``actorserve serve``: start every process of one server, supervise them, shut down cleanly.

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
api_server keeps its port and answers 503; once all are READY it serves again
(and with ``--retry-waiting-on-restart`` sends the requests that were still
waiting to the new engine). SIGTERM (or Ctrl-C) drains: the api_server stops
accepting (503), lets in-flight requests finish for up to
``--shutdown-timeout`` seconds, aborts the rest; then everything exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable

import msgspec

from launch.child import CONTROL_ENV
from launch.engine_nodes import EngineNode, EngineNodes, HeadLost, head_endpoints
from launch.process import Child, ProcessGroup
from launch.workers import (
    cross_node_endpoints,
    missing_ranks,
    resolve_master_port,
    start_worker_ranks,
)
from services import clock
from services.config import (
    ConfigError,
    Endpoints,
    KVEventPublisherInfo,
    ModelArchConfig,
    ParallelConfig,
    ServeConfig,
)
from services.config.kv_transfer import KVTransferConfig
from services.config.serve import load_chat_template as load_chat_template
from services.flags import parse_json_object
from services.ipc import IpcDir, PullSocket, PushSocket
from services.logging_utils import init_logger
from services.metrics.registry import (
    create_multiproc_dir,
    forget_process_gauges,
    remove_multiproc_dir,
)
from services.model_loader import load_hf_config, prepare_engine_model
from services.protocol import ApiServerInput, EngineDead, EngineRestarted, Ready

logger = init_logger(__name__)

_SOCKETS = (
    "tokenizer_requests",
    "api_outputs",
    "engine_core",
    "step_plans",
    "step_results",
    "detok_tokens",
    "detok_specs",
    "control",
    "engine_state",
)
_POLL_MS = 200


class StartupError(RuntimeError):
    """A child died or never reported READY during start-up."""


def served_name(model: str | None, sim_model: str | None = None) -> str:
    """vLLM serves the model under the --model string; the default model under its own name,
    a simulated one (``--sim-model``) under that name."""
    if sim_model is not None:
        return sim_model
    return model if model is not None else "SmolLM2-135M-Instruct"


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
        start them again, tell the api_server. None once serving again; the exit code if the
        new engine did not start or a stop was asked for meanwhile."""
        began = time.monotonic()
        logger.error("%s; restarting the engine (--restart-on-failure)", reason)
        self._tell_api(EngineDead(f"The engine stopped: {reason}.", restarting=True))
        engine = [c for c in self.group.children if c is not api]
        self.group.stop(engine)
        self.group.children = [c for c in self.group.children if c not in engine]
        for child in engine:
            forget_process_gauges(child.popen.pid)
        self._ready.clear()
        stopped_s = time.monotonic() - began
        parallel = self.config.engine.parallel
        try:
            if self._stop_requested:
                raise KeyboardInterrupt
            if self.master_port_chosen:  # the old rendezvous port may still be in TIME_WAIT
                parallel.master_port = None
                resolve_master_port(parallel)
            self._start_engine_group()
        except KeyboardInterrupt:  # SIGTERM while restarting: nothing left to finish
            self._tell_api(EngineDead("The server is shutting down."))
            return self._drain(api)
        except Exception as e:  # a process that died starting, no free port, no fork...
            return self._on_death(f"the engine did not restart: {e}", api)
        recovery_s = time.monotonic() - began
        logger.warning(
            "the engine restarted in %.1f s (old processes stopped in %.1f s); serving again",
            recovery_s,
            stopped_s,
        )
        self._tell_api(EngineRestarted(recovery_s))
        return None

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


def run_headless(config: ServeConfig) -> int:
    """``--headless`` on node R > 0: run this node's worker ranks, which join node 0's
    engine core, until one dies (exit 1) or SIGTERM (exit 0)."""
    parallel = config.engine.parallel
    group = ProcessGroup()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    start_worker_ranks(group, config, {CONTROL_ENV: config.endpoints.control})
    ranks = parallel.local_ranks
    print(
        f"actorserve node {parallel.node_rank}: worker ranks {ranks.start}-{ranks.stop - 1} "
        f"of {parallel.world_size}, joining {parallel.master_addr}:{parallel.master_port}",
        file=sys.stderr,
        flush=True,
    )
    try:
        while not stop:
            dead = group.first_dead()
            if dead is not None and dead.popen.returncode == 0:
                # A rank ends cleanly when its scheduler, on node 0, went away.
                logger.info("node 0 went away (%s exited); stopping this node", dead.name)
                return 0
            if dead is not None:
                logger.error(
                    "the %s process died (exit code %s); stopping this node",
                    dead.name,
                    dead.popen.returncode,
                )
                return 1
            time.sleep(_POLL_MS / 1000)
        return 0
    finally:
        group.stop_all()


def run_engine_node(config: ServeConfig, ipc: IpcDir) -> int:
    """``--headless`` with ``--data-parallel-size-local``: run this machine's engine cores
    for node 0 until one of their processes dies (exit 1), node 0 goes away or SIGTERM
    (exit 0)."""
    metrics_dir = create_multiproc_dir()  # its text goes to node 0's /metrics
    node = EngineNode(config)  # their addresses go into config before any child starts
    launcher = Launcher(config, ipc)
    launcher.tick = node.beat
    signal.signal(signal.SIGTERM, launcher.request_stop)
    signal.signal(signal.SIGINT, launcher.request_stop)
    parallel = config.engine.parallel
    first, last = node.engines[0], node.engines[-1]
    try:
        launcher.start_engines()
        node.ready = True
        print(
            f"actorserve engine node: engine cores {first}-{last} of "
            f"{parallel.data_parallel_size} serve for {parallel.data_parallel_address}:"
            f"{parallel.data_parallel_rpc_port}",
            file=sys.stderr,
            flush=True,
        )
        while not launcher.stop_requested:
            node.beat()
            dead = launcher.group.first_dead()
            if dead is not None:
                reason = f"the {dead.name} process died (exit code {dead.popen.returncode})"
                logger.error("%s; stopping this node", reason)
                node.down(reason)
                return 1
            time.sleep(_POLL_MS / 1000)
        return 0
    except StartupError as e:
        print(f"error: {e}", file=sys.stderr)
        node.down(str(e))
        return 1
    except HeadLost:
        logger.info("node 0 went away; stopping this node")
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        launcher.group.stop_all()
        launcher.control.close()
        node.close()
        ipc.cleanup()
        remove_multiproc_dir(metrics_dir)


def _check_headless(parallel: ParallelConfig, headless: bool) -> None:
    """Which part of a server this machine runs must match ``--headless``."""
    if parallel.nnodes > 1:
        if headless != (parallel.node_rank > 0):
            raise ConfigError(
                "node 0 runs the API server and the scheduler: give --headless exactly on "
                f"the other nodes (--node-rank > 0); this is node {parallel.node_rank}"
            )
    elif headless:
        if parallel.data_parallel_size_local is None or not parallel.local_engines:
            raise ConfigError(
                "--headless runs part of a server on another machine: worker ranks "
                "(--nnodes > 1 --node-rank R) or engine cores (--data-parallel-size-local "
                "N --data-parallel-start-rank S, N > 0)"
            )
    elif parallel.data_parallel_start_rank != 0:
        raise ConfigError(
            "the API server's node runs engine cores from 0: give --data-parallel-start-rank "
            "only with --headless"
        )


def _check_restart(config: ServeConfig, headless: bool) -> None:
    """``--restart-on-failure`` restarts the processes of one machine's server."""
    parallel = config.engine.parallel
    if config.retry_waiting_on_restart and not config.restart_on_failure:
        raise ConfigError("--retry-waiting-on-restart needs --restart-on-failure")
    if config.restart_on_failure and (
        headless or parallel.nnodes > 1 or parallel.engines_span_nodes
    ):
        raise ConfigError(
            "--restart-on-failure restarts the engine processes of a one-machine server; "
            "it does not work with --nnodes > 1, --headless or engine cores on other machines"
        )


def kv_events_settings(endpoints: Endpoints, endpoint: str | None, config_json: str | None) -> None:
    """``--kv-events-endpoint ENDPOINT|auto`` or vLLM's ``--kv-events-config JSON``
    (``enable_kv_cache_events``, ``publisher`` "zmq", ``endpoint``, ``replay_endpoint``,
    ``topic``, ``buffer_steps``). ``auto`` binds the PUB and the replay socket to free
    loopback ports, reported at ``GET /kv_events``."""
    if config_json:
        if endpoint is not None:
            raise ConfigError("give --kv-events-endpoint or --kv-events-config, not both")
        known = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "topic",
                 "buffer_steps", "hwm", "max_queue_size"}  # fmt: skip
        cfg = parse_json_object("--kv-events-config", config_json, known)
        if not cfg.get("enable_kv_cache_events", False) or cfg.get("publisher") == "null":
            return
        if cfg.get("publisher", "zmq") != "zmq":
            raise ConfigError("--kv-events-config: the only publisher is 'zmq'")
        endpoints.kv_events = str(cfg.get("endpoint") or "tcp://*:5557")
        endpoints.kv_events_replay = cfg.get("replay_endpoint")
        endpoints.kv_events_topic = str(cfg.get("topic") or "")
        endpoints.kv_events_buffer_steps = int(cfg.get("buffer_steps") or 10_000)
    elif endpoint is not None:
        endpoints.kv_events = endpoint
        endpoints.kv_events_replay = "auto" if endpoint == "auto" else None


def run_server(args: argparse.Namespace) -> int:
    config = ServeConfig.from_cli(args)
    engine = config.engine
    flags = vars(args)
    offload = flags.get("kv_offload_bytes")
    if (gib := flags.get("kv_offloading_size")) is not None:
        if offload is not None:
            raise ConfigError("give --kv-offload-bytes or --kv-offloading-size, not both")
        offload = int(gib * (1 << 30))
    engine.kv_transfer = KVTransferConfig.from_flags(flags.get("kv_transfer_config"), offload)
    model = engine.model.model
    folder = prepare_engine_model(model, engine.model.load_format, engine.worker.sim_model)
    engine.finalize(ModelArchConfig.from_hf_config(load_hf_config(folder)))
    master_port_chosen = resolve_master_port(engine.parallel)
    if engine.worker.worker_backend == "sim" and engine.worker.sim_speed != 1.0:
        os.environ.update(clock.set_sim_speed(engine.worker.sim_speed))  # children inherit it
    a = vars(args)
    ipc = IpcDir()
    endpoints = Endpoints()
    for name in _SOCKETS:
        setattr(endpoints, name, ipc.endpoint(name))
    kv_events_settings(endpoints, a.get("kv_events_endpoint"), a.get("kv_events_config"))
    cross_node_endpoints(endpoints, engine.parallel)
    config.endpoints = endpoints
    config.model_folder = str(folder)
    if not config.served_model_names:
        config.served_model_names = [served_name(model, engine.worker.sim_model)]
    if endpoints.kv_events is not None and not endpoints.kv_events_topic:
        # llm-d's convention: the topic names the replica and the model.
        endpoints.kv_events_topic = f"kv@{config.host}:{config.port}@{config.served_model_names[0]}"
    parallel = engine.parallel
    _check_headless(parallel, bool(a.get("headless")))
    _check_restart(config, bool(a.get("headless")))
    if parallel.node_rank > 0:
        try:
            return run_headless(config)
        finally:
            ipc.cleanup()
    if a.get("headless"):
        return run_engine_node(config, ipc)
    if parallel.engines_span_nodes:
        config.endpoints.detok_tokens = head_endpoints(parallel)[1]
    launcher = Launcher(config, ipc)
    launcher.master_port_chosen = master_port_chosen
    signal.signal(signal.SIGTERM, launcher.request_stop)
    signal.signal(signal.SIGINT, launcher.request_stop)
    metrics_dir = create_multiproc_dir()  # before any child starts: they inherit it
    try:
        launcher.start()
        print(
            f"actorserve is serving {config.served_model_names[0]} on "
            f"http://{config.host}:{config.port}/v1 (Ctrl-C or SIGTERM to stop)",
            file=sys.stderr,
            flush=True,
        )
        return launcher.supervise()
    except StartupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        launcher.group.stop_all()
        launcher.close_api_socket()
        launcher.control.close()
        if launcher.nodes is not None:
            launcher.nodes.close()
        ipc.cleanup()
        remove_multiproc_dir(metrics_dir)
