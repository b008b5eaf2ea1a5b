"""Starting, watching and stopping the engine's child processes, with no orphans.

Each child is a fresh interpreter (``python -m <module>``), not a fork: no
inherited locks or CUDA state, and no pickle — its configuration arrives as
msgspec JSON on stdin. Two independent guards make sure a child never outlives
the launcher, even after ``kill -9`` of the launcher:

- the Linux parent-death signal (``PR_SET_PDEATHSIG``), set before exec, kills
  the child with SIGKILL when the launcher thread that forked it dies;
- a death pipe: the launcher holds the write end, the child a thread blocked on
  the read end; EOF (the launcher is gone, however it died) ends the child.

The launcher stops a child with ``STOP_SIGNAL`` (SIGUSR1), not SIGTERM: a SIGTERM to
the whole process group (``timeout``, systemd's ``KillMode=control-group``,
``kill -TERM -PGID``) reaches every child at the same moment as the launcher, and it
is the launcher's to act on (it drains, then stops its children in turn). A child
therefore ignores SIGTERM while its launcher lives (``launch/child.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from services.ipc import STOP_SIGNAL

DEATH_FD_ENV = "ACTORSERVE_DEATH_FD"
_PR_SET_PDEATHSIG = 1


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None  # not Linux: the death pipe still guards


# Loaded here, in the launcher: a dlopen between fork and exec could deadlock on
# a loader lock held by another launcher thread (ZeroMQ's I/O threads) at fork.
_LIBC = _load_libc()


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    expected_exit: bool = False


@dataclass
class ProcessGroup:
    """The launcher's children. Not thread-safe: use from the launcher's supervising thread."""

    children: list[Child] = field(default_factory=list)
    # The parent-death signal fires when the *thread* that started a child ends: right for
    # the launcher (one thread for the server's life), wrong for an offline LLM built in a
    # worker thread; the death pipe alone still guards against the process dying.
    pdeathsig: bool = True
    # The placement groups of ranks that are Ray actors (launch/ray_ranks.py), if any
    ray_ranks: Any = None
    _death_r: int = -1
    _death_w: int = -1

    def __post_init__(self) -> None:
        self._death_r, self._death_w = os.pipe()
        os.set_inheritable(self._death_r, True)

    def start(
        self,
        name: str,
        module: str,
        config_json: bytes,
        extra_env: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
    ) -> Child:
        """Run ``python -m module *args`` with ``config_json`` on its stdin."""
        env = dict(os.environ, **(extra_env or {}))
        env[DEATH_FD_ENV] = str(self._death_r)
        popen = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE,
            env=env,
            pass_fds=(self._death_r,),
            preexec_fn=_set_pdeathsig if self.pdeathsig else None,
            start_new_session=False,
        )
        assert popen.stdin is not None
        try:
            popen.stdin.write(config_json)
            popen.stdin.close()
        except BrokenPipeError:
            pass  # it died before reading its configuration: first_dead() reports it
        child = Child(name, popen)
        self.children.append(child)
        return child

    def first_dead(self) -> Child | None:
        """A child that exited without being asked to, if any: one killed by a signal first.
        When a rank is killed, its peers fail their next collective and exit with an error
        soon after; by the time anyone looks, several are dead, and the cause is the one
        to name."""
        dead = [c for c in self.children if c.popen.poll() is not None and not c.expected_exit]
        return min(dead, key=lambda c: c.popen.returncode >= 0, default=None)

    def first_stopped(self) -> Child | None:
        """A live child that is stopped (SIGSTOP, SIGTSTP): alive but silent, so
        whatever waits on it would wait forever. Read from ``/proc`` (Linux); elsewhere
        never."""
        for child in self.children:
            if child.popen.poll() is None and _is_stopped(child.popen.pid):
                return child
        return None

    def stop(self, children: list[Child], timeout: float = 5.0) -> None:
        """``STOP_SIGNAL`` to these children (and SIGCONT, so a stopped one handles it),
        wait up to ``timeout`` seconds, then SIGKILL the rest."""
        for child in children:
            child.expected_exit = True
            if child.popen.poll() is None:
                child.popen.send_signal(STOP_SIGNAL)
                child.popen.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + timeout
        for child in children:
            try:
                child.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.popen.kill()
                child.popen.wait()

    def stop_all(self, timeout: float = 5.0) -> None:
        """``stop`` every child, then close the death pipe."""
        self.stop(self.children, timeout)
        if self.ray_ranks is not None:
            self.ray_ranks.close()
        # Close once: a second stop_all must not close whatever reused the numbers.
        for fd in (self._death_r, self._death_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._death_r = self._death_w = -1


def _is_stopped(pid: int) -> bool:
    """``/proc/PID/stat``'s state is T: stopped by a signal (not t, a tracer's brief stop:
    py-spy or strace on a child must not bring the server down)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"T"


def watch_parent() -> None:
    """In a child: exit at once when the launcher is gone (death-pipe EOF)."""
    fd_text = os.environ.get(DEATH_FD_ENV)
    if fd_text is None:
        return
    fd = int(fd_text)

    def wait_for_eof() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        os._exit(1)

    threading.Thread(target=wait_for_eof, name="death-pipe", daemon=True).start()
