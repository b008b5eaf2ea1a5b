"""CUDA graphs for decode-only steps: each kernel launch of a step, recorded once, replayed.

A decode step launches a few hundred small kernels; launched one by one from Python the
host cannot keep up with the GPU (an 8B model: ~30 ms a step where its weights need 3.6 ms,
bench/RESULTS.md). So, as vLLM does by default, the model's forward over a decode-only
batch is captured at start-up for a set of batch sizes (``capture_sizes``: vLLM's
``--cuda-graph-sizes`` / ``--max-cudagraph-capture-size``, off with ``--enforce-eager``),
and a step of ``B`` requests replays the graph of the smallest size ``P >= B``, its inputs
padded (``step_inputs.py``). Steps with a prefill chunk, or larger than every captured
size, run eagerly. Logits and sampling stay outside the graph (a few launches, on the
sampled rows only).

What makes a forward capturable: its inputs live in buffers whose addresses never change
(``StepBuffers``), the attention backend derives its per-step state before the first layer
and from the graph's size alone (``MetadataBuilder``, e.g. the Triton kernels' split-KV
count), and nothing in it synchronises with the host or allocates outside the graph's
memory pool. The graphs share one pool and are captured largest first, as vLLM does.

``DecodeGraphs(..., capture=False)`` runs the same padded steps eagerly: how a CPU (which
has no graphs) tests the bucketing and padding, and a GPU compares the two.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import Any

import torch

from services.gpu_worker.attention import AttentionMetadata
from services.logging_utils import init_logger

logger = init_logger(__name__)

# vLLM's default largest captured batch.
DEFAULT_MAX_CAPTURE_SIZE = 512


def capture_sizes(
    cuda_graph_sizes: list[int] | None, max_capture_size: int | None, max_num_seqs: int
) -> list[int]:
    """The batch sizes to capture, ascending.

    As vLLM: no ``cuda_graph_sizes`` means 1, 2, 4, then steps of 8 up to
    ``max_capture_size`` (default ``min(512, max_num_seqs)``), which is itself captured so
    that every batch up to it has a graph; one value ``N`` means that pattern up to ``N``;
    several are the sizes. Sizes over ``max_capture_size`` or ``max_num_seqs`` (no decode
    batch is larger) are left out.
    """
    if cuda_graph_sizes is not None and len(cuda_graph_sizes) > 1:
        sizes = set(cuda_graph_sizes)
        cap = max_capture_size if max_capture_size is not None else max(sizes)
    else:
        if cuda_graph_sizes:
            top = cuda_graph_sizes[0]
        elif max_capture_size is not None:
            top = max_capture_size
        else:
            top = DEFAULT_MAX_CAPTURE_SIZE
        cap = min(top, max_capture_size if max_capture_size is not None else top, max_num_seqs)
        sizes = {s for s in (1, 2, 4) if s <= cap} | set(range(8, cap + 1, 8)) | {cap}
    return sorted(s for s in sizes if s <= min(cap, max_num_seqs))


def padded_size(sizes: list[int], num_reqs: int) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``num_reqs``; None when none does."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


# The forward a graph records: (input_ids, positions, attn_meta) -> hidden [P, H].
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """Captured decode forwards, by batch size.

    ``capture(size, input_ids, positions, meta, forward)`` records ``forward`` over
    inputs padded to ``size`` (the step buffers' views: later steps write new values into
    the same memory); ``replay(size)`` runs it again and returns its output rows. With
    ``capture=False`` nothing is recorded: ``replay`` calls the forward eagerly on the
    buffers' current values.
    """

    def __init__(self, sizes: list[int], *, capture: bool, generation: int) -> None:
        self.sizes = sizes
        self.capture_graphs = capture
        self.generation = generation  # of the step buffers the graphs read
        self._graphs: dict[int, Any] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._eager: dict[int, Callable[[], torch.Tensor]] = {}
        self._pool: Any = None

    def padded_size(self, num_reqs: int) -> int | None:
        return padded_size(self.sizes, num_reqs)

    def capture(
        self,
        size: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        forward: Forward,
    ) -> None:
        def run() -> torch.Tensor:
            return forward(input_ids, positions, meta)

        if not self.capture_graphs:
            self._eager[size] = run
            return
        # Warm-up outside the graph: lazy state (the rotary table, cuBLAS workspaces,
        # Triton's compiled kernels) is made before recording.
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = run()
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[size] = graph
        self._outputs[size] = out

    def replay(self, size: int) -> torch.Tensor:
        """The forward's output rows: valid until the next replay of any size (the graphs
        share one memory pool), so read them within the step."""
        if not self.capture_graphs:
            return self._eager[size]()
        self._graphs[size].replay()
        return self._outputs[size]


def capture_all(
    graphs: DecodeGraphs,
    capture_one: Callable[[int], None],
    device: torch.device,
) -> None:
    """``capture_one(size)`` for every size, largest first (later graphs reuse the pool's
    memory), logging the time and the device memory the graphs took."""
    start = time.perf_counter()
    cuda = device.type == "cuda" and graphs.capture_graphs
    free_before = torch.cuda.mem_get_info(device)[0] if cuda else 0
    for size in reversed(graphs.sizes):
        capture_one(size)
    if cuda:
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info(
            "captured CUDA graphs for %d decode batch sizes (%s) in %.1f s, %.2f GiB",
            len(graphs.sizes),
            _size_list(graphs.sizes),
            time.perf_counter() - start,
            used / (1 << 30),
        )


def _size_list(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{sizes[0]}..{sizes[-1]}"
