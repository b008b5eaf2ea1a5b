"""What EngineConfig.finalize derives from the model and the device: the default token
budget (--max-num-batched-tokens) and max_model_len; the server's flags as ServeConfig
fields (listed, read back typed, checked with the same messages)."""

from __future__ import annotations

import pytest

from services import registry
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


def _serve_config(*argv: str):
    from launch.cli import build_parser
    from services.config import ServeConfig

    return ServeConfig.from_cli(build_parser().parse_args(["serve", *argv]))


def test_every_server_field_with_flag_metadata_is_a_serve_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A ServeConfig or RequestLimits field with flag(...) metadata is in ``actorserve serve
    --help`` under its flag name (the field's, or vLLM's when it differs)."""
    import re

    from launch.cli import main
    from services.config import RequestLimits, ServeConfig
    from services.flags import flag_fields, flag_name

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    listed = set(re.findall(r"--[a-z0-9-]+", capsys.readouterr().out))
    names = {flag_name(f) for cls in (ServeConfig, RequestLimits) for f in flag_fields(cls)}
    assert {"--served-model-name", "--uvicorn-log-level", "--api-key", "--max-n"} <= names
    assert names <= listed, names - listed


@pytest.mark.parametrize(
    "argv, path, expected",
    [
        ([], ("port",), 8000),
        (["--port", "9001"], ("port",), 9001),
        (["--host", "0.0.0.0"], ("host",), "0.0.0.0"),
        (["--served-model-name", "a", "b"], ("served_model_names",), ["a", "b"]),
        (["--api-key", "k"], ("api_key",), "k"),
        (["--shutdown-timeout", "2.5"], ("shutdown_timeout",), 2.5),
        (["--enable-request-id-headers"], ("enable_request_id_headers",), True),
        (["--uvicorn-log-level", "debug"], ("log_level",), "debug"),
        ([], ("log_level",), "warning"),
        (["--enable-log-requests", "--enable-log-outputs"], ("enable_log_outputs",), True),
        (["--tool-call-parser", "hermes"], ("tool_call_parser",), "hermes"),
        (["--chat-template", "{{ messages }}"], ("chat_template",), "{{ messages }}"),
        (["--max-request-body-bytes", "1MiB"], ("limits", "max_request_body_bytes"), 1 << 20),
        (["--max-n", "4"], ("limits", "max_n"), 4),
        (["--max-num-seqs", "7"], ("engine", "scheduler", "max_num_seqs"), 7),
        (["--headless"], ("headless",), True),
        (["--kv-events-endpoint", "auto"], ("kv_events_endpoint",), "auto"),
        (["--kv-offload-bytes", "1GiB"], ("engine", "kv_transfer", "kv_connector"), "offload"),
        (["--kv-offloading-size", "0.5"], ("kv_offloading_size",), 0.5),
        (
            ["--kv-offloading-size", "0.5"],
            ("engine", "kv_transfer", "kv_connector_extra_config", "kv_offload_bytes"),
            1 << 29,
        ),
        (
            ["--kv-transfer-config", '{"kv_connector": "p2p", "kv_role": "kv_consumer"}'],
            ("engine", "kv_transfer", "kv_role"),
            "kv_consumer",
        ),
    ],
)
def test_serve_flags_round_trip(argv: list[str], path: tuple[str, ...], expected) -> None:
    """parse -> ServeConfig.from_cli -> the field holds the flag's value, typed."""
    value = _serve_config(*argv)
    for name in path:
        value = value[name] if isinstance(value, dict) else getattr(value, name)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tokenizer-workers", "0"], "--tokenizer-workers must be at least 1"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
        (["--log-stats-interval", "-1"], "--log-stats-interval must be positive"),
        (["--enable-log-outputs"], "--enable-log-outputs needs --enable-log-requests"),
        (["--max-log-len", "-1"], "--max-log-len must be at least 0"),
        (["--max-n", "0"], "--max-n must be at least 1"),
        (["--stream-send-timeout", "nan"], "--stream-send-timeout must be a positive number"),
        (["--max-logprobs", "-2"], "--max-logprobs must be -1"),
        (["--chat-template", "no/such/file.jinja"], "neither a file nor a template"),
        (
            ["--kv-offload-bytes", "1GiB", "--kv-offloading-size", "1"],
            "give --kv-offload-bytes or --kv-offloading-size, not both",
        ),
        (["--kv-transfer-config", '{"kv_connector": "nope"}'], "kv_connector must be one of"),
    ],
)
def test_bad_serve_flag_is_a_clear_error(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _serve_config(*argv)


def test_bad_serve_flag_exits_with_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI prints the validation error as one ``error:`` line and exits 2."""
    from launch.cli import main

    assert main(["serve", "--tokenizer-workers", "0", "--load-format", "dummy"]) == 2
    assert capsys.readouterr().err == "error: --tokenizer-workers must be at least 1\n"
    with pytest.raises(SystemExit) as e:  # a value of the wrong type: argparse's own error
        main(["serve", "--port", "eighty"])
    assert e.value.code == 2 and "--port: invalid int value: 'eighty'" in capsys.readouterr().err


def test_every_registered_part_resolves() -> None:
    """Each name in services/registry.py (what the flags accept) imports as what it claims."""
    from services.api_server.tool_calls import CallStream
    from services.gpu_worker.attention.base import AttentionBackend
    from services.gpu_worker.base import WorkerBackend
    from services.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker

    classes = [
        (registry.WORKER_BACKENDS, WorkerBackend),
        (registry.ATTENTION_BACKENDS, AttentionBackend),
        (registry.TOOL_CALL_PARSERS, CallStream),
    ]
    for names, base in classes:
        for target in names.values():
            assert issubclass(registry.resolve(target), base), target
    for scheduler_half, worker_half in registry.KV_CONNECTORS.values():
        assert issubclass(registry.resolve(scheduler_half), KVConnectorScheduler)
        assert issubclass(registry.resolve(worker_half), KVConnectorWorker)
    for target in registry.SCHEDULING_POLICIES.values():
        queue = registry.resolve(target)()
        assert len(queue) == 0 and callable(queue.add) and callable(queue.pop)
    for target in registry.HASH_ALGORITHMS.values():
        assert registry.resolve(target)((None, (1, 2, 3))) == registry.resolve(target)(
            (None, (1, 2, 3))
        )
    for target in registry.GRAMMAR_BACKENDS.values():
        assert hasattr(registry.resolve(target), "matcher"), target
    with pytest.raises(ValueError, match="unknown worker backend 'nope'; choose one of torch"):
        registry.load("worker backend", registry.WORKER_BACKENDS, "nope")
