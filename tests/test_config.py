"""What EngineConfig.finalize derives from the model and the device: the default token
budget (--max-num-batched-tokens) and max_model_len."""

from __future__ import annotations

import pytest

from services.config import ConfigError, EngineConfig, ModelArchConfig


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"device": "cpu"}, 512),
        ({"device": "cuda"}, 2048),
        ({"device": "cpu", "max_num_batched_tokens": 4096}, 4096),  # a given value wins
        ({"device": "cpu", "enable_chunked_prefill": False}, 1000),  # whole prompts must fit
        ({"device": "cuda", "enable_chunked_prefill": False}, 2048),
    ],
)
def test_default_token_budget(kwargs: dict, expected: int) -> None:
    """--max-num-batched-tokens left unset resolves per device at finalize time."""
    arch = ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=128,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=1000,
    )  # fmt: skip
    config = EngineConfig.from_kwargs(**kwargs)
    if "max_num_batched_tokens" not in kwargs:
        with pytest.raises(ValueError, match="finalize"):
            _ = config.scheduler.token_budget
    config.finalize(arch)
    assert config.scheduler.token_budget == expected


def _hf_config(**extra) -> dict:
    return {
        "architectures": ["MistralForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "max_position_embeddings": 32768, **extra,
    }  # fmt: skip


@pytest.mark.parametrize(
    "extra, given, expected",
    [
        ({"sliding_window": 4096}, None, 4096),  # Mistral v0.1: capped to the window
        ({"sliding_window": 4096}, 2048, 2048),
        ({"sliding_window": None}, None, 32768),  # Mistral v0.2+
        ({"sliding_window": 4096, "use_sliding_window": False}, None, 32768),  # Qwen2's configs
        ({}, 32768, 32768),
        ({"sliding_window": 4096}, 8192, "sliding window"),
        ({}, 40000, "max_position_embeddings"),
    ],
)
def test_max_model_len_from_the_model(extra: dict, given: int | None, expected) -> None:
    """max_model_len defaults to what the model computes correctly here; more is refused."""
    arch = ModelArchConfig.from_hf_config(_hf_config(**extra))
    config = EngineConfig.from_kwargs(device="cpu", max_model_len=given)
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected):
            config.finalize(arch)
        return
    config.finalize(arch)
    assert config.scheduler.max_model_len == expected


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"max_model_len": "2k"}, ("scheduler", "max_model_len", 2000)),  # the CLI's parser
        ({"tensor_parallel_size": "2"}, ("parallel", "tensor_parallel_size", 2)),
        ({"gpu_memory_utilization": 1}, ("cache", "gpu_memory_utilization", 1.0)),
        ({"enable_prefix_caching": "false"}, "enable_prefix_caching must be bool"),
        ({"block_size": 16.0}, "block_size must be int"),
        ({"max_num_seqs": True}, "max_num_seqs must be int"),
        ({"max_model_len": "long"}, "max_model_len must be int"),
        ({"seed": None}, "seed must not be None"),
    ],
)
def test_engine_arguments_are_typed(kwargs: dict, expected) -> None:
    """Offline keyword arguments get the CLI's types, or a ConfigError naming the argument."""
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected):
            EngineConfig.from_kwargs(**kwargs)
        return
    section, name, value = expected
    got = getattr(getattr(EngineConfig.from_kwargs(**kwargs), section), name)
    assert got == value and type(got) is type(value)


def test_data_parallel_needs_a_hash_every_process_computes_alike() -> None:
    with pytest.raises(ConfigError, match="builtin hashes differ from process to process"):
        EngineConfig.from_kwargs(data_parallel_size=2, prefix_caching_hash_algo="builtin")
