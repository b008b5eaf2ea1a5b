"""Start-up port checks: every TCP port a server binds from its flags, before the model loads.

vLLM binds its API port before it builds the engine, so a taken port is one line at once,
not a traceback after minutes of model loading. Here the ports are bound late, by the
processes that use them (the api_server binds ``--port`` last of all), so ``run_server``
checks each one first: in range (``services/config`` does that with the other flags) and
free now (``check_free`` binds it as its owner will, then lets it go). A port taken in the
seconds between the check and the real bind is still reported, later, by its owner.

``server_ports`` lists what this machine's part of a server binds from its flags:

- the API server's ``--host:--port``;
- the torch.distributed store at ``--master-addr:--master-port`` (+ d per data-parallel
  engine core), when given and more than one rank meets there; across ``--nnodes`` also the
  three ports after it (plans, results, control);
- ``--data-parallel-rpc-port`` and the port after it on ``--data-parallel-address``, when
  engine cores run on other machines;
- the KV event sockets of ``--kv-events-endpoint``/``--kv-events-config`` (tcp, port + d
  per engine core);
- the p2p side channel of a producer, ``kv_ip:kv_port + rank`` (``--kv-transfer-config``).
"""

from __future__ import annotations

import contextlib
import errno
import socket
from dataclasses import dataclass

from services.config import ConfigError, Endpoints, KVTransferConfig, ServeConfig


@dataclass(frozen=True)
class Port:
    """One TCP port to bind: the flag that names it, the host and the port."""

    flag: str
    host: str
    port: int


def tcp_endpoint(endpoint: str | None) -> tuple[str, int] | None:
    """``tcp://HOST:PORT`` (ZeroMQ's form; ``*`` is every interface) as (host, port); None
    for anything else (ipc, ``auto``, a wildcard port, an interface name is kept as given)."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not port.isdigit() or not host:
        return None
    host = host.strip("[]")
    return ("0.0.0.0" if host == "*" else host), int(port)


def check_free(port: Port) -> None:
    """ConfigError (one line) unless ``port`` can be bound now, as uvicorn and ZeroMQ bind
    it: every address its host resolves to, with SO_REUSEADDR (a port in TIME_WAIT is free)."""
    where = f"{port.host}:{port.port}"
    if not 1 <= port.port <= 65535:
        raise ConfigError(f"{port.flag}: {port.port} is not a port number (1-65535)")
    try:
        infos = socket.getaddrinfo(
            port.host or None, port.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"{port.flag}: cannot resolve {port.host!r} ({e})") from None
    with contextlib.ExitStack() as stack:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = stack.enter_context(socket.socket(family, kind, proto))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                raise ConfigError(f"{port.flag}: cannot bind {where}: {_why(e)}") from None


def check_port(host: str, port: int, flag: str = "--port") -> None:
    """ConfigError (one line) unless ``host:port`` is a port number and free now: for a
    process that binds ``--host``/``--port`` itself (the router, the PD proxy)."""
    check_free(Port(flag, host, port))


def _why(e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return "the port is already in use (another server, or one still shutting down?)"
    if e.errno == errno.EADDRNOTAVAIL:
        return "the address is not one of this machine's"
    if e.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges)"
    return e.strerror or str(e)


def _p2p_producers(kv: KVTransferConfig | None) -> list[tuple[str, int]]:
    """(kv_ip, kv_port) of each p2p connector that serves its blocks (a producer),
    directly or inside ``multi``."""
    if kv is None:
        return []
    configs: list[KVTransferConfig] = [kv]
    if kv.kv_connector == "multi":
        configs = []
        for item in kv.kv_connector_extra_config.get("connectors") or []:
            if isinstance(item, dict) and item.get("kv_connector") == "p2p":
                with contextlib.suppress(ConfigError):  # the connector reports its errors
                    configs.append(
                        KVTransferConfig.from_json(_json({"kv_role": kv.kv_role, **item}))
                    )
    return [(c.kv_ip, c.kv_port) for c in configs if c.kv_connector == "p2p" and c.is_producer]


def _json(obj: dict[str, object]) -> str:
    import json

    return json.dumps(obj)


def server_ports(config: ServeConfig, endpoints: Endpoints) -> list[Port]:
    """The TCP ports this machine's part of the server binds, from its flags (see the
    module docstring); ``endpoints`` holds the KV event settings already applied."""
    p = config.engine.parallel
    node0 = p.node_rank == 0
    server = node0 and not config.headless  # the API server's machine
    runs_engines = node0  # schedulers (and rank 0 of each engine core) run here
    ports: list[Port] = []
    if server:
        ports.append(Port("--port", config.host, config.port))
    if runs_engines and p.master_port is not None and p.group_world_size > 1:
        groups = [0] if p.dp_lockstep else [d for d in p.local_engines]
        ports += [Port("--master-port", p.master_addr, p.master_port + d) for d in groups]
        if p.nnodes > 1 or p.ranks_on_ray:  # plans, results and control, bound on node 0
            ports += [
                Port(f"--master-port (+{i})", p.master_addr, p.master_port + i) for i in (1, 2, 3)
            ]
    if server and p.engines_span_nodes:
        rpc = p.data_parallel_rpc_port
        ports += [
            Port("--data-parallel-rpc-port", p.data_parallel_address, rpc),
            Port("--data-parallel-rpc-port (+1)", p.data_parallel_address, rpc + 1),
        ]
    if runs_engines:
        for name, endpoint in (
            ("--kv-events-endpoint", endpoints.kv_events),
            ("--kv-events-config replay_endpoint", endpoints.kv_events_replay),
        ):
            if (tcp := tcp_endpoint(endpoint)) is not None:
                ports += [Port(name, tcp[0], tcp[1] + d) for d in p.local_engines]
    for host, kv_port in _p2p_producers(config.engine.kv_transfer):
        ports += [Port("--kv-transfer-config kv_port", host, kv_port + r) for r in p.local_ranks]
    return list(dict.fromkeys(ports))


def check_server_ports(config: ServeConfig, endpoints: Endpoints) -> None:
    """ConfigError naming the first port of ``server_ports`` that is out of range or taken."""
    for port in server_ports(config, endpoints):
        check_free(port)
