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

from services.engine import LLM, SamplingParams
from tests.server_utils import REPO, RemoteServer, free_port

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
