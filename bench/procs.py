"""Servers and routers as child processes, for the experiments that start fresh ones.

``ServerProcess(*args)`` runs ``actorserve serve`` on a free loopback port in its own
process group (``close()`` ends all of it), optionally pinned to CPU cores with
``taskset`` (``pin="0"``); ``RouterProcess`` runs ``actorserve router`` in front of them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.metrics import parse_prometheus

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Process:
    """A command in its own session, logging to a temporary file."""

    def __init__(
        self, cmd: list[str], pin: str | None = None, name: str = "proc", cwd: Path = REPO
    ) -> None:
        if pin is not None:
            if shutil.which("taskset") is None:
                raise RuntimeError("pinning needs taskset (util-linux)")
            cmd = ["taskset", "-c", pin, *cmd]
        self.port = int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)  # noqa: SIM115
        self.popen = subprocess.Popen(cmd, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip

    def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"exited: {Path(self.log.name).read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(
            f"not ready after {timeout_s:.0f} s: {Path(self.log.name).read_text()[-2000:]}"
        )

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples summed over label sets."""
        return parse_prometheus(httpx.get(f"{self.url}/metrics", timeout=30).text)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


class ServerProcess(_Process):
    """``actorserve serve ARGS`` on a free port."""

    def __init__(self, *args: str, pin: str | None = None) -> None:
        cmd = [sys.executable, "-m", "launch.cli", "serve", "--port", str(free_port()), *args]
        super().__init__(cmd, pin, "serve")


class RouterProcess(_Process):
    """``actorserve router --backend URL... ARGS`` on a free port."""

    def __init__(self, backends: list[str], *args: str, pin: str | None = None) -> None:
        cmd = [sys.executable, "-m", "launch.cli", "router", "--port", str(free_port()), *args]
        for url in backends:
            cmd += ["--backend", url]
        super().__init__(cmd, pin, "router")
