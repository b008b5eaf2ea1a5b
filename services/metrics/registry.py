"""prometheus_client in multiprocess mode: one private directory per server, one scrape for all.

Every process of a server writes its samples to memory-mapped files in the
directory named by ``PROMETHEUS_MULTIPROC_DIR``; the api_server's ``/metrics``
merges them (``render_latest``). prometheus_client reads that variable when it
is first imported, so the launcher creates the directory and sets the variable
(``create_multiproc_dir``) before it starts any child; the children inherit it.

Metrics are created with ``registry=None``: in multiprocess mode the files, not
a registry, carry the values, and a second instance (tests) must not collide.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.config import ServeConfig

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LABEL_NAMES = ("model_name", "engine")  # on every series, as vLLM's

# Our own timings per request / batch / step: from 50 us to 10 s.
STEP_TIME_BUCKETS = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
)  # fmt: skip


def create_multiproc_dir() -> Path:
    """Make a private (0700) directory and point ``PROMETHEUS_MULTIPROC_DIR`` at it.

    Call before starting children (they inherit the environment) and before this
    process imports prometheus_client, if it ever does.
    """
    path = Path(tempfile.mkdtemp(prefix="actorserve-metrics-"))
    os.environ[MULTIPROC_ENV] = str(path)
    return path


def remove_multiproc_dir(path: Path) -> None:
    """Delete the directory made by ``create_multiproc_dir`` and unset the variable."""
    shutil.rmtree(path, ignore_errors=True)
    if os.environ.get(MULTIPROC_ENV) == str(path):
        del os.environ[MULTIPROC_ENV]


def forget_process_gauges(pid: int) -> None:
    """A process that is gone for good (an engine restart): drop its gauges. Its counters
    and histograms stay (their sums must not go back); a gauge of a dead process would
    otherwise stay on ``/metrics`` beside its successor's wherever their labels differ
    (``vllm:cache_config_info{num_gpu_blocks}`` measured again)."""
    if folder := os.environ.get(MULTIPROC_ENV):
        for path in Path(folder).glob(f"gauge_*_{pid}.db"):
            with contextlib.suppress(OSError):
                path.unlink()


def label_values(config: ServeConfig, engine_index: int = 0) -> tuple[str, str]:
    """The (model_name, engine) label values every series of this server carries."""
    names = config.served_model_names
    return (names[0] if names else "", str(engine_index))


REMOTE_METRICS_SUFFIX = ".prom"  # engine nodes' exposition text, kept in the same directory


def render_latest() -> tuple[bytes, str]:
    """The exposition text of every process's metrics (this one's alone without the
    directory), and of the engine nodes' processes on other machines (their latest text,
    which node 0's launcher keeps beside the ``.db`` files)."""
    from prometheus_client import (
        CONTENT_TYPE_LATEST,
        REGISTRY,
        CollectorRegistry,
        generate_latest,
        multiprocess,
    )

    registry = REGISTRY
    if folder := os.environ.get(MULTIPROC_ENV):
        local = CollectorRegistry()
        multiprocess.MultiProcessCollector(local)
        registry = local
        if remote := sorted(Path(folder).glob(f"*{REMOTE_METRICS_SUFFIX}")):
            registry = CollectorRegistry()
            registry.register(_WithRemote(local, remote))
    return generate_latest(registry), CONTENT_TYPE_LATEST


class _WithRemote:
    """This machine's families with the engine nodes' samples merged in, one family per
    name (the exposition format allows each name once)."""

    def __init__(self, local: Any, remote: list[Path]) -> None:
        self.local = local
        self.remote = remote

    def collect(self) -> Any:
        from prometheus_client.parser import text_string_to_metric_families

        families: dict[str, Any] = {}
        sources = [self.local.collect()]
        for path in self.remote:
            with contextlib.suppress(FileNotFoundError):
                sources.append(text_string_to_metric_families(path.read_text()))
        for source in sources:
            for family in source:
                if (have := families.get(family.name)) is None:
                    families[family.name] = family
                else:
                    have.samples.extend(family.samples)
        return iter(families.values())


def observe_many(histogram_child: object, values: Sequence[float]) -> None:
    """``observe`` each value, in one pass: one write per touched bucket, not per value.

    ``histogram_child`` is a labelled ``prometheus_client.Histogram``. Writes to
    its bucket and sum values directly (what ``observe`` does one value at a
    time); a per-token series (inter-token latency) is recorded this way.
    """
    if not values:
        return
    from bisect import bisect_left

    h = histogram_child
    bounds = h._upper_bounds  # type: ignore[attr-defined]
    counts = [0] * len(bounds)
    for v in values:
        counts[bisect_left(bounds, v)] += 1
    buckets = h._buckets  # type: ignore[attr-defined]
    for i, n in enumerate(counts):
        if n:
            buckets[i].inc(n)
    h._sum.inc(sum(values))  # type: ignore[attr-defined]
