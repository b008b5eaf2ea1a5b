"""Worker ranks as child processes: started by the server's launcher, or by the offline
engine itself when it has more than one rank (``LocalWorkerRanks``)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import msgspec

from launch.child import CONTROL_ENV
from launch.process import Child, ProcessGroup
from services.config import Endpoints, EngineConfig, ParallelConfig, ServeConfig
from services.ipc import IpcDir, PullSocket
from services.protocol import Ready
from services.scheduler.executor import MultiprocExecutor

_POLL_MS = 200


def resolve_master_port(parallel: ParallelConfig) -> bool:
    """Pick free ports on ``--master-addr`` for the ranks' rendezvous, unless one was given
    (or one rank needs none): data-parallel engine d's ranks meet at ``master_port + d``
    (all of them at ``master_port`` when they step together: ``dp_lockstep``).
    True if it picked them."""
    if parallel.master_port is not None:
        return False
    if parallel.group_world_size == 1 and not parallel.ranks_on_ray:
        return False
    groups = 1 if parallel.dp_lockstep else parallel.data_parallel_size
    if parallel.ranks_on_ray:
        groups = 4  # the store, then plans, results and control (cross_node_endpoints)
    for _ in range(100):
        with socket.socket() as s:
            s.bind((parallel.master_addr, 0))
            first = int(s.getsockname()[1])
        try:
            for port in range(first, first + groups):
                with socket.socket() as s:
                    s.bind((parallel.master_addr, port))
        except OSError:
            continue
        parallel.master_port = first
        return True
    raise RuntimeError(f"found no {groups} free consecutive ports")


def worker_name(rank: int, dp_rank: int, data_parallel_size: int) -> str:
    return (
        f"worker rank {rank}" if data_parallel_size == 1 else f"engine {dp_rank} worker rank {rank}"
    )


def start_worker_ranks(
    group: ProcessGroup, config: ServeConfig, env: dict[str, str], dp_rank: int = 0
) -> list[Child]:
    """``python -m launch.child worker RANK DP_RANK`` for every rank of one engine core that
    runs on this node (or, with ``--distributed-executor-backend ray``, a Ray actor for
    every rank: ``launch/ray_ranks.py``)."""
    if config.engine.parallel.ranks_on_ray:
        from launch.ray_ranks import RayRanks

        if group.ray_ranks is None:
            group.ray_ranks = RayRanks()
        return group.ray_ranks.start(group, config, env, dp_rank)
    payload = msgspec.json.encode(config)
    parallel = config.engine.parallel
    return [
        group.start(
            worker_name(rank, dp_rank, parallel.data_parallel_size),
            "launch.child",
            payload,
            env,
            args=("worker", str(rank), str(dp_rank)),
        )
        for rank in parallel.local_ranks
    ]


def cross_node_endpoints(endpoints: Endpoints, parallel: ParallelConfig) -> None:
    """With ``--nnodes`` > 1 (or ranks on Ray, which may place them on any node), the
    sockets that worker ranks on other machines reach become TCP on node 0's
    ``--master-addr`` (bound there, never on every interface), at the ports after
    ``--master-port``, so every node derives them from the same flags."""
    if parallel.nnodes == 1 and not parallel.ranks_on_ray:
        return
    assert parallel.master_port is not None
    base = f"tcp://{parallel.master_addr}"
    endpoints.step_plans = f"{base}:{parallel.master_port + 1}"
    endpoints.step_results = f"{base}:{parallel.master_port + 2}"
    endpoints.control = f"{base}:{parallel.master_port + 3}"


def missing_ranks(ready: list[Ready], parallel: ParallelConfig) -> list[str]:
    """The worker ranks that have not reported READY, by name."""
    dp = parallel.data_parallel_size
    seen = {(r.engine, r.rank) for r in ready}
    return [
        worker_name(rank, d, dp)
        for d in parallel.local_engines
        for rank in range(parallel.world_size)
        if (d, rank) not in seen
    ]


class LocalWorkerRanks:
    """The offline engine's worker ranks: child processes, a ``MultiprocExecutor`` to
    reach them, and ``close()`` that leaves none behind."""

    def __init__(self, config: EngineConfig, folder: Path, timeout_s: float = 900.0) -> None:
        self.ipc = IpcDir()
        endpoints = Endpoints(
            step_plans=self.ipc.endpoint("step_plans"),
            step_results=self.ipc.endpoint("step_results"),
            control=self.ipc.endpoint("control"),
        )
        resolve_master_port(config.parallel)
        serve_config = ServeConfig(engine=config, endpoints=endpoints, model_folder=str(folder))
        self.group = ProcessGroup(pdeathsig=False)
        world = config.parallel.world_size
        control = PullSocket[Ready](endpoints.control, Ready, bind=True)
        try:
            start_worker_ranks(self.group, serve_config, {CONTROL_ENV: endpoints.control})
            ready: list[Ready] = []
            deadline = time.monotonic() + timeout_s
            while len(ready) < world:
                if (dead := self.dead_rank()) is not None:
                    raise RuntimeError(f"{dead} during start-up (its error is above)")
                if time.monotonic() > deadline:
                    missing = ", ".join(missing_ranks(ready, config.parallel))
                    raise RuntimeError(f"{missing} did not start in time")
                if (msg := control.recv(timeout_ms=_POLL_MS)) is not None:
                    ready.append(msg)
            self.executor = MultiprocExecutor(
                endpoints.step_plans,
                endpoints.step_results,
                world,
                min(r.num_blocks for r in ready),
                kv_block_bytes=sum(r.kv_block_bytes for r in ready),
                is_alive=self.dead_rank,
            )
            self.executor.wait_ready()
        except BaseException:
            self.close()
            raise
        finally:
            control.close()

    def dead_rank(self) -> str | None:
        dead = self.group.first_dead()
        if dead is None:
            return None
        return f"the {dead.name} process exited with code {dead.popen.returncode}"

    def close(self) -> None:
        self.group.stop_all()  # first: the ranks get the stop signal, not their scheduler vanish
        if hasattr(self, "executor"):
            self.executor.shutdown()
        self.ipc.cleanup()
