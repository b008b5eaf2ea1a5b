"""Data-parallel engine cores in lock-step through the MoE layers (expert parallelism).

With ``--enable-expert-parallel`` and ``--data-parallel-size`` > 1 the experts of every
MoE layer are spread over the ranks of every engine core, so each forward needs every
engine core's ranks in the same collectives. Each engine core still schedules its own
requests; its worker ranks agree before each step (``DPLockstep.agree``, one small
all-reduce over a gloo group of every rank) on who has a plan and how many tokens it
holds. A step runs when some engine core has tokens; a rank whose engine core has none
runs the MoE layers with no tokens of its own (``WorkerBackend.execute_dummy``, vLLM's
dummy forward), so no rank waits forever in a collective for an idle one.

The ranks of one engine core receive its plans on their own sockets, not at the same
instant: a step runs only when, for every engine core, all of its ranks or none have its
next plan; otherwise the ranks that have it hold it and agree again.

Idle, a rank waits up to ``poll_s`` for a plan before it joins the next agreement: 1 ms
while steps keep coming, 10 ms after half a second without one, 50 ms after five seconds:
the most a request waits for an idle server's ranks to gather, against the CPU an idle rank
spends on agreements (measured: ~11% of a core at 10 ms, ~2% at 50 ms).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from services.gpu_worker.base import WorkerBackend
from services.gpu_worker.distributed import ParallelState
from services.protocol import StepPlan, StepResult

# (seconds since the last step, wait for a plan): the first row whose age is passed.
POLL_S = ((5.0, 0.05), (0.5, 0.01), (0.0, 0.001))


@dataclass(frozen=True)
class StepAgreement:
    """What every rank learned: each engine core's tokens this step (engine order)."""

    num_tokens: tuple[int, ...]

    @property
    def any_tokens(self) -> bool:
        return any(self.num_tokens)


class DPLockstep:
    """The per-step agreement of every rank of every engine core (``parallel.step_group``)."""

    def __init__(self, parallel: ParallelState) -> None:
        self.parallel = parallel
        self._vector = torch.zeros(2 * parallel.dp_size, dtype=torch.int64)
        self._last_step = time.monotonic()

    @property
    def poll_s(self) -> float:
        """How long a rank without a plan waits for one before the next agreement."""
        idle = time.monotonic() - self._last_step
        return next(wait for after, wait in POLL_S if idle >= after)

    def agree(self, plan: StepPlan | None) -> StepAgreement | None:
        """One agreement (every rank calls it the same number of times); the step to run,
        or None: nothing to run, or some engine core's ranks do not all have its plan yet."""
        p, v = self.parallel, self._vector
        dp = p.dp_size
        v.zero_()
        if plan is not None:
            v[p.dp_rank] = 1
            v[dp + p.dp_rank] = plan.total_num_scheduled_tokens
        dist.all_reduce(v, group=p.step_group)
        have = v[:dp].tolist()
        if any(have):
            self._last_step = time.monotonic()  # busy: poll fast again
        if not any(have) or any(0 < h < p.tp_size for h in have):
            return None
        return StepAgreement(tuple(int(t) // p.tp_size for t in v[dp:].tolist()))


def wait_for_every_rank(parallel: ParallelState, timeout_s: float, what: str) -> None:
    """A barrier of every engine core's ranks (the first agreement, a start-up profile's
    collectives) with start-up's timeout: engines may finish loading minutes apart, longer
    than ``--distributed-timeout`` allows a step's collective to wait."""
    try:
        dist.monitored_barrier(parallel.step_group, timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise RuntimeError(
            f"engine {parallel.dp_rank} rank {parallel.tp_rank}: the other engine cores' "
            f"ranks did not reach {what} within {timeout_s:.0f} s ({e})"
        ) from None


def run_agreed_step(
    worker: WorkerBackend, agreement: StepAgreement, plan: StepPlan | None, dp_rank: int
) -> StepResult | None:
    """This rank's part of an agreed step: its engine's plan (if it has one), and the MoE
    layers with no tokens of its own when its engine has none and another has some."""
    worker.begin_dp_step(agreement.num_tokens)
    result = worker.execute(plan) if plan is not None else None
    if agreement.num_tokens[dp_rank] == 0 and agreement.any_tokens:
        worker.execute_dummy()
    return result
