"""What a step returns besides the sampled ids: logprobs (of the sampled tokens and of the
prompt) and the grammar's bitmask on the logits before sampling."""

from __future__ import annotations

import numpy as np
import torch

from services.gpu_worker.input_batch import CachedRequestState
from services.gpu_worker.model.llama import LlamaForCausalLM
from services.gpu_worker.sampler import SamplerOutput, gather_logprobs
from services.protocol import PromptLogprobs, StepPlan, TokenLogprobs
from services.structured_output.bitmask import apply_token_bitmask, bitmask_rows

# Prompt logprobs score this many positions at a time: [rows, vocab] fp32 logits stay small.
_PROMPT_LOGPROBS_ROWS = 256


def prompt_logprobs(
    model: LlamaForCausalLM,
    token_ids: np.ndarray,
    hidden: torch.Tensor,
    states: list[CachedRequestState],
    computed: np.ndarray,
    scheduled: np.ndarray,
) -> list[PromptLogprobs]:
    """Prompt logprobs for the requests that asked (``token_ids``: the batch's, by row):
    the hidden state at position p
    scores prompt token p + 1, so a chunk covering positions [a, b) yields tokens
    a + 1 .. min(b, num_prompt_tokens - 1). The last prompt position samples instead."""
    result: list[PromptLogprobs] = []
    for i, s in enumerate(states):
        num_top = s.sampling.prompt_logprobs
        if num_top is None:
            continue
        first = int(computed[i])
        end = min(first + int(scheduled[i]), s.num_prompt_tokens - 1)
        if first >= end:
            continue
        targets = torch.from_numpy(token_ids[s.row, first + 1 : end + 1].astype(np.int64)).to(
            hidden.device
        )
        items: list[TokenLogprobs] = []
        for off in range(0, end - first, _PROMPT_LOGPROBS_ROWS):
            row0 = int(scheduled[:i].sum()) + off  # this request's first row in the step
            tgt = targets[off : off + _PROMPT_LOGPROBS_ROWS]
            logprobs = model.compute_logits(hidden[row0 : row0 + len(tgt)])
            top_ids, top_lps, lps, ranks = gather_logprobs(
                logprobs.log_softmax(dim=-1), tgt, num_top
            )
            items += _token_logprobs(tgt, top_ids, top_lps, lps, ranks)
        result.append(PromptLogprobs(s.req_id, first + 1, items))
    return result


def _token_logprobs(
    token_ids: torch.Tensor,
    top_ids: torch.Tensor,
    top_lps: torch.Tensor,
    lps: torch.Tensor,
    ranks: torch.Tensor,
) -> list[TokenLogprobs]:
    return [
        TokenLogprobs(token_id=t, logprob=lp, rank=r, top_token_ids=ti, top_logprobs=tl)
        for t, lp, r, ti, tl in zip(
            token_ids.tolist(),
            lps.tolist(),
            ranks.tolist(),
            top_ids.tolist(),
            top_lps.tolist(),
            strict=True,
        )
    ]


def apply_grammar(
    logits: torch.Tensor, plan: StepPlan, sample_states: list[CachedRequestState]
) -> torch.Tensor | None:
    """The plan's bitmask rows onto the logits of the requests they belong to (before
    logprobs and sampling, as vLLM: a constrained request's logprobs are the grammar's);
    which rows those are ([N] bool), None when none."""
    if not plan.grammar_req_ids:
        return None
    index = {s.req_id: i for i, s in enumerate(sample_states)}
    rows = torch.tensor(
        [index[req_id] for req_id in plan.grammar_req_ids], device=logits.device
    )  # a row for each, or a bug
    bitmask = bitmask_rows(plan.grammar_bitmask, len(rows))
    apply_token_bitmask(logits, rows, bitmask)
    constrained = torch.zeros(len(sample_states), dtype=torch.bool, device=logits.device)
    constrained[rows] = True
    return constrained


def to_token_logprobs(
    out: SamplerOutput, states: list[CachedRequestState]
) -> list[TokenLogprobs | None]:
    """Each sampling row's logprobs, cut to the top-N its request asked for (None: not asked)."""
    if out.top_token_ids is None:
        return [None] * len(states)
    assert out.top_logprobs is not None
    assert out.sampled_logprobs is not None and out.sampled_ranks is not None
    rows = _token_logprobs(
        out.sampled_token_ids,
        out.top_token_ids,
        out.top_logprobs,
        out.sampled_logprobs,
        out.sampled_ranks,
    )
    result: list[TokenLogprobs | None] = []
    for row, s in zip(rows, states, strict=True):
        n = s.sampling.logprobs
        if n is not None:
            row.top_token_ids, row.top_logprobs = row.top_token_ids[:n], row.top_logprobs[:n]
        result.append(None if n is None else row)
    return result
