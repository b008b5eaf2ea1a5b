"""A real ``actorserve serve`` in a subprocess, for end-to-end and fault tests.

``RemoteServer`` starts the launcher in its own session, so the launcher's pid
is also the process group of every child (children never change group, even
once re-parented after the launcher dies). That gives a robust definition of
"our processes": every live, non-zombie process in that group. ``close()``
SIGKILLs the whole group, so a failing test never leaks processes into the
next one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
# Small and fast to start: a 256 MiB KV pool and 2048-token requests.
SMALL_SERVER_ARGS = ("--kv-cache-memory-bytes", "256MiB", "--max-model-len", "2048")
START_TIMEOUT_S = 240.0  # two busy, shared cores: start-up is slow but must not flake


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RemoteServer:
    """``actorserve serve`` on a free port; ``close()`` leaves no process of it behind.

    Contract: after ``wait_ready()`` the server answers ``/health`` with 200 and
    ``children()`` maps each role (worker, scheduler, ...) to its pid.
    """

    def __init__(
        self, *extra_args: str, env: dict[str, str] | None = None, port: int | None = None
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="actorserve-test-", suffix=".log")  # noqa: SIM115 - closed by close()
        cmd = [
            sys.executable,
            "-m",
            "launch.cli",
            "serve",
            "--port",
            str(self.port),
            *SMALL_SERVER_ARGS,
            *extra_args,
        ]
        self.popen = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
            start_new_session=True,  # pgid == launcher pid: see the module docstring
        )
        self.pgid = self.popen.pid

    @property
    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> RemoteServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"server exited with {self.popen.returncode}:\n{self.log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.25)
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s:\n{self.log}")

    def processes(self) -> list[psutil.Process]:
        """Every live (non-zombie) process of this server: the launcher's process group."""
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getpgid(p.pid) == self.pgid and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
        return found

    def children(self) -> dict[str, int]:
        """Role -> pid of each child (``python -m launch.child ROLE``); first one per role."""
        roles: dict[str, int] = {}
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                cmd = p.cmdline()
                if "launch.child" in cmd:
                    roles.setdefault(cmd[cmd.index("launch.child") + 1], p.pid)
        return roles

    def wait_exit(self, timeout_s: float) -> int | None:
        """The launcher's exit code, or None if it is still running after ``timeout_s``."""
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def wait_all_gone(self, timeout_s: float) -> list[psutil.Process]:
        """Wait until no process of the group is left; return the leftovers (empty if none)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.popen.poll()  # reap the launcher so it does not linger as a zombie
            left = self.processes()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def close(self) -> None:
        """SIGKILL whatever is left of the group; never raises."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        self.wait_all_gone(5.0)
        self._log.close()

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tool_calling_server() -> Iterator[RemoteServer]:
    """A ready server on the default model with auto tool choice (hermes), for a
    module-scoped fixture to ``yield from``."""
    with RemoteServer(
        "--max-model-len", "1024", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"
    ) as server:
        server.wait_ready()
        yield server


def metric(server: RemoteServer, name: str, **labels: str) -> float | None:
    """A Prometheus sample from ``/metrics``, summed over the label sets that carry
    ``labels``; None if not exported."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " ")) and all(w in line for w in want)
    ]
    return sum(values) if values else None


def wait_metric(server: RemoteServer, name: str, value: float, timeout_s: float) -> bool:
    """Poll ``/metrics`` until ``name`` equals ``value``; False if ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while metric(server, name) != value:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def sse_chunks(body: str) -> list[dict]:
    """The JSON chunks of a streamed (SSE) response body, without the final ``[DONE]``."""
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]


@contextlib.contextmanager
def http_process(cmd: list[str], url: str, what: str, timeout_s: float = 60) -> Iterator[str]:
    """Run ``cmd`` (a router or proxy) until its ``url/health`` answers 200; yields ``url``
    and terminates it afterwards. Raises with its output if it exits or never gets healthy."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"{what} did not start:\n{log.read().decode()}")
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait(10)
