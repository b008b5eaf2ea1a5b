"""The worker's persistent batch: every live request's tokens and block table, by row.

A ``NewRequest`` is added once and gets a row in host-side numpy arrays; later
steps only append block ids and sampled tokens. Step inputs are gathered from the
arrays with vectorised indexing, never per token in Python.

Sampling parameters live in per-row arrays too (filled once in ``add``). Each step the
sampling rows' values are gathered into one host staging buffer (pinned on CUDA) and sent
to the device in one non-blocking copy: the common path (greedy, temperature, top-k/top-p,
min-p, seeds) makes no device allocation and no synchronising host->device copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.gpu_worker.sampler import Penalties, SamplingMetadata
from services.protocol import NewRequest, RunningRequestDelta, SamplingParams


@dataclass
class CachedRequestState:
    """What the worker knows of one live request; ``row`` indexes the batch arrays."""

    req_id: str
    row: int
    num_prompt_tokens: int
    num_tokens: int  # known tokens: prompt + outputs sampled so far
    num_computed_tokens: int
    num_blocks: int
    sampling: SamplingParams
    eos_token_id: int | None
    generator: torch.Generator | None
    allowed_ids: torch.Tensor | None = None  # allowed_token_ids inside the vocab, built once


class InputBatch:
    """Live requests keyed by req_id, with their token ids and block tables in rows.

    ``token_ids[row, :num_tokens]`` are the request's known tokens and
    ``block_table[row, :num_blocks]`` its physical blocks. Rows are recycled when a
    request leaves and the arrays grow when more requests are live than rows.
    """

    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device
    ):
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        # +1: the token sampled at the last position is stored before the scheduler stops it.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int32)
        self.block_table = np.zeros(
            (max_num_reqs, -(-(max_model_len + 1) // block_size)), dtype=np.int32
        )
        self.requests: dict[str, CachedRequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        # Per-row sampling parameters, written in add(); a recycled row is overwritten whole.
        self.temperature_cpu = np.ones(max_num_reqs, dtype=np.float32)  # 1.0 on greedy rows
        self.greedy_cpu = np.zeros(max_num_reqs, dtype=np.bool_)
        self.top_k_cpu = np.zeros(max_num_reqs, dtype=np.int64)  # <= 0: disabled
        self.top_p_cpu = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p_cpu = np.zeros(max_num_reqs, dtype=np.float32)
        self.seeded_cpu = np.zeros(max_num_reqs, dtype=np.bool_)  # has its own generator
        # The rare paths, so that a step whose rows use none of them skips them without
        # looking at each request's parameters.
        self.penalized_cpu = np.zeros(max_num_reqs, dtype=np.bool_)
        self.min_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int64)
        self.bad_words_cpu = np.zeros(max_num_reqs, dtype=np.bool_)
        self.token_limits_cpu = np.zeros(max_num_reqs, dtype=np.bool_)  # logit_bias / allowed
        self.logprobs_cpu = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: none asked
        self._staging = _SamplingStaging(max_num_reqs, device)

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, new: NewRequest) -> None:
        if new.req_id in self.requests:
            raise ValueError(f"request {new.req_id!r} is already in the batch")
        num_tokens = len(new.token_ids)
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"request {new.req_id!r} has {num_tokens} tokens, over max_model_len={self.max_model_len}"
            )
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self.token_ids[row, :num_tokens] = new.token_ids
        state = CachedRequestState(
            req_id=new.req_id,
            row=row,
            num_prompt_tokens=new.num_prompt_tokens,
            num_tokens=num_tokens,
            num_computed_tokens=new.num_computed_tokens,
            num_blocks=0,
            sampling=new.sampling,
            eos_token_id=new.eos_token_id,
            generator=None,
        )
        if new.sampling.seed is not None and not new.sampling.greedy:
            state.generator = torch.Generator(self.device).manual_seed(new.sampling.seed)
        self._set_sampling_row(row, new.sampling, state.generator is not None)
        self.requests[new.req_id] = state
        self._append_blocks(state, new.block_ids)

    def update(self, delta: RunningRequestDelta, take_tokens: bool = False) -> None:
        """Apply a running request's delta; with ``take_tokens`` (a pipeline stage that
        does not sample) also store the tokens sampled since this rank last saw it."""
        state = self.requests.get(delta.req_id)
        if state is None:
            raise ValueError(f"running request {delta.req_id!r} is not in the batch")
        state.num_computed_tokens = delta.num_computed_tokens
        self._append_blocks(state, delta.new_block_ids)
        if take_tokens and delta.new_token_ids:
            end = state.num_tokens + len(delta.new_token_ids)
            self.token_ids[state.row, state.num_tokens : end] = delta.new_token_ids
            state.num_tokens = end

    def remove(self, req_id: str) -> None:
        # Unknown ids are fine: a request may finish before the worker ever saw it.
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)

    def append_tokens(
        self, rows: np.ndarray, token_ids: np.ndarray, states: list[CachedRequestState]
    ) -> None:
        """Store one sampled token per request at the end of its known tokens."""
        ends = np.array([s.num_tokens for s in states], dtype=np.int64)
        self.token_ids[rows, ends] = token_ids
        for s in states:
            s.num_tokens += 1

    def _append_blocks(self, state: CachedRequestState, block_ids: list[int]) -> None:
        end = state.num_blocks + len(block_ids)
        if end > self.block_table.shape[1]:
            raise ValueError(
                f"request {state.req_id!r} has {end} blocks, more than max_model_len allows"
            )
        self.block_table[state.row, state.num_blocks : end] = block_ids
        state.num_blocks = end

    def _grow(self) -> None:
        old = self.token_ids.shape[0]
        self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
        self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
        for name in _SAMPLING_ROW_ARRAYS:  # a new row's values are all set by add()
            arr = getattr(self, name)
            setattr(self, name, np.concatenate([arr, np.zeros_like(arr)]))
        self._staging = _SamplingStaging(2 * old, self.device)
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _set_sampling_row(self, row: int, p: SamplingParams, seeded: bool) -> None:
        greedy = p.greedy
        self.temperature_cpu[row] = 1.0 if greedy else p.temperature
        self.greedy_cpu[row] = greedy
        self.top_k_cpu[row] = p.top_k
        self.top_p_cpu[row] = p.top_p
        self.min_p_cpu[row] = p.min_p
        self.seeded_cpu[row] = seeded
        self.penalized_cpu[row] = (
            p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
        )
        self.min_tokens_cpu[row] = p.min_tokens
        self.bad_words_cpu[row] = bool(p.bad_words_token_ids)
        self.token_limits_cpu[row] = bool(p.logit_bias) or p.allowed_token_ids is not None
        self.logprobs_cpu[row] = -1 if p.logprobs is None else p.logprobs

    # ------------------------------------------------------------------ sampling

    def sampling_metadata(
        self,
        states: list[CachedRequestState],
        vocab_size: int,
        rows: np.ndarray | None = None,
    ) -> SamplingMetadata:
        """Sampling parameters of ``states`` (the rows that sample this step), on device.

        ``rows`` are the states' rows if the caller has them. The common parameters come
        from the per-row arrays through the staging buffer: ``temperature``, ``greedy``,
        ``top_k``, ``top_p`` and ``min_p`` are views of one preallocated device buffer
        that the next call overwrites (after, in stream order, this step's sampler has
        read it). The flags (``all_greedy``, whether any row sets top-k ...) are computed
        on the host."""
        n = len(states)
        if rows is None:
            rows = np.fromiter((s.row for s in states), dtype=np.int64, count=n)
        stage = self._staging
        stage.wait_for_last_copy()
        temperature, greedy, top_k, top_p, min_p = stage.host_views(n)
        np.take(self.temperature_cpu, rows, out=temperature)
        np.take(self.greedy_cpu, rows, out=greedy)
        np.take(self.top_k_cpu, rows, out=top_k)
        top_k[top_k <= 0] = vocab_size
        np.take(self.top_p_cpu, rows, out=top_p)
        np.take(self.min_p_cpu, rows, out=min_p)
        dev = stage.copy_to_device()
        seeded = np.flatnonzero(self.seeded_cpu[rows])
        md = SamplingMetadata(
            temperature=dev.temperature[:n],
            greedy=dev.greedy[:n],
            all_greedy=bool(greedy.all()),
            top_k=dev.top_k[:n] if (top_k < vocab_size).any() else None,
            top_p=dev.top_p[:n] if (top_p < 1.0).any() else None,
            min_p=dev.min_p[:n] if (min_p > 0.0).any() else None,
            generators={int(i): _generator(states[i]) for i in seeded},
        )
        self._rare_sampling(md, states, rows, vocab_size)
        return md

    def _rare_sampling(
        self,
        md: SamplingMetadata,
        states: list[CachedRequestState],
        rows: np.ndarray,
        vocab_size: int,
    ) -> None:
        """Penalties, bad words, min_tokens, logit_bias, allowed_token_ids and logprobs:
        tensors built per step, for the rows that use them (the per-row flags say which)."""
        dev = self.device
        if self.penalized_cpu[rows].any():
            params = [s.sampling for s in states]
            prompt_ids, output_ids = self._penalty_tokens(states, vocab_size)
            md.penalties = Penalties(
                presence=torch.tensor([p.presence_penalty for p in params], device=dev),
                frequency=torch.tensor([p.frequency_penalty for p in params], device=dev),
                repetition=torch.tensor([p.repetition_penalty for p in params], device=dev),
                prompt_token_ids=prompt_ids,
                output_token_ids=output_ids,
            )
        mask_rows: list[int] = []
        mask_toks: list[int] = []
        if self.bad_words_cpu[rows].any():
            mask_rows, mask_toks = self._bad_words(states, vocab_size)
        for i in np.flatnonzero(self.min_tokens_cpu[rows] > 0).tolist():
            s = states[i]
            if s.num_tokens - s.num_prompt_tokens < s.sampling.min_tokens:
                stop = list(s.sampling.stop_token_ids)
                if s.eos_token_id is not None and not s.sampling.ignore_eos:
                    stop.append(s.eos_token_id)
                stop = [t for t in stop if 0 <= t < vocab_size]  # others can't be sampled
                mask_rows += [i] * len(stop)
                mask_toks += stop
        if mask_rows:
            md.min_tokens_mask = (
                torch.tensor(mask_rows, device=dev),
                torch.tensor(mask_toks, device=dev),
            )
        wanted = self.logprobs_cpu[rows]
        md.max_num_logprobs = int(wanted.max()) if (wanted >= 0).any() else None
        if self.token_limits_cpu[rows].any():
            self._token_limits(md, states, vocab_size)

    def _bad_words(
        self, states: list[CachedRequestState], vocab_size: int
    ) -> tuple[list[int], list[int]]:
        """(row, token) pairs that would complete one of a row's bad-word sequences: a
        sequence's last token, where the row's outputs end with the rest of it (vLLM's rule;
        the prompt does not count)."""
        rows: list[int] = []
        toks: list[int] = []
        for i, s in enumerate(states):
            for seq in s.sampling.bad_words_token_ids:
                prefix = len(seq) - 1
                if s.num_tokens - s.num_prompt_tokens < prefix:
                    continue
                tail = self.token_ids[s.row, s.num_tokens - prefix : s.num_tokens]
                if (prefix == 0 or tail.tolist() == seq[:-1]) and 0 <= seq[-1] < vocab_size:
                    rows.append(i)
                    toks.append(seq[-1])
        return rows, toks

    def _token_limits(
        self, md: SamplingMetadata, states: list[CachedRequestState], vocab_size: int
    ) -> None:
        """logit_bias and allowed_token_ids, for the rows that set them. Ids past the model's
        logits cannot be sampled and are left out; a row left with no allowed id at all is
        not restricted (masking all of it would sample from NaN)."""
        rows: list[int] = []
        token_ids: list[int] = []
        biases: list[float] = []
        limited: list[tuple[int, torch.Tensor]] = []
        for i, s in enumerate(states):
            p = s.sampling
            for token_id, bias in p.logit_bias.items():
                if 0 <= token_id < vocab_size:
                    rows.append(i)
                    token_ids.append(token_id)
                    biases.append(bias)
            if p.allowed_token_ids is not None:
                if s.allowed_ids is None:
                    in_vocab = [t for t in p.allowed_token_ids if 0 <= t < vocab_size]
                    s.allowed_ids = torch.tensor(in_vocab, dtype=torch.int64, device=self.device)
                if len(s.allowed_ids):
                    limited.append((i, s.allowed_ids))
        dev = self.device
        if rows:
            md.logit_bias = (
                torch.tensor(rows, device=dev),
                torch.tensor(token_ids, device=dev),
                torch.tensor(biases, dtype=torch.float32, device=dev),
            )
        if limited:
            mask = torch.zeros(len(states), vocab_size, dtype=torch.bool, device=dev)
            for i, allowed in limited:
                mask[i] = True
                mask[i, allowed] = False
            md.disallowed_mask = mask

    def _penalty_tokens(
        self, states: list[CachedRequestState], vocab_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt and output token ids of each row, [N, L] padded with vocab_size."""
        rows = np.array([s.row for s in states])
        n_prompt = np.array([s.num_prompt_tokens for s in states])
        n_out = np.array([s.num_tokens for s in states]) - n_prompt

        def padded(starts: np.ndarray, lens: np.ndarray) -> torch.Tensor:
            idx = starts[:, None] + np.arange(max(int(lens.max()), 1))[None, :]
            valid = idx < (starts + lens)[:, None]
            toks = self.token_ids[rows[:, None], np.minimum(idx, self.token_ids.shape[1] - 1)]
            return torch.from_numpy(np.where(valid, toks, vocab_size).astype(np.int64)).to(
                self.device
            )

        return padded(np.zeros_like(n_prompt), n_prompt), padded(n_prompt, n_out)


# The per-row sampling arrays of InputBatch, grown together with its rows.
_SAMPLING_ROW_ARRAYS = (
    "temperature_cpu",
    "greedy_cpu",
    "top_k_cpu",
    "top_p_cpu",
    "min_p_cpu",
    "seeded_cpu",
    "penalized_cpu",
    "min_tokens_cpu",
    "bad_words_cpu",
    "token_limits_cpu",
    "logprobs_cpu",
)


def _generator(state: CachedRequestState) -> torch.Generator:
    assert state.generator is not None
    return state.generator


@dataclass
class _SamplingViews:
    """Typed views [capacity] of one staging or device buffer."""

    temperature: torch.Tensor  # float32
    greedy: torch.Tensor  # bool
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32


class _SamplingStaging:
    """One host buffer (pinned on CUDA) and one device buffer of the same bytes, for the
    common sampling parameters of up to ``capacity`` rows. Each parameter is a typed view
    of its own aligned section, so one copy moves them all."""

    # (name, dtype) in buffer order: the widest first keeps every section aligned.
    _SECTIONS = (
        ("top_k", torch.int64),
        ("temperature", torch.float32),
        ("top_p", torch.float32),
        ("min_p", torch.float32),
        ("greedy", torch.bool),
    )

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        nbytes = capacity * sum(dt.itemsize for _, dt in self._SECTIONS)
        pin = device.type == "cuda" and torch.cuda.is_available()
        self.host_buf = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.device_buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.host = self._views(self.host_buf)
        self.device = self._views(self.device_buf)
        self._host_np = {name: getattr(self.host, name).numpy() for name, _ in self._SECTIONS}
        # Recorded after each copy on CUDA: the host buffer is not rewritten before it is done.
        self._copied: torch.cuda.Event | None = None
        self._device = device

    def _views(self, buf: torch.Tensor) -> _SamplingViews:
        views: dict[str, torch.Tensor] = {}
        offset = 0
        for name, dtype in self._SECTIONS:
            size = self.capacity * dtype.itemsize
            views[name] = buf[offset : offset + size].view(dtype)
            offset += size
        return _SamplingViews(**views)

    def host_views(
        self, n: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """numpy views of the first ``n`` rows of the host buffer, to fill in place:
        temperature, greedy, top_k, top_p, min_p."""
        if n > self.capacity:
            raise ValueError(f"{n} sampling rows, more than the {self.capacity} staged")
        h = self._host_np
        return h["temperature"][:n], h["greedy"][:n], h["top_k"][:n], h["top_p"][:n], h["min_p"][:n]

    def wait_for_last_copy(self) -> None:
        """Block only if the previous step's copy is still reading the host buffer (it is
        done in the usual flow: the step's sampled ids came back since)."""
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()

    def copy_to_device(self) -> _SamplingViews:
        self.device_buf.copy_(self.host_buf, non_blocking=True)
        if self._device.type == "cuda":
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self._device))
        return self.device
