"""InputBatch.sampling_metadata through per-row arrays and one staging buffer: the same
metadata as the per-step ``torch.tensor(list)`` build it replaced (kept below as the
reference), through row reuse and growth, and the common path allocates nothing on the
device."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from services.gpu_worker.input_batch import CachedRequestState, InputBatch
from services.gpu_worker.sampler import Penalties, Sampler, SamplingMetadata
from services.protocol import NewRequest, SamplingParams

VOCAB = 64
EOS = 5
CPU = torch.device("cpu")


def reference_metadata(
    batch: InputBatch, states: list[CachedRequestState], vocab_size: int
) -> SamplingMetadata:
    """The metadata as it was built before the staging buffer: a tensor per parameter
    from Python lists, each step, every loop over every state."""
    params = [s.sampling for s in states]
    dev = batch.device
    greedy = [p.greedy for p in params]
    temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
    top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]

    def tensor_if(cond: bool, values: list, dtype: torch.dtype) -> torch.Tensor | None:
        return torch.tensor(values, dtype=dtype, device=dev) if cond else None

    md = SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32, device=dev),
        greedy=torch.tensor(greedy, dtype=torch.bool, device=dev),
        all_greedy=all(greedy),
        top_k=tensor_if(any(k < vocab_size for k in top_k), top_k, torch.int64),
        top_p=tensor_if(
            any(p.top_p < 1.0 for p in params), [p.top_p for p in params], torch.float32
        ),  # fmt: skip
        min_p=tensor_if(
            any(p.min_p > 0.0 for p in params), [p.min_p for p in params], torch.float32
        ),  # fmt: skip
        generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
    )
    if any(
        p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
        for p in params
    ):
        prompt_ids, output_ids = batch._penalty_tokens(states, vocab_size)
        md.penalties = Penalties(
            presence=torch.tensor([p.presence_penalty for p in params], device=dev),
            frequency=torch.tensor([p.frequency_penalty for p in params], device=dev),
            repetition=torch.tensor([p.repetition_penalty for p in params], device=dev),
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
        )
    rows, toks = batch._bad_words(states, vocab_size)
    for i, s in enumerate(states):
        if s.num_tokens - s.num_prompt_tokens < s.sampling.min_tokens:
            stop = list(s.sampling.stop_token_ids)
            if s.eos_token_id is not None and not s.sampling.ignore_eos:
                stop.append(s.eos_token_id)
            stop = [t for t in stop if 0 <= t < vocab_size]
            rows += [i] * len(stop)
            toks += stop
    if rows:
        md.min_tokens_mask = (torch.tensor(rows, device=dev), torch.tensor(toks, device=dev))
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    md.max_num_logprobs = max(wanted) if wanted else None
    batch._token_limits(md, states, vocab_size)
    return md


def _same_tensor(got: torch.Tensor | None, want: torch.Tensor | None, what: str) -> None:
    assert (got is None) == (want is None), what
    if got is not None and want is not None:
        assert got.dtype == want.dtype and got.device == want.device, what
        assert torch.equal(got, want), f"{what}: {got} != {want}"


def assert_same_metadata(got: SamplingMetadata, want: SamplingMetadata) -> None:
    for name in ("temperature", "greedy", "top_k", "top_p", "min_p", "disallowed_mask"):
        _same_tensor(getattr(got, name), getattr(want, name), name)
    assert got.all_greedy == want.all_greedy
    assert got.max_num_logprobs == want.max_num_logprobs
    assert list(got.generators) == list(want.generators)
    assert all(got.generators[i] is want.generators[i] for i in want.generators)
    assert (got.penalties is None) == (want.penalties is None)
    if got.penalties is not None and want.penalties is not None:
        for name in ("presence", "frequency", "repetition", "prompt_token_ids",
                     "output_token_ids"):  # fmt: skip
            _same_tensor(getattr(got.penalties, name), getattr(want.penalties, name), name)
    for name in ("min_tokens_mask", "logit_bias"):
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), name
        if g is not None:
            for a, b in zip(g, w, strict=True):
                _same_tensor(a, b, name)


MIXED = [
    SamplingParams(temperature=0.0),  # greedy
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.1, top_k=7),
    SamplingParams(temperature=0.6, top_p=0.85),
    SamplingParams(temperature=0.9, min_p=0.07),
    SamplingParams(temperature=0.7, top_k=12, top_p=0.9, min_p=0.02, seed=11),  # seeded
    SamplingParams(top_k=1),  # greedy by top_k
    SamplingParams(temperature=1e-6, seed=3),  # greedy: no generator
    SamplingParams(temperature=1.3, top_k=-1, seed=5),
    SamplingParams(temperature=0.5, top_k=VOCAB + 10),  # past the vocab: not set
]
RARE = [
    SamplingParams(temperature=0.9, repetition_penalty=1.2, presence_penalty=0.3),
    SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7, VOCAB + 1]),
    SamplingParams(temperature=0.8, bad_words_token_ids=[[9], [4, 4]]),
    SamplingParams(temperature=0.0, logit_bias={3: 2.0, VOCAB: 1.0}, logprobs=2),
    SamplingParams(temperature=1.0, allowed_token_ids=[1, 2, 3], logprobs=0, seed=8),
]


def random_params(rng: random.Random) -> SamplingParams:
    return rng.choice(MIXED + RARE)


def add(batch: InputBatch, req_id: str, params: SamplingParams, prompt_len: int = 3) -> None:
    prompt = [(7 * len(req_id) + i) % VOCAB for i in range(prompt_len)]
    batch.add(NewRequest(req_id, prompt, prompt_len, params, [], prompt_len, EOS))


def test_mixed_batch_matches_the_per_step_build():
    batch = InputBatch(max_num_reqs=16, max_model_len=64, block_size=16, device=CPU)
    for i, p in enumerate(MIXED + RARE):
        add(batch, f"r{i}", p)
    states = list(batch.requests.values())
    rng = np.random.default_rng(0)
    for step in range(6):
        subsets = [states, states[: len(MIXED)], states[::-1], [states[0]], [states[6], states[7]]]
        subsets.append([states[i] for i in rng.permutation(len(states))[:5]])
        for subset in subsets:
            got = batch.sampling_metadata(subset, VOCAB)
            assert_same_metadata(got, reference_metadata(batch, subset, VOCAB))
            rows = np.array([s.row for s in subset], dtype=np.int64)
            assert_same_metadata(
                batch.sampling_metadata(subset, VOCAB, rows=rows),
                reference_metadata(batch, subset, VOCAB),
            )
        rows = np.array([s.row for s in states], dtype=np.int64)
        batch.append_tokens(rows, (rows * 3 + step) % VOCAB, states)


def test_rows_recycled_and_grown_keep_their_parameters():
    """Random adds and removes from 2 rows: rows are reused and the arrays (and the staging
    buffer) grow past max_num_reqs; every step's metadata is the reference's."""
    rng = random.Random(1)
    batch = InputBatch(max_num_reqs=2, max_model_len=64, block_size=16, device=CPU)
    next_id = 0
    used_rows: set[int] = set()
    reused = False
    for _ in range(300):
        if batch.requests and (rng.random() < 0.4 or len(batch) > 20):
            batch.remove(rng.choice(list(batch.requests)))
        else:
            add(batch, f"q{next_id}", random_params(rng), prompt_len=rng.randint(1, 5))
            row = batch.requests[f"q{next_id}"].row
            reused |= row in used_rows
            used_rows.add(row)
            next_id += 1
        states = list(batch.requests.values())
        rng.shuffle(states)
        states = states[: rng.randint(0, len(states))]
        if states:
            assert_same_metadata(
                batch.sampling_metadata(states, VOCAB), reference_metadata(batch, states, VOCAB)
            )
    assert reused
    assert batch.token_ids.shape[0] > 2
    assert batch.temperature_cpu.shape[0] == batch.token_ids.shape[0]
    assert batch._staging.capacity == batch.token_ids.shape[0]


def test_sampled_tokens_are_bit_identical_to_the_per_step_build():
    """Two identical batches (each request's generator is its own), one sampled with the
    reference metadata and one with the staged: the same tokens, step after step."""

    def run(staged: bool) -> list[list[int]]:
        batch = InputBatch(max_num_reqs=4, max_model_len=64, block_size=16, device=CPU)
        for i, p in enumerate(MIXED + RARE):
            add(batch, f"r{i}", p)
        states = list(batch.requests.values())
        sampler = Sampler(torch.Generator().manual_seed(0))
        gen = torch.Generator().manual_seed(1)
        out = []
        for _ in range(8):
            logits = torch.randn(len(states), VOCAB, generator=gen) * 3
            md = (
                batch.sampling_metadata(states, VOCAB)
                if staged
                else reference_metadata(batch, states, VOCAB)
            )
            tokens = sampler(logits, md).sampled_token_ids
            rows = np.array([s.row for s in states], dtype=np.int64)
            batch.append_tokens(rows, tokens.numpy(), states)
            out.append(tokens.tolist())
        return out

    assert run(staged=True) == run(staged=False)


def test_common_path_uses_the_preallocated_buffer(monkeypatch):
    """After start-up no tensor is built for greedy / temperature / top-k / top-p / min-p /
    seeded rows: the metadata are views of the one device buffer, the same every step, and
    torch.tensor / as_tensor are never called (a reintroduced torch.tensor(list) fails)."""
    batch = InputBatch(max_num_reqs=16, max_model_len=64, block_size=16, device=CPU)
    for i, p in enumerate(MIXED):
        add(batch, f"r{i}", p)
    states = list(batch.requests.values())
    stage = batch._staging
    base = stage.device_buf.untyped_storage().data_ptr()
    host_base = stage.host_buf.untyped_storage().data_ptr()

    def forbidden(*args, **kwargs):
        raise AssertionError("the common sampling path built a tensor")

    monkeypatch.setattr(torch, "tensor", forbidden)
    monkeypatch.setattr(torch, "as_tensor", forbidden)
    for subset in (states, states[:1], states[2:5], states[::-1]):
        md = batch.sampling_metadata(subset, VOCAB)
        views = [md.temperature, md.greedy, md.top_k, md.top_p, md.min_p]
        if subset is states:
            assert all(v is not None for v in views)
        for v in views:
            if v is not None:
                assert v.untyped_storage().data_ptr() == base
                assert v.shape == (len(subset),)
        assert md.penalties is None and md.min_tokens_mask is None
        assert md.logit_bias is None and md.disallowed_mask is None
    monkeypatch.undo()
    assert stage is batch._staging  # not reallocated
    assert stage.device_buf.untyped_storage().data_ptr() == base
    assert stage.host_buf.untyped_storage().data_ptr() == host_base


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_common_path_does_not_sync_on_cuda():
    """With CUDA's sync debug mode set to error, building the metadata and sampling the
    common path (greedy, temperature, top-k/top-p, min-p, seeded rows) never syncs; only
    the sampled ids coming back do."""
    dev = torch.device("cuda")
    batch = InputBatch(max_num_reqs=16, max_model_len=64, block_size=16, device=dev)
    for i, p in enumerate(MIXED):
        add(batch, f"r{i}", p)
    states = list(batch.requests.values())
    sampler = Sampler(torch.Generator(dev).manual_seed(0))
    logits = torch.randn(len(states), VOCAB, device=dev)
    rows = np.array([s.row for s in states], dtype=np.int64)
    for _ in range(2):  # the first step warms up (lazy CUDA init, the event)
        md = batch.sampling_metadata(states, VOCAB, rows=rows)
        sampler(logits, md).sampled_token_ids.cpu()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for subset in (states, states[:1], states[1:6]):
            md = batch.sampling_metadata(subset, VOCAB)
            out = sampler(logits[: len(subset)], md)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = reference_metadata(batch, subset, VOCAB)
    assert_same_metadata(md, ref)
    assert out.sampled_token_ids.cpu().shape == (len(subset),)
