"""The engine's clock: real time, or simulated time under ``--worker-backend sim
--sim-speed S`` (simulated seconds = real seconds / S).

Every time the engine reports (request timings, step and batch times, throughput,
the stats line, timestamps of arrivals) is read from here, so that with the simulated
backend all of them are in simulated seconds. The scale applies to everything in the
simulated world, our own processes' CPU time included: at ``--sim-speed 0.1`` the
device is ten times faster than real and so, relative to it, is nothing else, so a
millisecond of scheduler work reads as ten. Measure engine overhead at ``--sim-speed 1``.

Timeouts and waits (sockets, start-up, drains) stay in real time: they use ``time``.

The launcher sets ``ACTORSERVE_SIM_SPEED`` and ``ACTORSERVE_SIM_EPOCH`` (the real time
simulated time starts from, so that every process's wall clock agrees) for its children;
an offline engine calls ``set_sim_speed``.
"""

from __future__ import annotations

import os
import time

SPEED_ENV = "ACTORSERVE_SIM_SPEED"
EPOCH_ENV = "ACTORSERVE_SIM_EPOCH"

_scale = 1.0 / float(os.environ.get(SPEED_ENV) or 1.0)
_epoch = float(os.environ.get(EPOCH_ENV) or time.time())


def set_sim_speed(speed: float, epoch: float | None = None) -> dict[str, str]:
    """Scale this process's clock; returns the environment that scales a child's the same."""
    global _scale, _epoch
    _scale = 1.0 / speed
    _epoch = time.time() if epoch is None else epoch
    return {SPEED_ENV: repr(speed), EPOCH_ENV: repr(_epoch)}


def monotonic() -> float:
    """``time.monotonic()``, in simulated seconds (for intervals)."""
    return time.monotonic() * _scale


def perf_counter() -> float:
    """``time.perf_counter()``, in simulated seconds (for short intervals)."""
    return time.perf_counter() * _scale


def real_seconds(simulated: float) -> float:
    """A span of simulated seconds in real ones (for a wait that must end on time)."""
    return simulated / _scale


def wall() -> float:
    """``time.time()``: real at the epoch, advancing in simulated seconds after it."""
    return _epoch + (time.time() - _epoch) * _scale
