"""A request as the scheduler sees it: tokens, progress through them, status, timestamps."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import msgspec

from services import clock
from services.protocol import (
    BlockHash,
    PoolingParams,
    PromptLogprobs,
    SamplingParams,
    TokenizedRequest,
    TokenLogprobs,
)

if TYPE_CHECKING:
    import numpy as np


class Matcher(Protocol):
    """One request's place in its grammar (``services/structured_output`` implements it)."""

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and no move) if the grammar forbids it."""
        ...

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32 words)."""
        ...

    def rollback(self, num_tokens: int) -> None: ...

    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        ...


class RequestStatus(enum.IntEnum):
    """Where a request is. Every status after WAITING_FOR_GRAMMAR is a finished one."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # back in the waiting queue, to be recomputed
    WAITING_FOR_REMOTE_KVS = enum.auto()  # has blocks; a KV connector is filling them
    WAITING_FOR_GRAMMAR = enum.auto()  # its structured-output grammar is compiling
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason: "stop", "length", "abort" or "error"."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
FINISH_STATUS = {reason: status for status, reason in _FINISH_REASONS.items()}


class RequestEventType(enum.Enum):
    """The engine-side request events of vLLM's metrics design (for queue/prefill/decode times)."""

    QUEUED = "queued"
    SCHEDULED = "scheduled"  # moved from waiting to running (again after a preemption)
    NEW_TOKENS = "new_tokens"
    PREEMPTED = "preempted"


class Request:
    """One sequence being generated.

    ``num_computed_tokens`` is how many of ``all_token_ids`` are in the KV
    cache (or scheduled to be by the step in flight); each step brings it
    closer to ``num_tokens``. ``block_hashes`` holds the hash of every full
    block of ``all_token_ids``, extended as tokens are appended once a block
    hasher is attached (``Scheduler.add_request`` does it). ``events`` are
    (type, ``time.monotonic()``) pairs for the metrics exporter;
    ``arrival_time`` is wall-clock time as the api_server stamped it.
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, object] | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        self.req_id = req_id
        # An embedding (/v1/embeddings, /pooling): prefill only, finished by the step that
        # computes its prompt's end, with the pooled vector instead of a token.
        self.pooling = pooling
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = clock.wall() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # PD disaggregation: what the client asked of the KV connector, and (once finished)
        # what it answers, e.g. where the blocks it holds for a remote decode are.
        self.kv_transfer_params = kv_transfer_params
        self.kv_transfer_params_out: dict[str, object] | None = None

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_tokens_at_workers = 0  # known tokens as of the last plan that scheduled it
        self.admitted_step_id = -1  # the plan that last moved it from waiting to running
        # Async scheduling: tokens that plans in flight will sample, not yet known here.
        self.num_output_placeholders = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = (
            -1
        )  # prompt tokens hit in the prefix cache; set when first scheduled
        self.waiting_reason = "deferred"  # "capacity" once admission was refused for lack of room
        self.events: list[tuple[RequestEventType, float]] = []

        self.block_hashes: list[BlockHash] = []
        self.load_failed = False  # a KV connector's load of its prompt failed: recomputed
        self._block_hasher: Callable[[Request], list[BlockHash]] | None = None

        # Prompt tokens 1.. scored so far (prompt_logprobs), sent once with the first output.
        self.prompt_logprobs: list[TokenLogprobs] = []
        # Structured outputs: where the output is in its grammar (services/structured_output)
        self.grammar: Matcher | None = None

    @classmethod
    def from_tokenized(cls, msg: TokenizedRequest) -> Request:
        return cls(
            msg.req_id,
            msg.prompt_token_ids,
            msg.sampling,
            eos_token_id=msg.eos_token_id,
            arrival_time=msg.arrival_time or None,
            priority=msg.priority,
            cache_salt=msg.cache_salt,
            kv_transfer_params=msg.kv_transfer_params,
            pooling=msg.pooling,
        )

    @property
    def is_recomputing(self) -> bool:
        """Admitted again after a preemption or a failed KV load (its prefix lookups are
        counted apart, as vLLM counts preempted ones)."""
        return self.num_preemptions > 0 or self.load_failed

    def set_block_hasher(self, block_hasher: Callable[[Request], list[BlockHash]]) -> None:
        self._block_hasher = block_hasher
        self.block_hashes.extend(block_hasher(self))

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Take in a chunk's prompt logprobs; a chunk recomputed after preemption replaces
        what it covers (and is dropped once the prompt's logprobs went out)."""
        if not self.prompt_logprobs_pending:
            return
        del self.prompt_logprobs[chunk.start - 1 :]
        self.prompt_logprobs.extend(chunk.items)

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Asked for prompt logprobs and not sent them yet: they go out with the first
        output token, so until there is one."""
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def worker_sampling_params(self) -> SamplingParams:
        """What the worker needs: no grammar (its bitmask rows come with each step), and no
        prompt logprobs once they went out (a request resumed after preemption recomputes
        its prompt; scoring it again would be wasted)."""
        params = self.sampling_params
        if params.structured_outputs is not None:  # the scheduler's matter: bitmask rows
            params = msgspec.structs.replace(params, structured_outputs=None)
        if params.prompt_logprobs is not None and not self.prompt_logprobs_pending:
            params = msgspec.structs.replace(params, prompt_logprobs=None)
        return params

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Prompt logprobs need every prompt position computed, so no prefix hit (as vLLM);
        so do MEAN and CLS pooling (every token's hidden state, or the first one's). LAST
        pooling reads hits: the last token is always computed (``get_computed_blocks``)."""
        if self.pooling is not None and self.pooling.pooling_type != "LAST":
            return True
        return self.prompt_logprobs_pending

    def record_event(self, event: RequestEventType, ts: float | None = None) -> None:
        self.events.append((event, clock.monotonic() if ts is None else ts))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The finished status a request reaches with its latest token, if any.

    EOS (unless ``ignore_eos``) and ``stop_token_ids`` count only once
    ``min_tokens`` are out, and win over the length limits on the same token.
    A stop token's id becomes ``stop_reason``.
    """
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        last = request.output_token_ids[-1]
        if last == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if reaches_length(request, max_model_len):
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def reaches_length(request: Request, max_model_len: int, more: int = 0) -> bool:
    """With ``more`` tokens beyond its known ones, the request is at ``max_model_len`` or
    ``max_tokens`` (async scheduling asks with the tokens its plans in flight sample)."""
    max_tokens = request.sampling_params.max_tokens
    return request.num_tokens + more >= max_model_len or (
        max_tokens is not None and request.num_output_tokens + more >= max_tokens
    )
