"""``--distributed-executor-backend ray``: an engine core's worker ranks as Ray actors on a
multi-node Ray cluster (launch/ray_ranks.py).

The cluster is Ray's own test utility (``ray.cluster_utils.Cluster``): two raylets on
this machine, each a Ray node of its own with 2 CPUs, on loopback only
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray use 127.0.0.1 as every node's
address). Three ranks (a CPU each) then span both nodes, and so do two engine cores (a
rank and a scheduler each), as on two machines. Checked: greedy outputs equal the ``mp``
backend's (TP, PP, DP), the placements really span the nodes, a remote engine core's
metrics reach the front end, a killed actor ends in-flight requests with an error and the
server exits non-zero, and a placement the cluster cannot hold is a one-line start-up
error.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.server_utils import REPO, RemoteServer, free_port

LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
os.environ.update(LOOPBACK)  # read when ray is imported: this process's nodes on loopback
ray = pytest.importorskip("ray")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    c.add_node(num_cpus=2)
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def ray_server(
    cluster, *args: str, backend: str = "--distributed-executor-backend"
) -> RemoteServer:
    env = {**LOOPBACK, "RAY_ADDRESS": cluster.address}
    return RemoteServer("--max-model-len", "512", backend, "ray", *args, env=env)


def greedy(server: RemoteServer, headers: dict[str, str] | None = None) -> list[str]:
    out = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def placed_nodes() -> set[str]:
    """The nodes the live placement groups' bundles are on."""
    tables = ray.util.placement_group_table().values()
    return {
        node for t in tables if t["state"] == "CREATED" for node in t["bundles_to_node_id"].values()
    }


def actor_pids(name: str = "RankActor") -> list[int]:
    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and f"ray::{name}" in " ".join(p.info["cmdline"])
    ]


def rank_actor_pids() -> list[int]:
    return actor_pids("RankActor")


def test_tensor_parallel_ranks_on_two_nodes_match_mp_then_a_killed_actor_stops_it(cluster):
    with RemoteServer("--max-model-len", "512", "-tp", "3") as mp:
        expected = greedy(mp.wait_ready())
    with ray_server(cluster, "-tp", "3") as server:
        server.wait_ready()
        assert len(placed_nodes()) == 2  # 2 ranks on one node, 1 on the other
        assert greedy(server) == expected
        assert "Ray: engine 0's 3 worker ranks placed and started" in server.log

        # A rank dies (its actor's process killed) during a request: the request ends in
        # an error, the server exits non-zero, and the actors are gone with it.
        pids = rank_actor_pids()
        assert len(pids) == 3
        body = {"prompt": "Paris", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        with (
            httpx.Client(timeout=60) as client,
            client.stream(
                "POST", f"{server.url}/v1/completions", json={**body, "stream": True}
            ) as stream,
        ):
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # under way
            os.kill(pids[-1], signal.SIGKILL)
            rest = "\n".join(lines)
        assert "error" in rest
        assert server.wait_exit(60) not in (None, 0)
        assert "process died" in server.log
        deadline = time.monotonic() + 30
        while rank_actor_pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not rank_actor_pids()
    deadline = time.monotonic() + 30  # the placement group given back
    while placed_nodes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not placed_nodes()


def test_pipeline_stages_as_actors_match_one_rank_and_restart(cluster):
    with RemoteServer("--max-model-len", "512") as one:
        expected = greedy(one.wait_ready())
    with ray_server(cluster, "-pp", "2", "--restart-on-failure") as server:
        assert greedy(server.wait_ready()) == expected
        # A rank's actor killed: the engine restarts (new actors, a new placement group)
        os.kill(rank_actor_pids()[0], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while "serving again" not in server.log and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "restarting the engine" in server.log and "serving again" in server.log
        assert greedy(server) == expected
        assert server.wait_exit(0.1) is None
        os.killpg(server.pgid, signal.SIGTERM)  # a clean stop: exit 0, actors gone
        assert server.wait_exit(60) == 0
    deadline = time.monotonic() + 30
    while (rank_actor_pids() or placed_nodes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not rank_actor_pids() and not placed_nodes()


def test_data_parallel_engine_cores_as_actors(cluster):
    """``--data-parallel-backend ray``: each engine core an actor running an engine node
    (its scheduler and rank its children), one per node; the front end on this one."""
    from tests.server_utils import metric

    with RemoteServer("--max-model-len", "512") as one:
        expected = greedy(one.wait_ready())
    from tests.test_multinode import _rpc_port

    dp = ("-dp", "2", "--data-parallel-rpc-port", str(_rpc_port()))
    with ray_server(cluster, *dp, backend="--data-parallel-backend") as server:
        server.wait_ready()
        assert len(placed_nodes()) == 2
        for rank in "01":  # each engine core (pinned as vLLM pins: the header)
            assert greedy(server, {"X-data-parallel-rank": rank}) == expected
        deadline = time.monotonic() + 15  # a remote engine's series come with its status
        while True:
            done = [metric(server, "vllm:request_success_total", engine=e) or 0 for e in "01"]
            if sum(done) >= 6 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert sum(done) == 6 and min(done) >= 1, done
        (pid, *_) = actor_pids("EngineCoreActor")
        os.kill(pid, signal.SIGKILL)  # an engine core's node is lost
        assert server.wait_exit(60) not in (None, 0)
        # named as the launcher names a lost engine core: its actor, or its engine node
        lost = r"engine \d \(Ray actor\) process died|engine node of engine cores \[\d\]"
        assert re.search(lost, server.log), server.log[-3000:]
    deadline = time.monotonic() + 30
    while (actor_pids("EngineCoreActor") or placed_nodes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not actor_pids("EngineCoreActor") and not placed_nodes()


def test_a_placement_the_cluster_cannot_hold_is_a_clear_error(cluster):
    env = dict(os.environ, **LOOPBACK, RAY_ADDRESS=cluster.address,
               ACTORSERVE_RAY_PLACEMENT_TIMEOUT_S="3")  # fmt: skip
    cmd = [sys.executable, "-m", "launch.cli", "serve", "--port", str(free_port()), "-pp", "5",
           "--distributed-executor-backend", "ray", "--max-model-len", "512"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert "could not place the 5 worker ranks" in errors[0]
    assert "missing 5 CPU (the cluster has 4" in errors[0]
    deadline = time.monotonic() + 30
    while placed_nodes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not placed_nodes()  # nothing reserved is left behind


def test_flags_the_ray_backend_does_not_take():
    from services.config import ConfigError, ParallelConfig

    for bad in (
        {"nnodes": 2, "master_port": 29500, "tensor_parallel_size": 2},
        {"data_parallel_size": 2},
    ):
        config = ParallelConfig(distributed_executor_backend="ray", **bad)
        with pytest.raises(ConfigError, match="--distributed-executor-backend ray places"):
            config.validate()
