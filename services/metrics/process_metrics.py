"""Our own per-process series (``actorserve:*``): where each process spends its time.

One factory per process kind, called once at that process's start-up. Each
series carries ``model_name`` and ``engine`` as vLLM's do. Histograms of
seconds use ``STEP_TIME_BUCKETS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from services.config import ServeConfig
from services.metrics.registry import LABEL_NAMES, STEP_TIME_BUCKETS, label_values


def _histogram(
    config: ServeConfig, name: str, doc: str, engine_index: int = 0, **extra_labels: str
) -> Any:
    labels = (*LABEL_NAMES, *extra_labels)
    return Histogram(name, doc, labels, buckets=STEP_TIME_BUCKETS, registry=None).labels(
        *label_values(config, engine_index), *extra_labels.values()
    )


def tokenizer_time(config: ServeConfig) -> Any:
    """``actorserve:tokenizer_time_seconds``: chat template + tokenization of one request."""
    return _histogram(config, "actorserve:tokenizer_time_seconds",
                      "Time the tokenizer process spent on one request.")  # fmt: skip


def detokenizer_time(config: ServeConfig) -> Any:
    """``actorserve:detokenizer_batch_time_seconds``: one batch of incoming tokens to text."""
    return _histogram(config, "actorserve:detokenizer_batch_time_seconds",
                      "Time the detokenizer process spent on one batch of engine outputs.")  # fmt: skip


def worker_forward_time(config: ServeConfig, rank: int = 0, engine_index: int = 0) -> Any:
    """``actorserve:worker_forward_time_seconds{rank}``: one StepPlan executed by worker
    rank ``rank`` (its collectives' waits included)."""
    return _histogram(config, "actorserve:worker_forward_time_seconds",
                      "Time a worker rank spent executing one step (inputs, forward, sampling).",
                      engine_index, rank=str(rank))  # fmt: skip


def device_seconds(config: ServeConfig, rank: int = 0, engine_index: int = 0) -> Any:
    """``actorserve:device_seconds_total{rank,state}``: the modelled device's busy and idle
    time (simulated backend only): idle is time it waited for the engine's next plan."""
    counter = Counter("actorserve:device_seconds", "Modelled device time by state (sim backend).",
                      (*LABEL_NAMES, "rank", "state"), registry=None)  # fmt: skip
    labels = label_values(config, engine_index)
    return {s: counter.labels(*labels, str(rank), s) for s in ("busy", "idle")}


def expert_tokens(config: ServeConfig, engine_index: int = 0) -> Any:
    """``actorserve:expert_tokens_total{expert,ep_rank}``: (token, expert) pairs the router
    sent to each expert, over every MoE layer; ``ep_rank``: the rank holding it (0 without
    expert parallelism). Reported once per engine core (once for all of them in lock-step)."""
    return Counter("actorserve:expert_tokens", "Tokens routed to each expert (all MoE layers).",
                   (*LABEL_NAMES, "expert", "ep_rank"), registry=None), label_values(
                       config, engine_index)  # fmt: skip


def api_requests(model_name: str, engine_index: int = 0) -> Any:
    """``actorserve:api_requests``: engine requests the api_server sent (one per choice)."""
    return Counter("actorserve:api_requests", "Engine requests sent by the api_server.",
                   LABEL_NAMES, registry=None).labels(model_name, str(engine_index))  # fmt: skip


RECOVERY_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def engine_restarts(model_name: str) -> Callable[[float], None]:
    """``actorserve:engine_restarts`` (``--restart-on-failure``) and
    ``actorserve:engine_recovery_seconds``, from an engine process's death to every process
    of the new engine ready; returns the function that records one restart."""
    labels = (model_name, "0")
    restarts = Counter("actorserve:engine_restarts", "Engine groups restarted after a failure.",
                       LABEL_NAMES, registry=None).labels(*labels)  # fmt: skip
    recovery = Histogram("actorserve:engine_recovery_seconds",
                         "Seconds from an engine process's death to the new engine serving.",
                         LABEL_NAMES, buckets=RECOVERY_BUCKETS, registry=None).labels(*labels)  # fmt: skip

    def record(seconds: float) -> None:
        restarts.inc()
        recovery.observe(seconds)

    return record


class SchedulerLoopMetrics:
    """The scheduler's busy loop: time per step, time idle, bytes sent on each socket.

    Also ``actorserve:max_num_seqs`` (constant), the line to plot
    ``vllm:num_requests_running`` against.
    """

    def __init__(self, config: ServeConfig, engine_index: int = 0) -> None:
        lv = label_values(config, engine_index)
        Gauge(
            "actorserve:max_num_seqs", "The --max-num-seqs limit on running requests.",
            LABEL_NAMES, multiprocess_mode="mostrecent", registry=None,
        ).labels(*lv).set(config.engine.scheduler.max_num_seqs)  # fmt: skip
        self.step_time = _histogram(
            config, "actorserve:scheduler_step_time_seconds",
            "Scheduler time per engine step, not counting the wait for the workers.",
            engine_index,
        )  # fmt: skip
        self.idle_seconds = Counter(
            "actorserve:scheduler_idle_seconds",
            "Seconds the scheduler's busy loop waited for work; rate() is its idle share.",
            LABEL_NAMES, registry=None,
        ).labels(*lv)  # fmt: skip
        self._socket_bytes = Counter(
            "actorserve:socket_sent_bytes",
            "Bytes the scheduler sent, by socket; divided by steps, bytes per step.",
            (*LABEL_NAMES, "socket"), registry=None,
        )  # fmt: skip
        self._labels = lv

    def count_sent_bytes(self, sock: Any, name: str) -> None:
        """Count every frame ``sock`` (a ``services.ipc`` sender) sends, under ``socket=name``."""
        child = self._socket_bytes.labels(*self._labels, name)
        encoding = sock._encoding
        frame = encoding.frame

        def counted(msg: object) -> tuple[bytearray, bool]:
            buf, copy = frame(msg)
            child.inc(len(buf))
            return buf, copy

        encoding.frame = counted
