"""``actorserve serve``: one machine's part of a server, from its flags.

``run_server`` reads the configuration, prepares the model, names the sockets, and runs
what this machine's part is: the whole server (``launch/launcher.py:Launcher``: every
child process in order, supervised), worker ranks only (``--headless`` on node R > 0 of
``--nnodes``), or engine cores for node 0 (``--headless`` with
``--data-parallel-size-local``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from launch.child import CONTROL_ENV
from launch.engine_nodes import EngineNode, HeadLost, head_endpoints
from launch.launcher import Launcher, StartupError
from launch.process import ProcessGroup
from launch.workers import (
    cross_node_endpoints,
    resolve_master_port,
    start_worker_ranks,
)
from services import clock
from services.config import (
    ConfigError,
    Endpoints,
    ModelArchConfig,
    ParallelConfig,
    ServeConfig,
)
from services.config.serve import load_chat_template as load_chat_template
from services.flags import parse_json_object
from services.ipc import IpcDir
from services.logging_utils import init_logger
from services.metrics.registry import (
    create_multiproc_dir,
    remove_multiproc_dir,
)
from services.model_loader import load_hf_config, prepare_engine_model

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


def served_name(model: str | None, sim_model: str | None = None) -> str:
    """vLLM serves the model under the --model string; the default model under its own name,
    a simulated one (``--sim-model``) under that name."""
    if sim_model is not None:
        return sim_model
    return model if model is not None else "SmolLM2-135M-Instruct"


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
    model = engine.model.model
    folder = prepare_engine_model(model, engine.model.load_format, engine.worker.sim_model)
    engine.finalize(ModelArchConfig.from_hf_config(load_hf_config(folder)))
    master_port_chosen = resolve_master_port(engine.parallel)
    if engine.worker.worker_backend == "sim" and engine.worker.sim_speed != 1.0:
        os.environ.update(clock.set_sim_speed(engine.worker.sim_speed))  # children inherit it
    ipc = IpcDir()
    endpoints = Endpoints()
    for name in _SOCKETS:
        setattr(endpoints, name, ipc.endpoint(name))
    kv_events_settings(endpoints, config.kv_events_endpoint, config.kv_events_config)
    cross_node_endpoints(endpoints, engine.parallel)
    config.endpoints = endpoints
    config.model_folder = str(folder)
    if not config.served_model_names:
        config.served_model_names = [served_name(model, engine.worker.sim_model)]
    if endpoints.kv_events is not None and not endpoints.kv_events_topic:
        # llm-d's convention: the topic names the replica and the model.
        endpoints.kv_events_topic = f"kv@{config.host}:{config.port}@{config.served_model_names[0]}"
    parallel = engine.parallel
    _check_headless(parallel, config.headless)
    _check_restart(config, config.headless)
    if parallel.node_rank > 0:
        try:
            return run_headless(config)
        finally:
            ipc.cleanup()
    if config.headless:
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
