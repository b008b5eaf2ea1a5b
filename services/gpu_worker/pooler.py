"""Pooling: an embedding request's vector from the final norm's hidden states.

A pooling request (``NewRequest.pooling``) runs its prompt through the same steps as any
prefill, chunked like one, and samples nothing. Its vector is built as the chunks pass:
``MEAN`` keeps a running fp32 sum and count (the hidden states of one chunk are gone by
the next step, and keeping them all would cost a prompt's worth of activations), ``CLS``
keeps the first token's row, ``LAST`` needs only the row of the step that ends the prompt.
The vector leaves in that step's ``StepResult.pooled`` and the state is dropped.

Only the last pipeline stage has hidden states after the final norm, so only its runner
pools; with tensor parallelism every rank of that stage holds the same rows (the
all-reduced output) and the output rank's result is the one sent. ``MEAN`` and ``CLS``
need every prompt position computed here, so those requests never read the prefix cache
(``Request.skip_reading_prefix_cache``); a ``LAST`` request's last token is always
computed, whatever the hit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.protocol import NewRequest, PooledOutput, PoolingParams


def finish_vector(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """The vector as the client gets it: its first ``dimensions`` entries (matryoshka: cut
    before normalising, as vLLM's embedding head does), L2-normalised if asked, fp32."""
    vector = vector.float()
    if params.dimensions is not None:
        vector = vector[..., : params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, p=2.0, dim=-1)
    return vector


def pool_whole(hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """The pooled, finished vector of one prompt's hidden states [tokens, hidden] in one
    piece (the reference ``Pooler``'s chunked accumulation is tested against)."""
    if params.pooling_type == "MEAN":
        return finish_vector(hidden.float().mean(dim=0), params)
    row = 0 if params.pooling_type == "CLS" else -1
    return finish_vector(hidden[row], params)


def to_bytes(vector: torch.Tensor) -> bytes:
    return vector.detach().to("cpu", torch.float32).numpy().astype("<f4").tobytes()


def from_bytes(data: bytes) -> np.ndarray:
    """A ``PooledOutput.data`` back as float32 values."""
    return np.frombuffer(data, dtype="<f4")


@dataclass
class _PoolState:
    params: PoolingParams
    total: torch.Tensor | None = None  # MEAN: sum of the rows so far (fp32)
    count: int = 0
    first: torch.Tensor | None = None  # CLS: the first token's row


class Pooler:
    """The pooling requests one runner holds, keyed by request id.

    Contract: ``add`` every new request (those without ``pooling`` are ignored; a request
    resumed after preemption starts over, as its prompt is recomputed from 0), ``drop`` the
    finished ones, and call ``step`` once per step with that step's hidden states: it
    returns the vectors of the requests whose prompt the step ended.
    """

    def __init__(self) -> None:
        self._states: dict[str, _PoolState] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def add(self, new: NewRequest) -> None:
        if new.pooling is None:
            return
        if new.num_computed_tokens and new.pooling.pooling_type != "LAST":
            raise ValueError(
                f"{new.pooling.pooling_type} pooling of {new.req_id} needs every prompt "
                f"token computed, but {new.num_computed_tokens} came from the prefix cache"
            )
        self._states[new.req_id] = _PoolState(new.pooling)

    def drop(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def step(
        self,
        hidden: torch.Tensor,
        req_ids: list[str],
        computed: np.ndarray,
        scheduled: np.ndarray,
        known: np.ndarray,
    ) -> list[PooledOutput]:
        """Take in the step's rows (request i's ``scheduled[i]`` tokens after those of the
        requests before it, as the plan lists them); the vectors of prompts that ended."""
        if not self._states:
            return []
        out: list[PooledOutput] = []
        starts = np.concatenate(([0], np.cumsum(scheduled)[:-1]))
        for i, req_id in enumerate(req_ids):
            state = self._states.get(req_id)
            if state is None:
                continue
            start, n = int(starts[i]), int(scheduled[i])
            kind = state.params.pooling_type
            if kind == "MEAN":
                part = hidden[start : start + n].float().sum(dim=0)
                state.total = part if state.total is None else state.total + part
                state.count += n
            elif kind == "CLS" and computed[i] == 0:
                state.first = hidden[start]
            if computed[i] + n < known[i]:
                continue  # a prefill chunk short of the prompt's end
            if kind == "MEAN":
                assert state.total is not None
                vector = state.total / state.count
            elif kind == "CLS":
                assert state.first is not None
                vector = state.first
            else:
                vector = hidden[start + n - 1]
            out.append(PooledOutput(req_id, to_bytes(finish_vector(vector, state.params))))
            del self._states[req_id]
        return out
