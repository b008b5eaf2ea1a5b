"""Tensor/pipeline-parallel ranks on two "nodes": two launchers on this machine, node 0
serving and node 1 ``--headless``, meeting over TCP on a loopback address as two machines
would over their network (the same flags, only --node-rank and --headless differ)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from launch.llm import LLM, SamplingParams
from tests.server_utils import REPO, RemoteServer, free_port, metric

PROMPTS = [[1, 100, 200, 300], list(range(5, 60))]


def _node_args(small_model: Path, port: int, node_rank: int) -> list[str]:
    return [
        "--model", str(small_model), "--load-format", "dummy", "--seed", "5",
        "--max-model-len", "256", "-tp", "2", "--nnodes", "2", "--node-rank", str(node_rank),
        "--master-addr", "127.0.0.1", "--master-port", str(port), "--distributed-timeout", "60",
    ]  # fmt: skip


def _headless(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "serve", "--headless", *args],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        start_new_session=True,
    )


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait(10)


def test_two_nodes_serve_like_one(small_model: Path) -> None:
    port = free_port()
    one = LLM(model=str(small_model), load_format="dummy", seed=5, max_model_len=256)
    want = [r.outputs[0].token_ids for r in one.generate(PROMPTS, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))]  # fmt: skip
    node1 = _headless(_node_args(small_model, port, 1))
    try:
        with RemoteServer(*_node_args(small_model, port, 0)) as node0:
            node0.wait_ready()
            client = openai.OpenAI(base_url=f"{node0.url}/v1", api_key="x", max_retries=0)
            out = client.completions.create(
                model=str(small_model), prompt=PROMPTS, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            got = [c.token_ids for c in sorted(out.choices, key=lambda c: c.index)]  # type: ignore[attr-defined]
            assert got == want
            # Node 0 runs rank 0 only; rank 1 is node 1's.
            workers = [p for p in node0.processes() if "worker" in " ".join(p.cmdline())]
            assert [p.cmdline()[-2] for p in workers] == ["0"]
        # Node 0 is gone: node 1's rank loses its scheduler and the headless launcher ends.
        assert node1.wait(60) == 0
    finally:
        _kill_group(node1)


@pytest.mark.slow  # make test-slow; start-up errors also in make test
def test_a_node_that_never_joins_is_a_start_up_error_naming_its_rank(small_model: Path) -> None:
    args = _node_args(small_model, free_port(), 0)
    args[args.index("--distributed-timeout") + 1] = "5"
    with RemoteServer(*args) as node0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="server exited"):
            node0.wait_ready(timeout_s=120)
        assert time.monotonic() - start < 100
        assert "not ready: worker rank 1" in node0.log
        assert "the group of 2 ranks did not form at 127.0.0.1" in node0.log


@pytest.mark.parametrize("node_rank, extra", [(1, []), (0, ["--headless"])])
def test_headless_exactly_on_the_other_nodes(small_model: Path, node_rank: int, extra) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", "serve",
         *_node_args(small_model, free_port(), node_rank), *extra],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "give --headless exactly on the other nodes" in out.stderr


# ---- data-parallel engine cores on two "nodes" (--data-parallel-size-local)


def _rpc_port() -> int:
    """A port whose next one is free too (the detokenizer's input on node 0)."""
    import socket

    while True:
        port = free_port()
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind(("127.0.0.1", port + 1))
            return port


def _engine_node_args(small_model: Path, rpc_port: int, *extra: str) -> list[str]:
    return [
        "--model", str(small_model), "--load-format", "dummy", "--seed", "5",
        "--max-model-len", "256", "-dp", "2", "--data-parallel-size-local", "1",
        "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port),
        *extra,
    ]  # fmt: skip


def _successes(server: RemoteServer, engine: str, at_least: float = 0) -> float:
    """Engine nodes' metrics reach node 0 with their next status (every second): poll."""
    deadline = time.monotonic() + 10
    while True:
        got = metric(server, "vllm:request_success_total", engine=engine) or 0.0
        if got >= at_least or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_engine_cores_on_two_nodes_serve_like_one(small_model: Path) -> None:
    import concurrent.futures

    rpc = _rpc_port()
    prompts = [[1, 100 + i, 200, 300 + 7 * i] for i in range(8)]
    one = LLM(model=str(small_model), load_format="dummy", seed=5, max_model_len=256)
    want = [r.outputs[0].token_ids for r in one.generate(prompts, SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True))]  # fmt: skip
    node1 = _headless(_engine_node_args(small_model, rpc, "--data-parallel-start-rank", "1"))
    try:
        with RemoteServer(*_engine_node_args(small_model, rpc)) as node0:
            node0.wait_ready()
            client = openai.OpenAI(base_url=f"{node0.url}/v1", api_key="x", max_retries=0)

            def complete(prompt: list[int], headers: dict[str, str] | None = None) -> list[int]:
                out = client.completions.create(
                    model=str(small_model), prompt=prompt, max_tokens=8, temperature=0,
                    extra_body={"ignore_eos": True, "return_token_ids": True},
                    extra_headers=headers,
                )  # fmt: skip
                return out.choices[0].token_ids  # type: ignore[attr-defined,no-any-return]

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                assert list(pool.map(complete, prompts)) == want
            # Both engine cores served, and engine 1's series (node 1's) reach node 0's /metrics.
            deadline = time.monotonic() + 10
            while True:  # engine 1's count arrives with node 1's next status
                by_engine = [_successes(node0, "0"), _successes(node0, "1")]
                if sum(by_engine) >= 8 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert sum(by_engine) == 8 and min(by_engine) >= 1, by_engine
            # A request pinned to engine 1 runs on node 1.
            assert complete(prompts[0], {"X-data-parallel-rank": "1"}) == want[0]
            assert _successes(node0, "1", at_least=by_engine[1] + 1) == by_engine[1] + 1
            assert _successes(node0, "0") == by_engine[0]
            # What is not an engine node on the RPC port changes nothing: a connection that
            # closes (a port scan) and an undecodable message (found in review).
            import socket

            import zmq

            socket.create_connection(("127.0.0.1", rpc)).close()
            push = zmq.Context.instance().socket(zmq.PUSH)
            push.connect(f"tcp://127.0.0.1:{rpc}")
            push.send(b"\xc1garbage")
            push.close(linger=1000)
            time.sleep(4)  # longer than the silence allowed after a close
            assert node0.popen.poll() is None
            assert complete(prompts[1], {"X-data-parallel-rank": "1"}) == want[1]
            # Node 0 runs engine 0's scheduler and worker only.
            children = [p.cmdline() for p in node0.processes() if "launch.child" in p.cmdline()]
            engines = sorted(c[-1] for c in children if c[-3] in ("worker", "scheduler"))
            assert engines == ["0", "0"], children
        # Node 0 is gone: the engine node notices and ends cleanly.
        assert node1.wait(60) == 0
    finally:
        _kill_group(node1)


@pytest.mark.slow  # make test-slow; make test: two nodes serving
def test_an_engine_node_dying_stops_the_server_with_errors(small_model: Path) -> None:
    import httpx

    rpc = _rpc_port()
    node1 = _headless(_engine_node_args(small_model, rpc, "--data-parallel-start-rank", "1"))
    try:
        with RemoteServer(*_engine_node_args(small_model, rpc)) as node0:
            node0.wait_ready()
            _kill_group(node1)  # the engine node's launcher and its children, as a crash
            start = time.monotonic()
            r = httpx.post(
                f"{node0.url}/v1/completions",
                json={"model": str(small_model), "prompt": "Hi", "max_tokens": 4},
                headers={"X-data-parallel-rank": "1"},
                timeout=30,
            )
            assert r.status_code >= 500, r.text
            assert node0.popen.wait(30) == 1
            assert time.monotonic() - start < 20
            assert "engine node" in node0.log and "shutting the server down" in node0.log
            assert not node0.processes()  # no orphans
    finally:
        _kill_group(node1)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--headless"], "--headless runs part of a server on another machine"),
        (["-dpl", "1", "-dpr", "1"], "give --data-parallel-start-rank only with --headless"),
        (["-dpl", "2", "-dpr", "1", "--headless"], "goes past --data-parallel-size 2"),
        (["-tp", "2", "--nnodes", "2", "--master-port", "29500"], "use --data-parallel-size-local"),
        (["--retry-waiting-on-restart"], "--retry-waiting-on-restart needs --restart-on-failure"),
        (["--enable-log-outputs"], "--enable-log-outputs needs --enable-log-requests"),
        (
            ["-dpl", "1", "-dpr", "1", "--headless", "--restart-on-failure"],
            "--restart-on-failure restarts the engine processes of a one-machine server",
        ),
    ],
)
def test_engine_node_flags_are_checked(small_model: Path, extra: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", "serve", "--model", str(small_model),
         "--load-format", "dummy", "-dp", "2", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and message in out.stderr, out.stderr
