"""The ``n`` choices of a request: one engine request each, combined into one response.

A request group is ``num_prompts * n`` engine requests; choice ``index`` is
``prompt_index * n + i`` as in vLLM, with ``seed + i`` when seeded. The api_server and
the offline ``LLM`` both fan out with ``fan_out`` and gather each choice's deltas into a
``ChoiceState``, so ``n`` > 1 behaves the same in both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.protocol import (
    DecodedLogprob,
    DecodedPromptLogprobs,
    SamplingParams,
    TextDelta,
    choice_params,
)


def fan_out(
    base_id: str, num_prompts: int, sampling: SamplingParams
) -> list[tuple[str, int, SamplingParams]]:
    """(engine request id ``{base_id}-{index}``, prompt index, the choice's sampling
    parameters) for every choice, in choice order."""
    n = sampling.n
    return [
        (f"{base_id}-{p * n + i}", p, choice_params(sampling, i))
        for p in range(num_prompts)
        for i in range(n)
    ]


@dataclass
class ChoiceState:
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)  # a thinking model's (--reasoning-parser)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[DecodedLogprob] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_reasoning_tokens: int = 0
    prompt_logprobs: DecodedPromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    kv_transfer_params: dict[str, object] | None = None
    # text_offset of the next logprobs entry: vLLM counts token lengths from the first entry
    # on, across chunks (held-back stop-string text and partial characters lag the tokens).
    next_offset: int = 0

    def update(self, delta: TextDelta, text: str) -> None:
        """Record a delta (``text`` may start with the echoed prompt)."""
        self.text.append(text)
        if delta.reasoning:
            self.reasoning.append(delta.reasoning)
        self.logprobs += delta.logprobs
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs
        self.prompt_token_ids = self.prompt_token_ids or delta.prompt_token_ids
        self.token_ids += delta.token_ids
        self.kv_transfer_params = self.kv_transfer_params or delta.kv_transfer_params
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_output_tokens = delta.num_output_tokens
        self.num_reasoning_tokens = delta.num_reasoning_tokens
