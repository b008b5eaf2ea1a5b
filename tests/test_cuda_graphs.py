"""The decode graphs' bucketing and padding, checked without a GPU.

The capture sizes follow vLLM's flags; a step's inputs padded to a size leave the real
rows' results unchanged. The padded steps run eagerly here (``capture_cuda_graphs(record=
False)``) over the Triton kernels in the interpreter: the same inputs, kernels and grids a
graph replays on a GPU, so what the CPU cannot check is the recording alone
(bench/gpu_decode.py measures that on a GPU).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from services.config import ConfigError, EngineConfig, ModelArchConfig
from services.gpu_worker.cuda_graphs import capture_sizes, padded_size
from services.gpu_worker.model_runner import ModelRunner
from services.gpu_worker.step_inputs import StepBuffers
from services.protocol import SamplingParams
from tests.test_model_runner import Driver

EIGHTS = list(range(8, 257, 8))


@pytest.mark.parametrize(
    ("sizes", "max_size", "max_num_seqs", "expected"),
    [
        (None, None, 256, [1, 2, 4, *EIGHTS]),  # default: up to min(512, max_num_seqs)
        (None, None, 1024, [1, 2, 4, *range(8, 513, 8)]),
        (None, None, 100, [1, 2, 4, *range(8, 97, 8), 100]),  # the largest batch has one
        (None, None, 3, [1, 2, 3]),
        (None, None, 1, [1]),
        (None, 32, 256, [1, 2, 4, 8, 16, 24, 32]),
        ([64], None, 256, [1, 2, 4, *range(8, 65, 8)]),  # one value: the pattern up to it
        ([64], 16, 256, [1, 2, 4, 8, 16]),
        ([5, 1, 3], None, 256, [1, 3, 5]),  # several: the sizes themselves
        ([1, 3, 500], None, 256, [1, 3]),  # none larger than any decode batch
        ([1, 3, 40], 8, 256, [1, 3]),
    ],
)
def test_capture_sizes(sizes, max_size, max_num_seqs, expected):
    assert capture_sizes(sizes, max_size, max_num_seqs) == expected


def test_padded_size():
    sizes = [1, 2, 4, 8, 16]
    assert [padded_size(sizes, n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [
        1, 2, 4, 4, 8, 8, 16, 16, None,
    ]  # fmt: skip


def test_graph_flags():
    config = EngineConfig.from_kwargs(cuda_graph_sizes="1 2 4", max_cudagraph_capture_size=4)
    assert config.worker.cuda_graph_sizes == [1, 2, 4]
    assert EngineConfig.from_kwargs(enforce_eager=True).worker.enforce_eager
    for bad in ({"cuda_graph_sizes": [0, 4]}, {"cuda_graph_sizes": "a b"},
                {"max_cudagraph_capture_size": 0}):  # fmt: skip
        with pytest.raises(ConfigError):
            EngineConfig.from_kwargs(**bad)


def test_padded_step_inputs():
    """Three decode requests padded to 4: the fourth has no query token and no context, the
    fourth token is padding (slot -1, id and position 0); the real rows are as unpadded."""
    table = np.arange(40, dtype=np.int32).reshape(4, 10)
    tokens = np.arange(400, dtype=np.int32).reshape(4, 100)
    rows, computed, scheduled = np.array([2, 0, 1]), np.array([5, 17, 0]), np.ones(3, np.int64)
    buffers = StepBuffers(8, 16, 10, torch.device("cpu"))
    args = (rows, computed, scheduled, table, 4)
    plain = buffers.prepare(*args, token_ids=tokens, sampling=np.arange(3))
    want = {
        "qsl": plain.attn_meta.query_start_loc.tolist(),
        "seq": plain.attn_meta.seq_lens.tolist(),
        "slots": plain.attn_meta.slot_mapping.tolist(),
        "ids": plain.input_ids.tolist(),
        "pos": plain.positions.tolist(),
        "table": plain.attn_meta.block_table.tolist(),
    }
    assert want["qsl"] == [0, 1, 2, 3] and want["seq"] == [6, 18, 1]
    assert want["slots"] == [21 * 4 + 1, 4 * 4 + 1, 10 * 4 + 0]  # the position's block, offset
    assert want["ids"] == [205, 17, 100] and want["pos"] == [5, 17, 0]
    padded = buffers.prepare(*args, token_ids=tokens, sampling=np.arange(3), pad_to=4,
                             max_seq_len=99)  # fmt: skip
    meta = padded.attn_meta
    assert meta.query_start_loc.tolist() == [*want["qsl"], 3]
    assert meta.seq_lens.tolist() == [*want["seq"], 0]
    assert meta.slot_mapping.tolist() == [*want["slots"], -1]
    assert padded.input_ids.tolist() == [*want["ids"], 0]
    assert padded.positions.tolist() == [*want["pos"], 0]
    assert meta.block_table.shape == (4, 10)  # the whole width: shapes depend on the size
    assert meta.block_table[:3, :5].tolist() == want["table"]
    assert meta.max_seq_len == 99 and padded.logits_indices.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="decode step"):
        buffers.prepare(rows, computed, np.array([1, 2, 1]), table, 4, pad_to=4)


def test_step_buffers_grow_and_say_so():
    buffers = StepBuffers(2, 4, 3, torch.device("cpu"))
    table = np.zeros((3, 3), dtype=np.int32)
    buffers.prepare(np.arange(2), np.zeros(2, np.int64), np.array([2, 2]), table, 4)
    assert buffers.generation == 0
    inputs = buffers.prepare(np.arange(3), np.zeros(3, np.int64), np.array([2, 2, 3]), table, 4)
    assert buffers.generation == 1 and inputs.num_tokens == 7
    assert inputs.attn_meta.query_start_loc.tolist() == [0, 2, 4, 7]


TINY = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 512,
}  # fmt: skip


# On a GPU host the same test captures real graphs (record=True) against eager steps.
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _tiny_runner(padded: bool, **extra) -> ModelRunner:
    arch = ModelArchConfig.from_hf_config(TINY)
    kwargs = dict(
        load_format="dummy", attention_backend="triton", device=DEVICE, dtype="float32",
        block_size=16, max_model_len=256, max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8],
        num_threads=1,
    )  # fmt: skip
    config = EngineConfig.from_kwargs(**(kwargs | extra))
    config.finalize(arch)
    runner = ModelRunner(config, None, arch=arch)
    runner.initialize_kv_cache(64)
    if padded:
        runner.capture_cuda_graphs(record=ON_GPU)
        assert runner.graphs is not None and runner.graphs.capture_graphs == ON_GPU
    else:
        runner.config.worker.enforce_eager = True
        runner.capture_cuda_graphs()  # nothing: on a CPU, or --enforce-eager
        assert runner.graphs is None
    return runner


def _drive(runner: ModelRunner, replays: list[int]) -> tuple[dict, list]:
    """Six requests, admitted two a step, prefilled in chunks, decoding in batches of
    1 to 6 (padded to 1, 2, 4 or 8), some sampling with seeds, all with logprobs."""
    if runner.graphs is not None:
        replay = runner.graphs.replay

        def spy(size: int) -> torch.Tensor:
            replays.append(size)
            return replay(size)

        runner.graphs.replay = spy  # type: ignore[method-assign]
    rng = random.Random(7)
    driver = Driver(runner)
    for i in range(6):
        prompt = [rng.randrange(256) for _ in range(rng.randint(3, 40))]
        sampling = (
            SamplingParams(temperature=0.0, logprobs=3)
            if i % 2
            else SamplingParams(temperature=0.8, top_p=0.9, seed=i, logprobs=3)
        )
        driver.add(f"r{i}", prompt, sampling=sampling, max_new=4 + 3 * i)
    logprobs: list = []
    step = driver.step

    def record(schedule: dict[str, int]):
        result = step(schedule)
        logprobs.append([(lp.token_id, lp.logprob) for lp in result.logprobs if lp])
        return result

    driver.step = record  # type: ignore[method-assign]
    driver.run(chunk=16, admit_per_step=2)
    return {r.req_id: r.output for r in driver.reqs.values()}, logprobs


def test_padded_decode_steps_equal_unpadded():
    """The same requests through an eager runner and one whose decode steps are padded to
    the capture sizes: the same tokens and logprobs, and the padded runner did pad."""
    eager_tokens, eager_lps = _drive(_tiny_runner(padded=False), [])
    replays: list[int] = []
    padded_runner = _tiny_runner(padded=True)
    tokens, lps = _drive(padded_runner, replays)
    assert tokens == eager_tokens
    assert len(lps) == len(eager_lps)
    for got, want in zip(lps, eager_lps, strict=True):
        assert [t for t, _ in got] == [t for t, _ in want]
        np.testing.assert_allclose(
            [x for _, x in got], [x for _, x in want], atol=1e-4 if ON_GPU else 1e-5
        )
    assert set(replays) >= {1, 4, 8}  # batches of 1, 3 or 4, 5 or 6 decodes
    assert padded_runner.graphs is not None and padded_runner.graphs.sizes == [1, 2, 4, 8]
    assert len(padded_runner.input_batch) == 0


def test_graph_sizes_stop_at_the_token_budget_and_growth_drops_them():
    """A decode step has a token a request: no graph larger than --max-num-batched-tokens
    (the buffers, sized for it, would grow and leave the graphs reading old ones); a step
    that grows the buffers anyway (a caller past the budget) drops the graphs."""
    runner = _tiny_runner(padded=True, max_num_batched_tokens=4)
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4]
    assert runner._graph_size(np.ones(3, np.int64)) == 4
    assert runner._graph_size(np.array([1, 2])) is None  # a prefill chunk: eager
    runner.buffers.reserve(16, 64)
    assert runner._graph_size(np.ones(3, np.int64)) is None and runner.graphs is None
    with pytest.raises(RuntimeError, match="after the CUDA graphs"):
        _tiny_runner(padded=True).initialize_kv_cache(64)
