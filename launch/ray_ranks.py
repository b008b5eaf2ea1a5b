"""Worker ranks as Ray actors (vLLM's ``--distributed-executor-backend ray``).

The launcher joins an existing Ray cluster (``RAY_ADDRESS``, else the one ``ray start
--head`` runs on this machine), reserves one placement-group bundle per rank of an engine
core (a GPU each on CUDA, a CPU each on a CPU; packed onto as few nodes as hold them), and
starts one ``RankActor`` per rank in its bundle. The actor runs the same worker as a child
process would (``run_worker``): torch.distributed still forms the group (NCCL or gloo,
its store on ``--master-addr``), and plans and results still travel as msgspec messages
over ZeroMQ -- TCP on ``--master-addr`` here, since a rank may be on any node of the
cluster. Ray carries only the start (the configuration as JSON bytes) and each actor's
life; nothing of a step goes through it.

Supervision is the launcher's, as for its children: each actor stands in the
``ProcessGroup`` as a ``Child`` whose ``popen`` is a ``RayActorProcess`` (its exit code is
the actor's ``run``'s; a dead actor or node is an error exit), so a killed actor ends
in-flight requests with errors and the server exits non-zero, or restarts the engine with
``--restart-on-failure``. A placement the cluster cannot hold is a start-up error that
names the missing resources, after ``PLACEMENT_TIMEOUT_S``. Actors are owned by the
launcher's Ray driver: if the launcher dies, Ray ends them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import traceback
from typing import Any

import msgspec

from launch.process import Child, ProcessGroup
from launch.workers import worker_name
from services.config import ConfigError, ParallelConfig, ServeConfig
from services.ipc import STOP_SIGNAL
from services.logging_utils import init_logger

logger = init_logger(__name__)

PLACEMENT_TIMEOUT_S = float(os.environ.get("ACTORSERVE_RAY_PLACEMENT_TIMEOUT_S", "60"))
_PASSED_ENV = ("OMP_NUM_THREADS", "ACTORSERVE_", "TORCH_", "NCCL_", "GLOO_", "PROMETHEUS_")


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--distributed-executor-backend ray needs Ray: pip install 'actorserve[ray]'"
        ) from None
    return ray


def connect(parallel: ParallelConfig) -> None:
    """Join the Ray cluster (``RAY_ADDRESS``, else the local one); ConfigError if there is
    none. With ``--master-addr`` (or ``--data-parallel-address``) left at loopback on a
    cluster of several machines, the ranks' store and sockets (the engine nodes' port) move
    to this node's address, which every node reaches."""
    ray = import_ray()
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS") or "auto"
        try:
            ray.init(address=address, logging_level="WARNING", log_to_driver=True)
        except ConnectionError as e:
            raise ConfigError(
                f"no Ray cluster at {address!r} ({e}); start one with `ray start --head` "
                "or name it in RAY_ADDRESS"
            ) from None
    nodes = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    if nodes - {"127.0.0.1"}:  # loopback is no address for the other machines
        here = ray.util.get_node_ip_address()
        for name in ("master_addr", "data_parallel_address"):
            if getattr(parallel, name) in ("127.0.0.1", "localhost"):
                setattr(parallel, name, here)
                logger.info("Ray: --%s %s (this node)", name.replace("_", "-"), here)


def _bundle(device: str) -> dict[str, float]:
    return {"GPU": 1.0} if device == "cuda" else {"CPU": 1.0}


def _missing(ray: Any, bundles: list[dict[str, float]]) -> str:
    """What the cluster lacks for ``bundles``, in words."""
    total = ray.cluster_resources()
    free = ray.available_resources()
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    parts = [
        f"{v:g} {k} (the cluster has {total.get(k, 0):g}, {free.get(k, 0):g} free)"
        for k, v in need.items()
        if free.get(k, 0) < v
    ]
    return "; ".join(parts) or "room for the bundles on its nodes"


class RayActorProcess:
    """The part of ``subprocess.Popen`` the launcher's supervision uses, for an actor."""

    def __init__(self, ray: Any, actor: Any, run: Any, pid: int) -> None:
        self._ray, self._actor, self._run = ray, actor, run
        self.pid = pid  # on its node (which may not be this one)
        self.returncode: int | None = None
        self._stopped = False  # by the launcher: its end is an exit 0, as a child's

    def poll(self) -> int | None:
        if self.returncode is None:
            done, _ = self._ray.wait([self._run], timeout=0)
            if done:
                try:
                    self.returncode = int(self._ray.get(self._run))
                except Exception:  # the actor or its node died: as a process killed
                    self.returncode = 0 if self._stopped else -int(signal.SIGKILL)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        done, _ = self._ray.wait([self._run], timeout=timeout)
        if not done:
            raise subprocess.TimeoutExpired("ray actor", timeout or 0)
        code = self.poll()
        assert code is not None
        return code

    def send_signal(self, sig: int) -> None:
        if sig in (STOP_SIGNAL, signal.SIGTERM):
            self._stopped = True
        if sig in (STOP_SIGNAL, signal.SIGTERM, signal.SIGKILL):
            self.kill()

    def kill(self) -> None:
        if self.returncode is None:
            self._ray.kill(self._actor, no_restart=True)


def _rank_actor(ray: Any) -> Any:
    @ray.remote(max_restarts=0)
    class RankActor:
        """One worker rank: ``run`` is the worker process's life, in this actor."""

        def pid(self) -> int:
            return os.getpid()

        def run(self, config_json: bytes, control: str, rank: int, dp_rank: int) -> int:
            from launch.child import USER_ERROR_EXIT, is_user_error
            from services.gpu_worker.worker import run_worker

            # ray.kill ends this process with SIGTERM: exit at once, without the
            # interpreter's teardown (as a child stopped by its launcher; no noise)
            signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
            config = msgspec.json.decode(config_json, type=ServeConfig)
            if folder := os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                # on another node: its metrics stay there (the front end's /metrics reads
                # this node's folder only)
                os.makedirs(folder, exist_ok=True)
            try:
                run_worker(config, control, rank, dp_rank)
            except SystemExit as e:
                return int(e.code or 0)
            except Exception as e:  # an exit code, as a child's: the launcher names it
                if is_user_error(e):
                    print(f"error: {e}", flush=True)
                    return USER_ERROR_EXIT
                traceback.print_exc()
                return 1
            return 0

    return RankActor


def _engine_actor(ray: Any) -> Any:
    @ray.remote(max_restarts=0)
    class EngineCoreActor:
        """One data-parallel engine core: ``run`` is an engine node's life (``actorserve
        serve --headless`` for this one engine core, its scheduler and ranks this
        process's children), in this actor."""

        def pid(self) -> int:
            return os.getpid()

        def run(self, argv: list[str]) -> int:
            from launch.cli import main

            return main(argv)

    return EngineCoreActor


def engine_node_argv(parallel: ParallelConfig, dp_rank: int) -> list[str]:
    """The command line of engine core ``dp_rank``'s engine node: the front end's own
    (``serve ...``), then what makes it that engine core's node (the last of a flag wins)."""
    import sys

    args = sys.argv[1:]
    if not args or args[0] != "serve":
        raise ConfigError("--data-parallel-backend ray needs the server started as `serve ...`")
    return [
        *args,
        "--headless",
        "--data-parallel-backend", "mp",
        "--data-parallel-size-local", "1",
        "--data-parallel-start-rank", str(dp_rank),
        "--data-parallel-address", parallel.data_parallel_address,
        "--data-parallel-rpc-port", str(parallel.data_parallel_rpc_port),
    ]  # fmt: skip


class RayRanks:
    """The placement groups of the engine cores whose ranks are Ray actors."""

    def __init__(self) -> None:
        self.ray: Any = import_ray()
        self._groups: list[Any] = []  # ray.util.placement_group.PlacementGroup
        self._starts = 0  # in the actors' names: a restart's may not reuse its predecessors'

    def start(
        self, group: ProcessGroup, config: ServeConfig, env: dict[str, str], dp_rank: int
    ) -> list[Child]:
        """Reserve engine ``dp_rank``'s bundles and start its ranks in them."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        engine = config.engine
        parallel = engine.parallel
        bundles = [_bundle(engine.worker.resolved_device()) for _ in range(parallel.world_size)]
        started = time.monotonic()
        self._starts += 1
        pg = self._place(bundles, "PACK", f"worker ranks of engine {dp_rank}")
        payload = msgspec.json.encode(config)
        passed = {k: v for k, v in os.environ.items() if k.startswith(_PASSED_ENV)}
        actor_cls = _rank_actor(ray)
        children = []
        for rank in range(parallel.world_size):
            actor = actor_cls.options(
                num_cpus=bundles[rank].get("CPU", 0),
                num_gpus=bundles[rank].get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, rank),
                runtime_env={"env_vars": {**passed, **env}},
                name=f"actorserve-{os.getpid()}-{self._starts}-engine-{dp_rank}-rank-{rank}",
            ).remote()
            pid = ray.get(actor.pid.remote(), timeout=PLACEMENT_TIMEOUT_S)
            run = actor.run.remote(payload, env["ACTORSERVE_CONTROL"], rank, dp_rank)
            name = worker_name(rank, dp_rank, parallel.data_parallel_size)
            child = Child(name, RayActorProcess(ray, actor, run, pid))  # type: ignore[arg-type]
            group.children.append(child)
            children.append(child)
        logger.info(
            "Ray: engine %d's %d worker ranks placed and started in %.1f s (placement group %s)",
            dp_rank,
            len(children),
            time.monotonic() - started,
            pg.id.hex()[:12],
        )
        return children

    def _place(self, bundles: list[dict[str, float]], strategy: str, what: str) -> Any:
        """A placement group of ``bundles``, ready; ConfigError naming what is missing."""
        from ray.util.placement_group import placement_group

        ray = self.ray
        pg = placement_group(bundles, strategy=strategy, name=f"actorserve-{what}")
        self._groups.append(pg)
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(
                f"Ray could not place the {len(bundles)} {what} ({bundles[0]} each) within "
                f"{PLACEMENT_TIMEOUT_S:g} s: missing {_missing(ray, bundles)}"
            ) from None
        return pg

    def start_engine_cores(self, group: ProcessGroup, config: ServeConfig) -> list[Child]:
        """Every data-parallel engine core as an actor running its engine node, one bundle
        each (its ranks and its scheduler, on one node), spread over the cluster's nodes."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        engine = config.engine
        parallel = engine.parallel
        world = parallel.world_size
        bundle = (
            {"GPU": float(world), "CPU": 1.0}
            if engine.worker.resolved_device() == "cuda"
            else {"CPU": float(world + 1)}
        )
        num = parallel.data_parallel_size
        started = time.monotonic()
        self._starts += 1
        pg = self._place([dict(bundle) for _ in range(num)], "SPREAD", "engine cores")
        passed = {k: v for k, v in os.environ.items() if k.startswith(_PASSED_ENV)}
        actor_cls = _engine_actor(ray)
        children = []
        for d in range(num):
            actor = actor_cls.options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, d),
                runtime_env={"env_vars": passed},
                name=f"actorserve-{os.getpid()}-{self._starts}-engine-core-{d}",
            ).remote()
            pid = ray.get(actor.pid.remote(), timeout=PLACEMENT_TIMEOUT_S)
            run = actor.run.remote(engine_node_argv(parallel, d))
            child = Child(f"engine {d} (Ray actor)", RayActorProcess(ray, actor, run, pid))  # type: ignore[arg-type]
            group.children.append(child)
            children.append(child)
        logger.info(
            "Ray: %d engine cores placed and started in %.1f s (placement group %s)",
            num,
            time.monotonic() - started,
            pg.id.hex()[:12],
        )
        return children

    def close(self) -> None:
        """Give back the placement groups (the actors in them end with them)."""
        from ray.util.placement_group import remove_placement_group

        for pg in self._groups:
            try:
                remove_placement_group(pg)
            except Exception as e:  # the cluster went away: nothing left to give back
                logger.debug("removing a placement group: %r", e)
        self._groups.clear()
