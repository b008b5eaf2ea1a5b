"""The sampler against straightforward per-row references, on random logits."""

from __future__ import annotations

import math

import pytest
import torch

from services.gpu_worker.input_batch import InputBatch
from services.gpu_worker.sampler import Sampler, SamplingMetadata
from services.protocol import NewRequest, SamplingParams

VOCAB = 64
EOS = 5
CPU = torch.device("cpu")


def make_batch(params: list[SamplingParams], prompts: list[list[int]] | None = None):
    batch = InputBatch(max_num_reqs=4, max_model_len=256, block_size=16, device=CPU)
    prompts = prompts or [[1, 2, 3]] * len(params)
    for i, (p, prompt) in enumerate(zip(params, prompts, strict=True)):
        batch.add(NewRequest(f"r{i}", prompt, len(prompt), p, [], len(prompt), EOS))
    return batch, [batch.requests[f"r{i}"] for i in range(len(params))]


def sample_steps(params: list[SamplingParams], logits: list[torch.Tensor], sampler_seed: int = 0):
    """Sample len(logits) steps for every request; logits[t] is [N, VOCAB]."""
    batch, states = make_batch(params)
    sampler = Sampler(torch.Generator().manual_seed(sampler_seed))
    out = []
    for step_logits in logits:
        md = batch.sampling_metadata(states, VOCAB)
        tokens = sampler(step_logits.clone(), md).sampled_token_ids
        rows = torch.tensor([s.row for s in states]).numpy()
        batch.append_tokens(rows, tokens.numpy(), states)
        out.append(tokens.tolist())
    return [list(col) for col in zip(*out, strict=True)]


def rand_logits(steps: int, rows: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, VOCAB, generator=gen) * 3 for _ in range(steps)]


def test_seeded_sampling_is_independent_of_the_batch():
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    logits = rand_logits(20, 3, seed=0)
    alone = sample_steps([seeded], [lg[1:2] for lg in logits], sampler_seed=0)[0]
    others = [SamplingParams(temperature=1.2), SamplingParams(temperature=0.7, seed=99)]
    in_batch = sample_steps([others[0], seeded, others[1]], logits, sampler_seed=7)[1]
    assert alone == in_batch
    assert alone != sample_steps([SamplingParams(temperature=0.9, top_p=0.95, seed=4321)],
                                 [lg[1:2] for lg in logits])[0]  # fmt: skip


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=1e-6, seed=3)])  # fmt: skip
def test_greedy_equivalents(params):
    logits = rand_logits(5, 2, seed=1)
    tokens = sample_steps([params, SamplingParams(temperature=1.0)], logits)[0]
    assert tokens == [int(lg[0].argmax()) for lg in logits]


def test_exponential_race_samples_from_softmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 8, generator=gen)
    n = 20000
    params = [SamplingParams(temperature=0.5)] * 4
    batch, states = make_batch(params)
    md = batch.sampling_metadata(states, 8)
    sampler = Sampler(torch.Generator().manual_seed(1))
    counts = torch.zeros(8)
    for _ in range(n // 4):
        counts += torch.bincount(sampler(logits.repeat(4, 1), md).sampled_token_ids, minlength=8)
    expected = (logits[0] / 0.5).softmax(-1) * n
    # Chi-square with 7 degrees of freedom: 30 is far in the tail (p ~ 1e-4).
    assert float(((counts - expected) ** 2 / expected).sum()) < 30


def reference_penalties(logits, prompt, output, presence, frequency, repetition):
    logits = logits.clone()
    for tok in set(prompt) | set(output):
        logits[tok] = logits[tok] / repetition if logits[tok] > 0 else logits[tok] * repetition
    for tok in set(output):
        logits[tok] -= frequency * output.count(tok) + presence
    return logits


def test_penalties_match_reference():
    gen = torch.Generator().manual_seed(2)
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(),
        SamplingParams(frequency_penalty=-1.0, presence_penalty=2.0),
    ]
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 9, 3, 12)]
    batch, states = make_batch(params, prompts)
    outputs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (6, 0, 2, 11)]
    for s, out in zip(states, outputs, strict=True):
        for tok in out:
            batch.append_tokens(torch.tensor([s.row]).numpy(), torch.tensor([tok]).numpy(), [s])
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    md = batch.sampling_metadata(states, VOCAB)
    from services.gpu_worker.sampler import apply_penalties

    assert md.penalties is not None
    got = apply_penalties(logits, md.penalties)
    for i, p in enumerate(params):
        want = reference_penalties(logits[i], prompts[i], outputs[i], p.presence_penalty,
                                   p.frequency_penalty, p.repetition_penalty)  # fmt: skip
        torch.testing.assert_close(got[i], want)


def reference_filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Kept-token mask of one row: min-p, then top-k, then top-p over the renormalised rest."""
    probs = logits.softmax(-1)
    keep = probs >= min_p * probs.max()
    order = sorted(range(VOCAB), key=lambda t: -float(logits[t]))
    kept = [t for t in order if keep[t]][: top_k if top_k > 0 else VOCAB]
    mass = sum(float(probs[t]) for t in kept)
    final, above = [], 0.0
    for t in kept:  # keep while the mass ranked strictly above is below p
        if above < top_p * mass:
            final.append(t)
        above += float(probs[t])
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[final] = True
    return mask


@pytest.mark.parametrize("seed", range(5))
def test_top_k_top_p_min_p_match_reference(seed, monkeypatch):
    gen = torch.Generator().manual_seed(seed)
    params = [
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.7),
        SamplingParams(min_p=0.1),
        SamplingParams(top_k=10, top_p=0.5, min_p=0.05),
    ]
    logits = torch.randn(4, VOCAB, generator=gen) * 2
    batch, states = make_batch(params)
    md = batch.sampling_metadata(states, VOCAB)
    captured: list[torch.Tensor] = []
    original_softmax = torch.Tensor.softmax

    def spy(self, *args, **kwargs):
        captured.append(self)
        return original_softmax(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "softmax", spy)
    Sampler(torch.Generator().manual_seed(0))(logits, md)
    monkeypatch.undo()
    filtered = captured[-1]  # the logits the final distribution is taken from
    for i, p in enumerate(params):
        want = reference_filter(logits[i], p.top_k, p.top_p, p.min_p)
        assert torch.equal(torch.isfinite(filtered[i]), want), f"row {i}"


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.full((3, VOCAB), -5.0)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 8] = 1.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7]),
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0.0),
    ]
    out = sample_steps(params, [logits] * 3)
    assert out[0] == [8, 8, EOS]  # EOS and the stop token masked for two outputs
    assert out[1] == [EOS, EOS, EOS]  # ignore_eos: EOS does not stop, so it is not masked
    assert out[2] == [EOS, EOS, EOS]


def test_logprobs_are_raw_and_ranked():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, VOCAB, generator=gen)
    params = [SamplingParams(temperature=2.0, logprobs=3, repetition_penalty=2.0),
              SamplingParams(temperature=0.0, logprobs=0)]  # fmt: skip
    batch, states = make_batch(params)
    md: SamplingMetadata = batch.sampling_metadata(states, VOCAB)
    out = Sampler(torch.Generator().manual_seed(0))(logits, md)
    raw = logits.log_softmax(-1)
    top = raw.topk(3)
    assert out.top_token_ids is not None and out.sampled_ranks is not None
    assert torch.equal(out.top_token_ids, top.indices)
    torch.testing.assert_close(out.top_logprobs, top.values)
    for i in range(2):
        tok = int(out.sampled_token_ids[i])
        assert math.isclose(float(out.sampled_logprobs[i]), float(raw[i, tok]), rel_tol=1e-6)
        assert int(out.sampled_ranks[i]) == 1 + sum(float(x) > float(raw[i, tok]) for x in raw[i])
    assert int(out.sampled_ranks[1]) == 1  # greedy takes the top token


def test_logit_bias_and_allowed_token_ids_against_reference():
    """Greedy and seeded rows, each against argmax / the race run by hand on the edited logits."""
    logits = rand_logits(6, 4, seed=5)
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 100.0}),  # forces token 3
        SamplingParams(temperature=0.0, allowed_token_ids=[10, 20, 30]),
        SamplingParams(temperature=0.0, logit_bias={9: 2.5, 11: -100.0}, allowed_token_ids=[9, 11]),
        SamplingParams(temperature=0.0),  # untouched by the others' limits
    ]
    out = sample_steps(params, logits)
    assert out[0] == [3] * 6
    for t, lg in enumerate(logits):
        allowed = torch.full((VOCAB,), float("-inf"))
        allowed[[10, 20, 30]] = lg[1, [10, 20, 30]]
        assert out[1][t] == int(allowed.argmax())
        pair = lg[2, [9, 11]] + torch.tensor([2.5, -100.0])
        assert out[2][t] == [9, 11][int(pair.argmax())]
        assert out[3][t] == int(lg[3].argmax())

    # A random row samples only allowed tokens.
    sampled = sample_steps([SamplingParams(temperature=1.5, allowed_token_ids=[1, 2])],
                           [lg[:1] for lg in rand_logits(50, 1, seed=6)])[0]  # fmt: skip
    assert set(sampled) <= {1, 2} and len(set(sampled)) == 2

    # Allowed ids all past the logits (a tokenizer larger than the model): not NaN, unlimited.
    lg = rand_logits(1, 1, seed=7)
    assert sample_steps([SamplingParams(temperature=0.0, allowed_token_ids=[VOCAB + 3])], lg) == [
        [int(lg[0][0].argmax())]
    ]


def test_token_limit_validation():
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[]).validate()
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: float("nan")}).validate()
    assert SamplingParams(logit_bias={VOCAB: 1.0}).out_of_vocab_token(VOCAB) == (
        "logit_bias",
        VOCAB,
    )
    assert SamplingParams(allowed_token_ids=[0, -1]).out_of_vocab_token(VOCAB) == (
        "allowed_token_ids",
        -1,
    )
    assert SamplingParams(logit_bias={1: 1.0}).out_of_vocab_token(VOCAB) is None


def test_bad_words_mask_the_token_that_would_complete_one():
    """A one-token bad word is never sampled; a longer one only once the outputs end with the
    rest of it (the prompt does not count)."""
    logits = torch.full((1, VOCAB), 0.0)
    logits[0, 7] = 9.0  # best
    logits[0, 3] = 8.0  # second
    logits[0, 9] = 7.0  # third
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[7], [3, 3]])
    # Steps: 7 banned -> 3; then 3 would complete [3, 3] -> 9; then 7 banned, 3 allowed again.
    assert sample_steps([params], [logits] * 3)[0] == [3, 9, 3]
    # The prompt ends with 3, but only outputs count: the first step may pick 3.
    batch, states = make_batch([params], prompts=[[1, 3]])
    md = batch.sampling_metadata(states, VOCAB)
    assert md.min_tokens_mask is not None
    assert md.min_tokens_mask[1].tolist() == [7]


def test_a_grammar_wins_over_min_tokens_on_its_own_rows_only():
    """Row 0 is constrained to EOS by its grammar (already applied to its logits) and has
    min_tokens; row 1 is free but its own masks leave it nothing. Only row 0 falls back to
    what its grammar allows; row 1 samples as it would in any batch."""
    logits = torch.full((2, VOCAB), -5.0)
    logits[0] = float("-inf")
    logits[0, EOS] = 1.0  # the grammar allows only EOS
    logits[1, 9] = 3.0  # what row 1 would take if its own masks were dropped
    params = [
        SamplingParams(temperature=0.0, min_tokens=3),
        SamplingParams(temperature=0.0, min_tokens=3, allowed_token_ids=[EOS]),
    ]
    batch, states = make_batch(params)
    sampler = Sampler(torch.Generator().manual_seed(0))
    alone = sampler(logits[1:].clone(), batch.sampling_metadata(states[1:], VOCAB))
    md = batch.sampling_metadata(states, VOCAB)
    md.constrained = torch.tensor([True, False])
    both = sampler(logits.clone(), md).sampled_token_ids.tolist()
    assert both[0] == EOS
    assert both[1] == alone.sampled_token_ids.item() != 9
