"""The scheduler's messages out: a step's ``StepPlan`` and a request's ``RequestTokens``."""

from __future__ import annotations

from collections.abc import Iterable

from services.kv_cache.manager import KVCacheManager
from services.protocol import (
    NewRequest,
    RequestTokens,
    RunningRequestDelta,
    StepPlan,
    TokenLogprobs,
)
from services.request import Request
from services.scheduler.budget import StepPicks


def build_plan(
    step_id: int,
    picks: StepPicks,
    kv_cache_manager: KVCacheManager,
    finished_req_ids: Iterable[str],
    *,
    with_new_token_ids: bool,
    kv_connector_metadata: bytes,
) -> StepPlan:
    """The plan of a step's picks, new requests first. ``with_new_token_ids``: each running
    delta carries the tokens sampled since its request was last scheduled (for pipeline
    stages that do not sample)."""
    return StepPlan(
        step_id=step_id,
        new_requests=[
            NewRequest(
                req_id=r.req_id,
                token_ids=list(r.all_token_ids),
                num_prompt_tokens=r.num_prompt_tokens,
                sampling=r.worker_sampling_params,
                block_ids=kv_cache_manager.get_block_ids(r.req_id),
                num_computed_tokens=r.num_computed_tokens,
                eos_token_id=r.eos_token_id,
                pooling=r.pooling,
            )
            for r in picks.new
        ],
        running=[
            RunningRequestDelta(
                r.req_id,
                picks.new_block_ids[r.req_id],
                r.num_computed_tokens,
                r.all_token_ids[r.num_tokens_at_workers :] if with_new_token_ids else [],
            )
            for r in picks.running
        ],
        num_scheduled_tokens=[picks.num_tokens[r.req_id] for r in picks.in_plan_order()],
        finished_req_ids=list(finished_req_ids),
        kv_connector_metadata=kv_connector_metadata,
    )


def request_tokens(
    request: Request,
    new_token_ids: list[int],
    finish_reason: str | None,
    logprobs: Iterable[TokenLogprobs] = (),
) -> RequestTokens:
    """What the request produced in a step, or how it ended; its prompt logprobs go out
    with its first token."""
    prompt_logprobs: list[TokenLogprobs] = []
    first_output = 0 < len(new_token_ids) == request.num_output_tokens
    if first_output and request.sampling_params.prompt_logprobs is not None:
        prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, []
    return RequestTokens(
        req_id=request.req_id,
        new_token_ids=new_token_ids,
        finish_reason=finish_reason,
        stop_reason=request.stop_reason if finish_reason is not None else None,
        logprobs=list(logprobs),
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        prompt_logprobs=prompt_logprobs,
        kv_transfer_params=request.kv_transfer_params_out if finish_reason else None,
    )
