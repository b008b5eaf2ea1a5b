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
from pathlib import Path
from typing import Any

from launch.child import CONTROL_ENV, USER_ERROR_EXIT
from launch.engine_nodes import EngineNode, HeadLost, head_endpoints
from launch.launcher import Launcher, StartupError
from launch.ports import check_server_ports
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
    EngineConfig,
    KVTransferConfig,
    ModelArchConfig,
    ParallelConfig,
    ServeConfig,
)
from services.config.checks import INT8_ACTIVATIONS
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


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    raise AssertionError


def _cpu_isa() -> str:
    """The instruction set the C++ CPU ops are built for (``-march=native``, less what
    ``$ACTORSERVE_CPU_FLAGS`` turns off)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        line = ""
    flags = set(line.partition(":")[2].split())
    extra = os.environ.get("ACTORSERVE_CPU_FLAGS", "")
    if "avx512f" in flags and "-mno-avx512f" not in extra:
        return "AVX-512" + (" VNNI" if "avx512_vnni" in flags else "")
    return "AVX2" if "avx2" in flags else "scalar"


def _tiers(kv: KVTransferConfig | None) -> str:
    """The KV connectors: the tiers under the KV cache and the KV moved between servers."""
    if kv is None:
        return "none"
    items: list[dict[str, Any]] = [
        {"kv_connector": kv.kv_connector, "kv_role": kv.kv_role, "kv_ip": kv.kv_ip,
         "kv_port": kv.kv_port, "kv_connector_extra_config": kv.kv_connector_extra_config}
    ]  # fmt: skip
    if kv.kv_connector == "multi":
        raw = kv.kv_connector_extra_config.get("connectors") or []
        items = [{"kv_role": kv.kv_role, **c} for c in raw if isinstance(c, dict)]
    out = []
    for item in items:
        name, extra = item.get("kv_connector"), item.get("kv_connector_extra_config") or {}
        if name == "offload" and isinstance(extra.get("kv_offload_bytes"), int | float):
            out.append(f"offload (host memory, {_size(extra['kv_offload_bytes'])})")
        elif name == "storage":
            out.append(f"storage (files in {extra.get('path')})")
        elif name == "p2p":
            where = f"{item.get('kv_ip', '127.0.0.1')}:{item.get('kv_port', 14579)}"
            out.append(f"p2p ({item.get('kv_role', 'kv_both')}, side channel {where})")
        else:
            out.append(str(name))
    return ", ".join(out)


def startup_summary(config: ServeConfig, hf: dict[str, Any]) -> list[str]:
    """What this server runs, once it is up, as vLLM's "Initializing a V1 LLM engine with
    config" line and its KV cache lines: one INFO block in the launcher's log. ``hf`` is
    the model folder's config.json."""
    e = config.engine
    m, c, s, w, p = e.model, e.cache, e.scheduler, e.worker, e.parallel
    arch = ModelArchConfig.from_hf_config(hf)
    sim = w.worker_backend == "sim"
    device = "sim" if sim else w.resolved_device()
    dtype = e.resolved_dtype(device)
    if dtype == "auto":  # the simulated model's own (the sim worker's rule)
        dtype = str(hf.get("torch_dtype", "bfloat16"))
    layers = f"{arch.num_hidden_layers} layers"
    if arch.is_moe:
        layers += f", {arch.num_experts} experts"
    model = m.model or "SmolLM2-135M-Instruct (the default)"
    if sim:
        model = f"{w.sim_model or model} (simulated; the tokenizer is {m.model or 'the default'}'s)"
    lines = [f"model: {model}, {arch.architecture}, {layers}, load format {m.load_format}"]
    names = ", ".join(config.served_model_names)
    why = ""
    if sim and w.sim_model is not None and config.served_model_names == [w.sim_model]:
        why = " (the --sim-model's name, not --model's; --served-model-name to choose)"
    lines.append(f"served model name: {names}{why}")
    from services.model_loader.gguf_record import gguf_source

    gguf = not sim and m.load_format != "dummy" and gguf_source(Path(config.model_folder))
    quant_kernels = gguf and m.quantization != "none" and device == "cpu"
    quant_kernels = quant_kernels and dtype in ("float32", "bfloat16")
    if sim:
        quantization = "none (simulated)"
    elif quant_kernels:
        quantization = "gguf (Q4_0/Q4_1/Q8_0 matrices kept quantized, read by the CPU kernels)"
        if m.cpu_activation_quant == "int8":
            quantization += ", int8 activations"
    elif gguf:
        quantization = f"none (the GGUF weights expanded to {dtype})"
    else:
        quantization = "none"
    lines.append(f"dtype: {dtype}, quantization: {quantization}, device: {device}")
    if sim:
        kernels = f"none run: each step sleeps for the {w.sim_hardware} roofline's time"
    else:
        attention = w.attention_backend or ("triton" if device == "cuda" else "torch")
        kernels = f"attention {attention}"
        if device == "cpu":
            cpu_ops = os.environ.get("ACTORSERVE_CPU_KERNELS", "1") != "0"
            kernels += f", C++ CPU ops ({_cpu_isa()})" if cpu_ops else ", torch ops only"
        graphs = device == "cuda" and attention == "triton" and p.world_size == 1
        if device == "cuda":
            on = graphs and not w.enforce_eager
            kernels += ", CUDA graphs " + ("on (decode-only steps)" if on else "off")
        if arch.is_moe:
            kernels += ", fused MoE experts"
    lines.append(f"kernels: {kernels}")
    layout = (
        f"TP {p.tensor_parallel_size} x PP {p.pipeline_parallel_size} x DP "
        f"{p.data_parallel_size}: {p.world_size} worker rank(s) per engine core"
    )
    if p.enable_expert_parallel:
        layout += f", EP {p.expert_parallel_size}"
    if p.nnodes > 1:
        layout += f", over {p.nnodes} nodes"
    if p.engines_on_ray:
        layout += ", every engine core a Ray actor (--data-parallel-backend ray)"
    elif p.ranks_on_ray:
        layout += ", the ranks Ray actors (--distributed-executor-backend ray)"
    elif p.engines_span_nodes and len(p.local_engines):
        layout += f", engine cores {p.local_engines.start}-{p.local_engines.stop - 1} here"
    elif p.engines_span_nodes:
        layout += ", every engine core on another machine"
    lines.append(f"parallel: {layout}")
    kv_dtype = c.kv_cache_dtype if c.kv_cache_dtype != "auto" else f"auto ({dtype})"
    tokens = max(config.num_blocks - 1, 0) * c.block_size  # the null block holds none
    size = _size(config.num_blocks * config.kv_block_bytes) if config.kv_block_bytes else ""
    if len(p.local_engines):
        lines.append(
            f"KV cache: {tokens:,} tokens per engine core ({config.num_blocks:,} blocks of "
            f"{c.block_size}{', ' + size if size else ''}), dtype {kv_dtype}"
        )
    else:  # measured by the engine nodes, each of which logs its own
        lines.append(f"KV cache: as each engine node measured it (its log), dtype {kv_dtype}")
    lines.append(f"KV tiers and transfer: {_tiers(e.kv_transfer)}")
    prefix = f"on ({c.prefix_caching_hash_algo})" if c.enable_prefix_caching else "off"
    lines.append(
        f"prefix caching: {prefix}, chunked prefill: "
        f"{'on' if s.enable_chunked_prefill else 'off'}, async scheduling: "
        f"{'on' if s.async_scheduling else 'off'}, policy {s.scheduling_policy}"
    )
    lines.append(
        f"limits: max_model_len {s.max_model_len:,}, max_num_seqs {s.max_num_seqs}, "
        f"max_num_batched_tokens {s.max_num_batched_tokens:,}"
    )
    return ["start-up summary:", *(f"  {line}" for line in lines)]


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
        node.down(str(e))
        if _user_error_reported(launcher):
            return USER_ERROR_EXIT
        print(f"error: {e}", file=sys.stderr)
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
        headless or parallel.nnodes > 1 or parallel.engines_span_nodes or parallel.engines_on_ray
    ):
        raise ConfigError(
            "--restart-on-failure restarts the engine processes of a one-machine server; "
            "it does not work with --nnodes > 1, --headless or engine cores on other machines "
            "(or Ray actors: --data-parallel-backend ray)"
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


def check_model_files(engine: EngineConfig, folder: Path) -> None:
    """What the workers would refuse once started, checked before they are: ``--device
    cuda`` with no GPU, and the weight flags that depend on what the model is (a GGUF file
    or not). After ``EngineConfig.finalize`` (the model runner's own checks, earlier)."""
    m = engine.model
    if engine.worker.worker_backend != "sim" and engine.worker.device == "cuda":
        from services.config.device import torch_sees_cuda  # torch stays out of the launcher

        if not torch_sees_cuda():
            raise ConfigError("--device cuda was asked for but torch sees no CUDA device")
    if engine.worker.worker_backend == "sim" or m.load_format == "dummy":
        return
    if m.quantization != "gguf" and m.cpu_activation_quant != "int8":
        return
    from services.model_loader.gguf_record import gguf_source

    if gguf_source(folder) is not None:
        return
    if m.quantization == "gguf":
        raise ConfigError(
            f"--quantization gguf needs a GGUF model; {folder} has no GGUF file it was "
            "converted from that still exists unchanged (source.json)"
        )
    raise ConfigError(f"{INT8_ACTIVATIONS}; {m.model or folder} is not a GGUF model")


def _user_error_reported(launcher: Launcher) -> bool:
    """A child ended start-up with a user error (``ConfigError``, ``ModelLoadError``),
    which it printed as its one ``error:`` line: that line is the whole report."""
    return any(
        c.popen.returncode == USER_ERROR_EXIT and not c.expected_exit
        for c in launcher.group.children
    )


def run_server(args: argparse.Namespace) -> int:
    config = ServeConfig.from_cli(args)
    engine = config.engine
    parallel = engine.parallel
    # Everything the flags alone decide, before anything loads or starts: one line, exit 2.
    _check_headless(parallel, config.headless)
    _check_restart(config, config.headless)
    endpoints = Endpoints()
    kv_events_settings(endpoints, config.kv_events_endpoint, config.kv_events_config)
    check_server_ports(config, endpoints)
    model = engine.model.model
    folder = prepare_engine_model(model, engine.model.load_format, engine.worker.sim_model)
    hf = load_hf_config(folder)
    engine.finalize(ModelArchConfig.from_hf_config(hf))
    check_model_files(engine, folder)
    if parallel.engines_on_ray and not config.headless:
        parallel.data_parallel_size_local = 0  # every engine core is a Ray actor's
    if parallel.ranks_on_ray or (parallel.engines_on_ray and not config.headless):
        from launch.ray_ranks import connect  # before the addresses and ports are chosen

        connect(parallel)
    master_port_chosen = resolve_master_port(parallel)
    if engine.worker.worker_backend == "sim" and engine.worker.sim_speed != 1.0:
        os.environ.update(clock.set_sim_speed(engine.worker.sim_speed))  # children inherit it
    ipc = IpcDir()
    for name in _SOCKETS:
        setattr(endpoints, name, ipc.endpoint(name))
    cross_node_endpoints(endpoints, parallel)
    config.endpoints = endpoints
    config.model_folder = str(folder)
    if not config.served_model_names:
        config.served_model_names = [served_name(model, engine.worker.sim_model)]
    if endpoints.kv_events is not None and not endpoints.kv_events_topic:
        # llm-d's convention: the topic names the replica and the model.
        endpoints.kv_events_topic = f"kv@{config.host}:{config.port}@{config.served_model_names[0]}"
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
        for line in startup_summary(config, hf):
            logger.info("%s", line)
        print(
            f"actorserve is serving {config.served_model_names[0]} on "
            f"http://{config.host}:{config.port}/v1 (Ctrl-C or SIGTERM to stop)",
            file=sys.stderr,
            flush=True,
        )
        return launcher.supervise()
    except StartupError as e:
        if _user_error_reported(launcher):
            return USER_ERROR_EXIT
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
