"""Token sampling, vectorised over the batch, with vLLM v1's semantics.

Order: (the grammar's bitmask, applied by the model runner) -> raw logprobs (if asked) ->
allowed_token_ids -> logit_bias -> penalties -> min_tokens stop masking -> greedy argmax |
temperature -> min-p -> top-k/top-p -> sample. Sampling uses the exponential race
``argmax(probs / q)``, q ~ Exp(1): a seeded request draws q from its own generator, so its
tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NEG_INF = float("-inf")


@dataclass
class Penalties:
    """Penalty parameters [N] and each row's prompt / output token ids [N, L], padded
    with ``vocab_size``."""

    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    prompt_token_ids: torch.Tensor
    output_token_ids: torch.Tensor


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of the N rows that sample this step (device tensors).

    Optional parts are None when no row uses them. ``min_tokens_mask`` is
    (row indices, token ids) whose logits are forced to -inf: stop tokens before
    ``min_tokens``, and the tokens that would complete a bad word. ``generators`` maps a
    row to its request's own generator; the other random rows share the sampler's.
    """

    temperature: torch.Tensor  # [N] float32; 1.0 on greedy rows
    greedy: torch.Tensor  # [N] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [N] int64, vocab_size where disabled; None = none set
    top_p: torch.Tensor | None  # [N] float32; None = none set
    min_p: torch.Tensor | None  # [N] float32; None = none set
    generators: dict[int, torch.Generator]
    penalties: Penalties | None = None
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    max_num_logprobs: int | None = None  # largest top-N asked; None = no row wants logprobs
    # (row indices, token ids, biases) added to the logits; None = no row has a logit_bias
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # [N, vocab] True where a token may NOT be sampled (allowed_token_ids); None = no limits
    disallowed_mask: torch.Tensor | None = None
    # The rows whose logits are already masked by a grammar (structured outputs), [N] bool:
    # where the masks below leave such a row nothing (min_tokens forbids the EOS the
    # grammar wants), the grammar wins. None: no such row.
    constrained: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    """Sampled tokens [N]; with logprobs, the top-N ids/logprobs [N, K] and the
    sampled token's logprob and 1-based rank [N], all from the raw model output."""

    sampled_token_ids: torch.Tensor
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    sampled_logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


def _bin_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, L] token ids padded with vocab_size -> [N, vocab] occurrence counts."""
    counts = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.int32, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """Repetition over prompt + output (divide positive logits, multiply negative);
    frequency (times output count) and presence (output seen) subtracted."""
    vocab = logits.shape[1]
    output_counts = _bin_counts(p.output_token_ids, vocab)
    output_mask = output_counts > 0
    seen = output_mask | (_bin_counts(p.prompt_token_ids, vocab) > 0)
    rep = torch.where(seen, p.repetition[:, None], 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - p.frequency[:, None] * output_counts
    return logits - p.presence[:, None] * output_mask


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep the k largest logits, then the smallest set whose probability reaches p."""
    if top_k is None and top_p is None:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = logits_sort.gather(1, (logits.shape[1] - top_k.clamp(1, logits.shape[1]))[:, None])
        logits_sort.masked_fill_(logits_sort < kth, _NEG_INF)
    if top_p is not None:
        cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p[:, None]
        drop[:, -1] = False  # always keep the most likely token
        logits_sort.masked_fill_(drop, _NEG_INF)
    return logits_sort.scatter(1, logits_idx, logits_sort)


class Sampler:
    """Samples one token per row; see the module doc. ``generator`` serves unseeded rows."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        out = SamplerOutput(sampled_token_ids=torch.empty(0))
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)
        # Only these masks leave -inf behind (logit_bias is finite, penalties scale).
        can_empty = md.disallowed_mask is not None or md.min_tokens_mask is not None
        grammar_only = logits if md.constrained is not None and can_empty else None
        if md.disallowed_mask is not None:
            logits = logits.masked_fill(md.disallowed_mask, _NEG_INF)
        if md.logit_bias is not None:
            rows, token_ids, biases = md.logit_bias
            logits = logits.index_put((rows, token_ids), biases, accumulate=True)
        if md.penalties is not None:
            logits = apply_penalties(logits, md.penalties)
        if md.min_tokens_mask is not None:
            # new_full: a fill on the device, not a blocking copy of a host scalar.
            logits = logits.index_put(md.min_tokens_mask, logits.new_full((), _NEG_INF))
        if grammar_only is not None:
            assert md.constrained is not None
            nothing_left = torch.isneginf(logits).all(dim=-1) & md.constrained
            logits = torch.where(nothing_left[:, None], grammar_only, logits)
        greedy_tokens = logits.argmax(dim=-1)
        if md.all_greedy:
            out.sampled_token_ids = greedy_tokens
        else:
            logits = logits / md.temperature[:, None]
            if md.min_p is not None:
                logits = apply_min_p(logits, md.min_p)
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
            probs = logits.softmax(dim=-1)
            q = torch.empty_like(probs)
            if len(md.generators) < probs.shape[0]:
                q.exponential_(generator=self.generator)
            for row, gen in md.generators.items():
                q[row].exponential_(generator=gen)
            random_tokens = (probs / q).argmax(dim=-1)
            out.sampled_token_ids = torch.where(md.greedy, greedy_tokens, random_tokens)
        if raw_logprobs is not None and md.max_num_logprobs is not None:
            (out.top_token_ids, out.top_logprobs, out.sampled_logprobs, out.sampled_ranks) = (
                gather_logprobs(raw_logprobs, out.sampled_token_ids, md.max_num_logprobs)
            )
        return out


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows of log-probabilities [N, vocab] and one token per row [N]: the top
    ``num_top`` ids and logprobs [N, num_top], and the token's logprob and 1-based rank [N]."""
    top = logprobs.topk(num_top, dim=-1)
    token_lp = logprobs.gather(1, token_ids[:, None])
    return top.indices, top.values, token_lp[:, 0], (logprobs >= token_lp).sum(dim=-1)
