"""A step's model inputs, written into buffers allocated once (vLLM's ``CpuGpuBuffer``s).

Every step the model runner writes the batch's token ids, positions, cache slots, query
start offsets, context lengths, block table rows and the rows that sample into host arrays
allocated at start-up (pinned on CUDA), and copies each to its device twin with one
non-blocking copy. The tensors a step's ``AttentionMetadata`` holds are views of those
twins, so their addresses never change: a CUDA graph captured over them replays with the
next step's values (``cuda_graphs.py``). On a CPU host and device are one tensor, and
nothing is copied.

A step can be *padded* to a CUDA graph's batch size ``P`` (decode only: one token per
request): requests ``B..P-1`` then have no query token (``query_start_loc`` repeats the
real token count, ``seq_lens`` 0), and tokens ``B..P-1`` are padding (slot -1: their K/V
are dropped; id and position 0). The attention contract (``attention/base.py``) reads none
of them, and their output rows are discarded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.gpu_worker.attention import AttentionMetadata


class HostDeviceBuffer:
    """A host array (``np``, a view of ``cpu``) and its device twin ``device``, allocated once."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.device = (
            self.cpu if device.type == "cpu" else torch.zeros_like(self.cpu, device=device)
        )

    def copy_to_device(self, n: int) -> torch.Tensor:
        """The first ``n`` rows on the device, copied from the host without blocking."""
        if self.device is not self.cpu:
            self.device[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.device[:n]


@dataclass
class StepInputs:
    """What one forward pass takes, all views of the step buffers."""

    input_ids: torch.Tensor  # [T] int64 (T padded to the graph size, when padded)
    positions: torch.Tensor  # [T] int64
    attn_meta: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64: the rows of the output that sample
    num_tokens: int  # real tokens (the rest, if any, is padding)
    token_req: np.ndarray  # [real tokens] each token's request index
    positions_np: np.ndarray  # [real tokens] each token's position


class StepBuffers:
    """The step input buffers of one model runner, sized for ``max_num_reqs`` requests and
    ``max_num_tokens`` tokens a step (the scheduler's ``--max-num-seqs`` and
    ``--max-num-batched-tokens``) and ``max_blocks`` blocks a request.

    A step larger than that (a caller not bound by the scheduler's budget) grows them;
    ``generation`` then changes, and whatever was captured over the old ones is stale.
    """

    def __init__(
        self, max_num_reqs: int, max_num_tokens: int, max_blocks: int, device: torch.device
    ) -> None:
        self.device = device
        self.max_blocks = max_blocks
        self.generation = 0
        self._allocate(max_num_reqs, max_num_tokens)

    def _allocate(self, max_num_reqs: int, max_num_tokens: int) -> None:
        dev = self.device
        self.max_num_reqs, self.max_num_tokens = max_num_reqs, max_num_tokens
        self.input_ids = HostDeviceBuffer((max_num_tokens,), torch.int64, dev)
        self.positions = HostDeviceBuffer((max_num_tokens,), torch.int64, dev)
        self.slot_mapping = HostDeviceBuffer((max_num_tokens,), torch.int64, dev)
        self.query_start_loc = HostDeviceBuffer((max_num_reqs + 1,), torch.int32, dev)
        self.seq_lens = HostDeviceBuffer((max_num_reqs,), torch.int32, dev)
        self.block_table = HostDeviceBuffer((max_num_reqs, self.max_blocks), torch.int32, dev)
        self.logits_indices = HostDeviceBuffer((max_num_reqs,), torch.int64, dev)
        # The last step's copies: the host arrays are not rewritten before they are done.
        self._copied: torch.cuda.Event | None = None
        self._event = torch.cuda.Event() if self.device.type == "cuda" else None

    def reserve(self, num_reqs: int, num_tokens: int) -> None:
        if num_reqs <= self.max_num_reqs and num_tokens <= self.max_num_tokens:
            return
        self._wait_copies()
        self._allocate(max(num_reqs, self.max_num_reqs), max(num_tokens, self.max_num_tokens))
        self.generation += 1

    def _wait_copies(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def prepare(
        self,
        rows: np.ndarray,
        computed: np.ndarray,
        scheduled: np.ndarray,
        block_table: np.ndarray,
        block_size: int,
        *,
        token_ids: np.ndarray | None = None,
        sampling: np.ndarray | None = None,
        pad_to: int | None = None,
        max_seq_len: int | None = None,
    ) -> StepInputs:
        """Inputs for requests computing ``scheduled[b]`` tokens after their first
        ``computed[b]``, whose blocks are ``block_table[rows[b]]`` and known tokens
        ``token_ids[rows[b]]`` (None: ids left 0, for callers that feed their own); ``sampling``
        indexes the requests whose last scheduled token samples. ``pad_to``: pad a
        decode-only step to that many requests (a CUDA graph's size; the block table then
        keeps its full width, the tensors' shapes depending on ``pad_to`` alone);
        ``max_seq_len`` then overrides the metadata's (the graph's split-KV choice)."""
        num_reqs = len(scheduled)
        num_tokens = int(scheduled.sum())
        padded_reqs = pad_to if pad_to is not None else num_reqs
        padded_tokens = pad_to if pad_to is not None else num_tokens
        if pad_to is not None and (num_tokens != num_reqs or pad_to < num_reqs):
            raise ValueError(f"only a decode step of at most {pad_to} requests pads to {pad_to}")
        self.reserve(padded_reqs, padded_tokens)
        self._wait_copies()

        qsl = self.query_start_loc.np
        qsl[0] = 0
        np.cumsum(scheduled, out=qsl[1 : num_reqs + 1])
        qsl[num_reqs + 1 : padded_reqs + 1] = num_tokens
        seq_lens = computed + scheduled
        self.seq_lens.np[:num_reqs] = seq_lens
        self.seq_lens.np[num_reqs:padded_reqs] = 0
        token_req = np.repeat(np.arange(num_reqs), scheduled)
        positions = computed[token_req] + np.arange(num_tokens) - qsl[token_req]
        self.positions.np[:num_tokens] = positions
        self.positions.np[num_tokens:padded_tokens] = 0
        max_seq = int(seq_lens.max())
        width = -(-max_seq // block_size)
        table = self.block_table.np
        table[:num_reqs, :width] = block_table[rows, :width]
        slots = self.slot_mapping.np
        slots[:num_tokens] = table[token_req, positions // block_size]
        slots[:num_tokens] *= block_size
        slots[:num_tokens] += positions % block_size
        slots[num_tokens:padded_tokens] = -1
        ids = self.input_ids.np
        if token_ids is not None:
            ids[:num_tokens] = token_ids[rows[token_req], positions]
        ids[num_tokens:padded_tokens] = 0
        num_sampling = 0
        if sampling is not None:
            num_sampling = len(sampling)
            self.logits_indices.np[:num_sampling] = qsl[1:][sampling] - 1

        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc.copy_to_device(padded_reqs + 1),
            seq_lens=self.seq_lens.copy_to_device(padded_reqs),
            block_table=self.block_table.copy_to_device(padded_reqs)[
                :, : (self.max_blocks if pad_to is not None else width)
            ],
            slot_mapping=self.slot_mapping.copy_to_device(padded_tokens),
            max_query_len=int(scheduled.max()),
            max_seq_len=max_seq if max_seq_len is None else max_seq_len,
            query_start_loc_cpu=self.query_start_loc.cpu[: padded_reqs + 1],
            seq_lens_cpu=self.seq_lens.cpu[:padded_reqs],
        )
        inputs = StepInputs(
            input_ids=self.input_ids.copy_to_device(padded_tokens),
            positions=self.positions.copy_to_device(padded_tokens),
            attn_meta=meta,
            logits_indices=self.logits_indices.copy_to_device(num_sampling),
            num_tokens=num_tokens,
            token_req=token_req,
            positions_np=positions,
        )
        if self._event is not None:
            self._event.record()
            self._copied = self._event
        return inputs


def build_attention_metadata(
    computed: np.ndarray,
    scheduled: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    device: torch.device,
) -> tuple[AttentionMetadata, np.ndarray, np.ndarray]:
    """Metadata for requests computing ``scheduled[b]`` tokens after ``computed[b]``, with
    ``block_table[b]`` their blocks; also each token's request index and position. In
    buffers of its own, sized for this batch (for tests, benchmarks and profiling; the
    model runner keeps its ``StepBuffers``)."""
    num_reqs, num_tokens = len(scheduled), int(scheduled.sum())
    buffers = StepBuffers(num_reqs, num_tokens, block_table.shape[1], device)
    inputs = buffers.prepare(np.arange(num_reqs), computed, scheduled, block_table, block_size)
    return inputs.attn_meta, inputs.token_req, inputs.positions_np
