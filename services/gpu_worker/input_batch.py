"""The worker's persistent batch: every live request's tokens and block table, by row.

A ``NewRequest`` is added once and gets a row in host-side numpy arrays; later
steps only append block ids and sampled tokens. Step inputs are gathered from the
arrays with vectorised indexing, never per token in Python.
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
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    # ------------------------------------------------------------------ sampling

    def sampling_metadata(
        self, states: list[CachedRequestState], vocab_size: int
    ) -> SamplingMetadata:
        """Sampling parameters of ``states`` (the rows that sample this step), on device."""
        params = [s.sampling for s in states]
        dev = self.device
        greedy = [p.greedy for p in params]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        md = SamplingMetadata(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=dev),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=dev),
            all_greedy=all(greedy),
            top_k=_tensor_if(any(k < vocab_size for k in top_k), top_k, torch.int64, dev),
            top_p=_tensor_if(
                any(p.top_p < 1.0 for p in params), [p.top_p for p in params], torch.float32, dev
            ),
            min_p=_tensor_if(
                any(p.min_p > 0.0 for p in params), [p.min_p for p in params], torch.float32, dev
            ),
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
        )
        if any(
            p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
            for p in params
        ):
            prompt_ids, output_ids = self._penalty_tokens(states, vocab_size)
            md.penalties = Penalties(
                presence=torch.tensor([p.presence_penalty for p in params], device=dev),
                frequency=torch.tensor([p.frequency_penalty for p in params], device=dev),
                repetition=torch.tensor([p.repetition_penalty for p in params], device=dev),
                prompt_token_ids=prompt_ids,
                output_token_ids=output_ids,
            )
        rows, toks = self._bad_words(states, vocab_size)
        for i, s in enumerate(states):
            if s.num_tokens - s.num_prompt_tokens < s.sampling.min_tokens:
                stop = list(s.sampling.stop_token_ids)
                if s.eos_token_id is not None and not s.sampling.ignore_eos:
                    stop.append(s.eos_token_id)
                stop = [t for t in stop if 0 <= t < vocab_size]  # others can't be sampled
                rows += [i] * len(stop)
                toks += stop
        if rows:
            md.min_tokens_mask = (torch.tensor(rows, device=dev), torch.tensor(toks, device=dev))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        md.max_num_logprobs = max(wanted) if wanted else None
        self._token_limits(md, states, vocab_size)
        return md

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


def _tensor_if(
    cond: bool, values: list, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    return torch.tensor(values, dtype=dtype, device=device) if cond else None
