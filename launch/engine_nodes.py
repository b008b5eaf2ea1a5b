"""Data-parallel engine cores on several machines (vLLM's ``--data-parallel-size-local``).

Node 0 runs the API server, the tokenizers, the detokenizer and its own engine cores
(``--data-parallel-size-local`` of them, from rank 0); an engine node started with
``--headless --data-parallel-start-rank S`` runs engine cores ``S .. S+local-1`` (a
scheduler and its worker ranks each) and nothing else.

Sockets. Node 0 binds two TCP ports on ``--data-parallel-address`` (never every
interface): ``--data-parallel-rpc-port``, where its launcher hears the engine nodes, and
the next one, the detokenizer's token input that every scheduler sends to. An engine node
binds each engine core's input and state sockets on its own address (the one that routes
to node 0) at free ports, and names them in its hello; node 0 starts the tokenizers,
detokenizer and API server, which connect to every engine core, only once every engine
node said hello.

Liveness. An engine node sends a status every second, with its processes' Prometheus
text (node 0's ``/metrics`` serves it with its own). Node 0 takes a node as dead at once
when it reports a dead process or its connection closes (its launcher died), and when it
is silent for ``HEARTBEAT_TIMEOUT_S`` (the machine vanished); then the launcher's death
rule applies as for a child of its own: every in-flight request ends with an error and
everything stops. An engine node exits 0 when node 0 goes away (a ZeroMQ heartbeat on its
socket).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

import msgspec
import zmq

from services.config import ConfigError, EngineAddresses, ParallelConfig, ServeConfig
from services.ipc import PullSocket, PushSocket
from services.logging_utils import init_logger
from services.metrics.registry import MULTIPROC_ENV, REMOTE_METRICS_SUFFIX, render_latest
from services.protocol import (
    EngineNodeDown,
    EngineNodeHello,
    EngineNodeMessage,
    EngineNodeStatus,
    Ready,
)

logger = init_logger(__name__)

STATUS_INTERVAL_S = 1.0
CLOSED_SILENCE_S = 2.5  # after a connection closed, a node this long silent is dead
HEARTBEAT_TIMEOUT_S = 10.0  # without a close: a machine that vanished
_ZMQ_HEARTBEAT: dict[int, int] = {zmq.HEARTBEAT_IVL: 1000, zmq.HEARTBEAT_TIMEOUT: 10_000}


def head_endpoints(parallel: ParallelConfig) -> tuple[str, str]:
    """Node 0's two TCP sockets: (its launcher's, the detokenizer's token input)."""
    base = f"tcp://{parallel.data_parallel_address}"
    port = parallel.data_parallel_rpc_port
    return f"{base}:{port}", f"{base}:{port + 1}"


def address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])


def check_free(endpoint: str) -> None:
    """Raise OSError if ``tcp://host:port`` cannot be bound now."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    with socket.socket() as s:
        s.bind((host, int(port)))


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class HeadLost(Exception):
    """Node 0 went away (seen by an engine node)."""


class EngineNodes:
    """Node 0's end: the engine nodes' addresses, readiness, metrics and liveness.

    ``poll`` turns their messages into ``Ready`` records the launcher waits on like its
    children's: role ``engine address`` when an engine core's addresses are known,
    ``remote engine`` when it is ready to serve."""

    def __init__(self, config: ServeConfig) -> None:
        parallel = config.engine.parallel
        self.config = config
        self.remote = [
            d for d in range(parallel.data_parallel_size) if d not in parallel.local_engines
        ]
        endpoint, detok = head_endpoints(parallel)
        try:
            self.socket = PullSocket[EngineNodeMessage](endpoint, EngineNodeMessage, bind=True)
            check_free(detok)  # the detokenizer binds it later: fail now, not after the loads
        except (zmq.ZMQError, OSError) as e:
            raise ConfigError(
                f"cannot listen on {endpoint} and the next port ({e}): --data-parallel-address "
                "must be an IPv4 address of this machine and --data-parallel-rpc-port and the "
                "port after it free"
            ) from None
        # A closed connection is only a hint (a port scan closes one too): the nodes that
        # stay silent after it are the dead ones, found in CLOSED_SILENCE_S, not in
        # HEARTBEAT_TIMEOUT_S (that is for a machine that vanished without closing).
        self._closed = self.socket.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._closed_at: float | None = None
        self._nodes: dict[str, list[int]] = {}  # accepted node id -> its engine cores
        self._ready: set[int] = set()
        self._last_seen: dict[str, float] = {}
        self._failure: str | None = None
        folder = os.environ.get(MULTIPROC_ENV)
        self._metrics_dir = Path(folder) if folder else None

    def describe(self) -> str:
        return (
            "engine core"
            + ("s " if len(self.remote) > 1 else " ")
            + ", ".join(str(d) for d in self.remote)
        )

    def poll(self) -> list[Ready]:
        """Handle what arrived; the ``Ready`` records it completes."""
        out: list[Ready] = []
        while True:
            try:
                msg = self.socket.recv_nowait()
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.warning("ignoring an undecodable message on the engine nodes' port: %s", e)
                continue
            if msg is None:
                break
            if isinstance(msg, EngineNodeHello):
                out += self._hello(msg)
                continue
            engines = self._nodes.get(msg.node)
            if engines is None:
                continue  # a node that was refused (its hello said why)
            if isinstance(msg, EngineNodeDown):
                self._failure = f"engine node of engine cores {engines}: {msg.reason}"
                continue
            self._last_seen[msg.node] = time.monotonic()
            if msg.ready and not self._ready.issuperset(engines):
                self._ready.update(engines)
                out += [Ready("remote engine", 0, engine=d) for d in engines]
            if msg.metrics and self._metrics_dir is not None:
                name = f"engines-{'-'.join(map(str, engines))}{REMOTE_METRICS_SUFFIX}"
                tmp = self._metrics_dir / f".{name}.tmp"
                tmp.write_text(msg.metrics)
                tmp.replace(self._metrics_dir / name)  # a scrape never reads half of it
        while self._closed.poll(0):
            self._closed.recv_multipart()
            self._closed_at = time.monotonic()
        return out

    def _hello(self, msg: EngineNodeHello) -> list[Ready]:
        engines = sorted(msg.engine_cores)
        known = self.config.endpoints.remote_engines
        wrong = [d for d in engines if d not in self.remote or d in known]
        if wrong or not engines or set(msg.engine_states) != set(engines):
            logger.error(
                "refusing an engine node that announced engine cores %s: each must be one of "
                "%s and not announced before (check its --data-parallel-start-rank and "
                "--data-parallel-size-local)",
                engines,
                [d for d in self.remote if d not in known],
            )
            return []
        self._nodes[msg.node] = engines
        self._last_seen[msg.node] = time.monotonic()
        for d in engines:
            known[d] = EngineAddresses(msg.engine_cores[d], msg.engine_states[d])
            logger.info("engine core %d is on another machine at %s", d, msg.engine_cores[d])
        return [Ready("engine address", 0, engine=d) for d in engines]

    def failure(self) -> str | None:
        """Why an engine node is gone: it reported a death, or went silent."""
        if self._failure is not None:
            return self._failure
        now = time.monotonic()
        for node, seen in self._last_seen.items():
            engines = self._nodes[node]
            closed = self._closed_at
            if closed is not None and seen < closed and now - closed > CLOSED_SILENCE_S:
                return f"engine node of engine cores {engines} closed its connection"
            if now - seen > HEARTBEAT_TIMEOUT_S:
                return f"engine node of engine cores {engines} is silent for {now - seen:.0f} s"
        return None

    def close(self) -> None:
        self._closed.close(linger=0)
        self.socket.close()


class EngineNode:
    """An engine node's end: its socket to node 0, the hello, and the status beat."""

    def __init__(self, config: ServeConfig) -> None:
        parallel = config.engine.parallel
        self.engines = list(parallel.local_engines)
        here = address_towards(parallel.data_parallel_address)
        head, detok = head_endpoints(parallel)
        ep = config.endpoints
        ep.detok_tokens = detok
        for d in self.engines:
            ep.remote_engines[d] = EngineAddresses(
                f"tcp://{here}:{free_port(here)}", f"tcp://{here}:{free_port(here)}"
            )
        self.socket = PushSocket[EngineNodeMessage](head, EngineNodeMessage, options=_ZMQ_HEARTBEAT)
        self._lost = self.socket.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.ready = False
        self._next_status = 0.0
        self.node = uuid.uuid4().hex
        self.socket.send(
            EngineNodeHello(
                self.node,
                {d: ep.remote_engines[d].engine_core for d in self.engines},
                {d: ep.remote_engines[d].engine_state for d in self.engines},
            )
        )

    def beat(self) -> None:
        """Send the status when one is due; raise ``HeadLost`` once node 0 is gone."""
        if self._lost.poll(0):
            raise HeadLost
        now = time.monotonic()
        if now < self._next_status:
            return
        self._next_status = now + STATUS_INTERVAL_S
        metrics = ""
        if os.environ.get(MULTIPROC_ENV):
            try:
                metrics = render_latest()[0].decode()
            except Exception:  # a child's metrics file half-created: the next beat has it
                logger.debug("metrics not readable this beat", exc_info=True)
        self.socket.send(EngineNodeStatus(self.node, self.engines, self.ready, metrics))

    def down(self, reason: str) -> None:
        self.socket.send(EngineNodeDown(self.node, self.engines, reason))
        self.socket.socket.close(linger=2000)  # let it leave before this process ends

    def close(self) -> None:
        self._lost.close(linger=0)
        self.socket.close()
