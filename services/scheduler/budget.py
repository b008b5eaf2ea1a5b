"""One step's budget, and what the step's passes have taken from it."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.config import SchedulerConfig
from services.request import Request


@dataclass
class StepBudget:
    """What one step may still schedule: tokens, places, and how a request's tokens are cut.

    Every pass asks ``clamp`` how many of the tokens a request wants it gets, then
    ``take``s them; a request preempted later in the same step gives its tokens back.
    """

    tokens: int  # what is left of max_num_batched_tokens
    max_num_seqs: int
    # Running requests one plan takes: with d pipeline stages 1/d of them (a micro-batch).
    max_running: int
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True

    @classmethod
    def for_step(cls, config: SchedulerConfig, num_running: int, pipeline_depth: int) -> StepBudget:
        return cls(
            tokens=config.token_budget,
            max_num_seqs=config.max_num_seqs,
            max_running=-(-num_running // pipeline_depth),
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )

    def clamp(self, wanted: int, *, chunk: bool | None = None) -> int | None:
        """Tokens a request that wants ``wanted`` gets: at most the long-prefill threshold,
        and at most what is left, as a chunk where chunking is allowed (``chunk``, by default
        ``enable_chunked_prefill``; a running request's prefill always continues in
        chunks). None when it does not fit whole and may not be chunked."""
        if 0 < self.long_prefill_token_threshold < wanted:
            wanted = self.long_prefill_token_threshold
        if wanted <= self.tokens:
            return wanted
        may_chunk = self.enable_chunked_prefill if chunk is None else chunk
        return self.tokens if may_chunk else None

    def take(self, num_tokens: int) -> None:
        if num_tokens > self.tokens:
            raise RuntimeError(f"step budget: {num_tokens} tokens taken, {self.tokens} left")
        self.tokens -= num_tokens

    def give_back(self, num_tokens: int) -> None:
        self.tokens += num_tokens

    def has_place(self, num_requests: int) -> bool:
        """Whether one more request fits beside ``num_requests`` (``max_num_seqs``)."""
        return num_requests < self.max_num_seqs


@dataclass
class StepPicks:
    """The requests a step has scheduled so far, with their tokens and new blocks."""

    new: list[Request] = field(default_factory=list)  # admitted in this step
    running: list[Request] = field(default_factory=list)  # running before it
    num_tokens: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)  # running ones'
    preempted: list[Request] = field(default_factory=list)

    def add_running(self, request: Request, num_tokens: int, new_block_ids: list[int]) -> None:
        self.running.append(request)
        self.num_tokens[request.req_id] = num_tokens
        self.new_block_ids[request.req_id] = new_block_ids

    def add_new(self, request: Request, num_tokens: int) -> None:
        self.new.append(request)
        self.num_tokens[request.req_id] = num_tokens

    def drop_running(self, request: Request) -> int:
        """Undo a running request's pick (it was preempted since): the tokens it had, or 0."""
        if request.req_id not in self.num_tokens:
            return 0
        del self.new_block_ids[request.req_id]
        self.running.remove(request)
        return self.num_tokens.pop(request.req_id)

    def in_plan_order(self) -> list[Request]:
        return [*self.new, *self.running]
