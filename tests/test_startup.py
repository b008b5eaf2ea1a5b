"""Start-up of ``actorserve serve`` and the offline engine (issue 34): what the flags alone
decide is refused before anything loads or starts, as one ``error:`` line and exit 2 (a
port out of range or taken, weight and simulator flags a worker would refuse); a child's
own start-up error is one line too; the launcher logs a start-up summary; the offline
engine shows vLLM's "Processed prompts" bar unless told not to."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_utils import REPO, RemoteServer, free_port

FAST_S = 30.0  # a flag error must come well before any model loads (minutes, on 2 cores)


@pytest.fixture
def nothing_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_server`` may not prepare the model nor start a process."""
    import launch.serve

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was prepared before the flag error")

    monkeypatch.setattr(launch.serve, "prepare_engine_model", refuse)


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_server`` may prepare the model (finalize needs it) but start no process."""
    import launch.serve

    class NoLauncher:
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise AssertionError("a process was about to start before the flag error")

    monkeypatch.setattr(launch.serve, "Launcher", NoLauncher)


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another server listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def _serve(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    from launch.cli import main

    code = main(["serve", "--load-format", "dummy", *argv])
    return code, capsys.readouterr().err


# ---- 1. ports: in range, free, before the model loads


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--port", "99999"], "--port must be a port number (1-65535), got 99999"),
        (["--port", "0"], "--port must be a port number (1-65535), got 0"),
        (["--port", "-1"], "--port must be a port number (1-65535), got -1"),
        (["-tp", "2", "--master-port", "70000"], "--master-port must be a port number"),
        (["-dp", "2", "--master-port", "65535", "-tp", "2"], "the 1 after it are used too"),
        (
            ["--kv-events-endpoint", "tcp://127.0.0.1:70000"],
            "--kv-events-endpoint: 70000 is not a port number (1-65535)",
        ),
    ],
)
def test_port_out_of_range_is_one_line_before_loading(
    nothing_loads: None, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, err = _serve(capsys, *argv)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err


def _taken_cases(port: int) -> list[tuple[list[str], str]]:
    p2p = {"kv_connector": "p2p", "kv_role": "kv_producer", "kv_port": port}
    return [
        (["--port", str(port)], "--port: cannot bind 127.0.0.1:"),
        (["--host", "0.0.0.0", "--port", str(port)], "--port: cannot bind 0.0.0.0:"),
        (["-tp", "2", "--master-port", str(port)], "--master-port: cannot bind 127.0.0.1:"),
        (["--kv-events-endpoint", f"tcp://127.0.0.1:{port}"], "--kv-events-endpoint: cannot"),
        (["--kv-events-endpoint", f"tcp://*:{port}"], "--kv-events-endpoint: cannot bind"),
        (["-dp", "2", "-dpl", "1", "-dpp", str(port)], "--data-parallel-rpc-port: cannot"),
        (["--kv-transfer-config", json.dumps(p2p)], "--kv-transfer-config kv_port: cannot"),
    ]


@pytest.mark.parametrize("case", range(7))
def test_taken_port_is_one_line_before_loading(
    nothing_loads: None, taken_port: int, capsys: pytest.CaptureFixture[str], case: int
) -> None:
    argv, message = _taken_cases(taken_port)[case]
    if "--port" not in argv:
        argv = [*argv, "--port", str(free_port())]
    code, err = _serve(capsys, *argv)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {message}") and "already in use" in err, err


def test_free_ports_pass(nothing_loads: None, capsys: pytest.CaptureFixture[str]) -> None:
    """Free ports get past the check (to the model, which this test refuses)."""
    from launch.cli import main

    argv = ["serve", "--port", str(free_port()), "-tp", "2", "--master-port", str(free_port())]
    with pytest.raises(AssertionError, match="the model was prepared"):
        main([*argv, "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"])


def test_check_port_for_routers(taken_port: int) -> None:
    from launch.ports import check_port
    from services.config import ConfigError

    check_port("127.0.0.1", free_port())
    with pytest.raises(ConfigError, match="already in use"):
        check_port("127.0.0.1", taken_port)
    with pytest.raises(ConfigError, match="is not a port number"):
        check_port("127.0.0.1", 65536)


def test_taken_port_from_the_command_line(taken_port: int) -> None:
    """The user's view: one line, exit 2, within seconds, and no process started (no
    model-load or KV cache lines), where it used to be a traceback after the model load."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "serve", "--port", str(taken_port)],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=FAST_S * 2)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running after {FAST_S * 2:.0f} s:\n{err[-3000:]}")
    assert time.monotonic() - start < FAST_S, err
    assert proc.returncode == 2, err
    assert err == (
        f"error: --port: cannot bind 127.0.0.1:{taken_port}: the port is already in use "
        "(another server, or one still shutting down?)\n"
    ), err
    assert out == ""


# ---- 2. flags a worker would refuse: refused in the configuration, before any process


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--dtype", "bfloat16", "--cpu-activation-quant", "int8"],
            "--cpu-activation-quant int8 applies to a GGUF model's quantized matrices "
            "(Q4_0/Q4_1/Q8_0) on CPU with --dtype float32 and --quantization auto or gguf; "
            "not with --dtype bfloat16",
        ),
        (["--quantization", "none", "--cpu-activation-quant", "int8"], "not with --quantization"),
        (["--cpu-activation-quant", "int8"], "not with --load-format dummy"),
        (["--quantization", "gguf", "--dtype", "float16"], "--quantization gguf runs on the CPU"),
        (
            ["--worker-backend", "sim", "--sim-hardware", "h300"],
            "--sim-hardware 'h300' is neither a shipped device (a100, h100, h200, l40s) nor a "
            "JSON file",
        ),
        (["--worker-backend", "sim", "--sim-eos", "often"], "--sim-eos 'often': give fixed:N"),
        (["--worker-backend", "sim", "--sim-eos", "uniform:9,2"], "--sim-eos 'uniform:9,2'"),
    ],
)
def test_worker_flags_are_refused_in_configuration(
    nothing_loads: None, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, err = _serve(capsys, "--port", str(free_port()), *argv)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert message in err, err


def test_sim_hardware_files_are_checked(tmp_path: Path) -> None:
    from services.config import ConfigError, EngineConfig

    def hardware(**fields: object) -> str:
        path = tmp_path / f"hw{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps(fields))
        return str(path)

    good = {"name": "X1", "peak_flops": {"bf16": 1e15}, "memory_bandwidth": 1e12,
            "memory_capacity": 8e10}  # fmt: skip
    EngineConfig.from_kwargs(worker_backend="sim", sim_hardware=hardware(**good))
    bad = [
        ({**good, "peak_flops": {}}, {}, "needs peak_flops and memory_bandwidth > 0"),
        ({**good, "memory_bandwidth": "fast"}, {}, "needs peak_flops and memory_bandwidth"),
        (good, {"dtype": "float32"}, "the simulated X1 has no peak FLOP/s for fp32"),
        (good, {"tensor_parallel_size": 2}, "the simulated X1 has no interconnect_bandwidth"),
    ]
    for fields, kwargs, message in bad:
        with pytest.raises(ConfigError, match=message):
            EngineConfig.from_kwargs(
                worker_backend="sim", sim_hardware=hardware(**fields), **kwargs
            )
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="--sim-hardware .*broken.json"):
        EngineConfig.from_kwargs(worker_backend="sim", sim_hardware=str(tmp_path / "broken.json"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv-cache-memory-bytes", "1MiB"], "lower --max-model-len to at most"),
        (["--num-gpu-blocks-override", "8", "--max-model-len", "2048"], "(7 blocks of 16)"),
    ],
)
def test_kv_cache_too_small_is_refused_before_the_workers(
    nothing_starts: None, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, err = _serve(capsys, "--port", str(free_port()), *argv)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: the KV cache holds"), err
    assert message in err, err


def test_device_cuda_without_a_gpu(
    nothing_starts: None, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU")
    code, err = _serve(capsys, "--port", str(free_port()), "--device", "cuda")
    assert (code, err) == (2, "error: --device cuda was asked for but torch sees no CUDA device\n")


def test_kv_cache_precheck_boundary() -> None:
    """A pool of exactly one request (and the null block) passes, one block less is
    refused; a block is the model runner's (K and V rows of every layer, float32 here)."""
    from services.config import ConfigError, EngineConfig, ModelArchConfig
    from services.model_loader import load_hf_config, prepare_model

    arch = ModelArchConfig.from_hf_config(load_hf_config(prepare_model(None, "dummy")))
    row = arch.head_dim * 4  # float32 on the CPU
    block = 2 * arch.num_hidden_layers * 16 * arch.num_key_value_heads * row
    for blocks, ok in ((129, True), (128, False)):  # 2048 tokens: 128 blocks + the null one
        config = EngineConfig.from_kwargs(
            max_model_len=2048, kv_cache_memory_bytes=blocks * block, device="cpu"
        )
        if ok:
            config.finalize(arch)
        else:
            with pytest.raises(ConfigError, match="127 blocks of 16"):
                config.finalize(arch)


def test_quantization_flags_need_a_gguf_model(tmp_path: Path) -> None:
    from launch.serve import check_model_files
    from services.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="--quantization gguf needs a GGUF model"):
        check_model_files(EngineConfig.from_kwargs(quantization="gguf"), tmp_path)
    with pytest.raises(ConfigError, match="is not a GGUF model"):
        check_model_files(EngineConfig.from_kwargs(cpu_activation_quant="int8"), tmp_path)


def test_offline_engine_refuses_worker_flags_before_loading(monkeypatch) -> None:
    import launch.llm
    from services.config import ConfigError

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was prepared before the flag error")

    monkeypatch.setattr(launch.llm, "prepare_engine_model", refuse)
    with pytest.raises(ConfigError, match="not with --dtype bfloat16"):
        launch.llm.LLM(dtype="bfloat16", cpu_activation_quant="int8")
    with pytest.raises(ConfigError, match="--sim-hardware 'h300'"):
        launch.llm.LLM(worker_backend="sim", sim_hardware="h300")


# ---- a child's own start-up error: one line, and the server exits 2 with only that line


def test_child_model_load_error_is_one_line(tmp_path: Path) -> None:
    """A worker whose model cannot load (ModelLoadError) prints one line and exits 2."""
    import msgspec

    from services.config import ServeConfig

    config = ServeConfig(model_folder=str(tmp_path / "no-such-model"))
    run = subprocess.run(
        [sys.executable, "-m", "launch.child", "worker", "0", "0"],
        cwd=REPO,
        input=msgspec.json.encode(config),
        capture_output=True,
        env=dict(os.environ, ACTORSERVE_CONTROL=f"ipc://{tmp_path}/control"),
        timeout=120,
    )
    err = run.stderr.decode()
    lines = [line for line in err.splitlines() if not line.startswith(("INFO", "DEBUG"))]
    assert run.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err


def test_worker_start_up_error_is_the_servers_one_line(tmp_path: Path) -> None:
    """An error only the worker finds (here: --sim-eos names a file with no lengths) ends
    the server with the worker's one ``error:`` line, exit 2, no traceback."""
    lengths = tmp_path / "lengths.json"
    lengths.write_text("[]")
    with RemoteServer(
        "--worker-backend", "sim", "--sim-model", "qwen3-0.6b", "--sim-eos", str(lengths)
    ) as server:
        code = server.wait_exit(240)
        log = server.log
        assert code == 2, log
        errors = [line for line in log.splitlines() if line.startswith("error")]
        assert len(errors) == 1 and errors[0].startswith(f"error: --sim-eos '{lengths}'"), log
        assert "Traceback" not in log
        assert server.wait_all_gone(10) == []


# ---- 3. the start-up summary


def test_startup_summary_on_a_simulated_server() -> None:
    """Logged once the server is up, before the banner, with the values it runs with;
    with --sim-model the served name is the simulated model's, and the summary says so."""
    with RemoteServer(
        "--worker-backend", "sim", "--sim-model", "qwen3-0.6b", "--num-gpu-blocks-override",
        "300", "--async-scheduling", "--kv-cache-dtype", "fp8",
    ) as server:  # fmt: skip
        server.wait_ready()
        deadline = time.monotonic() + 60  # /health answers a moment before the banner
        while "actorserve is serving" not in (log := server.log) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert log.count("start-up summary:") == 1, log
    summary = log[log.index("start-up summary:") :]
    summary = summary[: summary.index("actorserve is serving")]  # before the banner
    expected = [
        "model: qwen3-0.6b (simulated; the tokenizer is the default's), Qwen3ForCausalLM",
        "served model name: qwen3-0.6b (the --sim-model's name, not --model's;",
        "dtype: bfloat16, quantization: none (simulated), device: sim",
        "kernels: none run: each step sleeps for the h200 roofline's time",
        "parallel: TP 1 x PP 1 x DP 1: 1 worker rank(s) per engine core",
        "KV cache: 4,784 tokens per engine core (300 blocks of 16), dtype fp8",
        "KV tiers and transfer: none",
        "prefix caching: on (sha256), chunked prefill: on, async scheduling: on, policy fcfs",
        "limits: max_model_len 2,048, max_num_seqs 256, max_num_batched_tokens 2,048",
    ]
    for text in expected:
        assert text in summary, (text, summary)
    assert "actorserve is serving qwen3-0.6b on" in log


def test_startup_summary_values() -> None:
    """The summary's lines from a configuration: the default model on the CPU."""
    from launch.cli import build_parser
    from launch.serve import startup_summary
    from services.config import ModelArchConfig, ServeConfig
    from services.model_loader import load_hf_config, prepare_model

    folder = prepare_model(None)
    hf = load_hf_config(folder)
    argv = ["serve", "--device", "cpu", "--max-model-len", "1024", "--no-enable-prefix-caching"]
    config = ServeConfig.from_cli(build_parser().parse_args(argv))
    config.engine.finalize(ModelArchConfig.from_hf_config(hf))
    config.model_folder, config.served_model_names = str(folder), ["smol"]
    config.num_blocks, config.kv_block_bytes = 101, 1 << 20
    text = "\n".join(startup_summary(config, hf))
    assert "served model name: smol\n" in text
    assert "dtype: float32, quantization: gguf (Q4_0/Q4_1/Q8_0 matrices kept quantized" in text
    assert "kernels: attention torch, C++ CPU ops (" in text
    assert "KV cache: 1,600 tokens per engine core (101 blocks of 16, 101.0 MiB), dtype auto " \
        "(float32)" in text  # fmt: skip
    assert "KV tiers and transfer: none" in text
    assert "prefix caching: off, chunked prefill: on, async scheduling: off" in text
    assert "limits: max_model_len 1,024, max_num_seqs 256, max_num_batched_tokens 512" in text


def test_startup_summary_tiers() -> None:
    from launch.serve import _tiers
    from services.config import KVTransferConfig

    offload = KVTransferConfig.from_flags(None, 1 << 30)
    assert _tiers(offload) == "offload (host memory, 1.0 GiB)"
    multi = KVTransferConfig.from_json(json.dumps({
        "kv_connector": "multi", "kv_role": "kv_producer", "kv_connector_extra_config": {
            "connectors": [{"kv_connector": "p2p", "kv_port": 15000},
                           {"kv_connector": "storage",
                            "kv_connector_extra_config": {"path": "/kv"}}]}}))  # fmt: skip
    assert _tiers(multi) == (
        "p2p (kv_producer, side channel 127.0.0.1:15000), storage (files in /kv)"
    )


# ---- 4. the offline progress bar


@pytest.fixture(autouse=True)
def _real_clock() -> Iterator[None]:
    """The offline engine on the simulated backend scales this process's clock: undo it."""
    yield
    from services import clock

    clock.set_sim_speed(1.0)


def _generate(capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    from launch.cli import main

    argv = ["generate", "one", "two", "three", "--max-tokens", "3", "--worker-backend", "sim",
            "--sim-model", "qwen3-0.6b", "--sim-speed", "0.001", "--num-gpu-blocks-override",
            "200", "--max-model-len", "512", *extra]  # fmt: skip
    assert main(argv) == 0
    return capsys.readouterr().err


def test_generate_shows_processed_prompts(capsys: pytest.CaptureFixture[str]) -> None:
    err = _generate(capsys)
    assert "Processed prompts: 100%" in err and "3/3" in err, err
    assert "est. speed input:" in err and "toks/s, output:" in err, err


@pytest.mark.parametrize("flag", ["--disable-tqdm", "--no-progress"])
def test_generate_progress_off(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    assert "Processed prompts" not in _generate(capsys, flag)


def test_llm_use_tqdm(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's ``use_tqdm``: on by default, False hides it, a callable replaces tqdm."""
    from launch.llm import LLM, SamplingParams

    llm = LLM(worker_backend="sim", sim_model="qwen3-0.6b", sim_speed=0.001,
              num_gpu_blocks_override=200, max_model_len=512)  # fmt: skip
    params = SamplingParams(max_tokens=2, n=2)
    capsys.readouterr()
    llm.generate(["a", "b"], params)
    assert "Processed prompts: 100%" in capsys.readouterr().err
    llm.generate(["a", "b"], params, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    bars: list[dict] = []

    class Bar:
        def __init__(self, **kwargs: object) -> None:
            self.kwargs, self.done, self.postfix = kwargs, 0, ""
            self.format_dict = {"elapsed": 1.0}
            bars.append(self.__dict__)

        def update(self, n: int) -> None:
            self.done += n

        def close(self) -> None:
            pass

    llm.chat([[{"role": "user", "content": "hi"}]] * 3, params, use_tqdm=Bar)
    assert bars[0]["kwargs"]["total"] == 3 and bars[0]["done"] == 3
    assert bars[0]["kwargs"]["desc"] == "Processed prompts"
    assert bars[0]["postfix"].startswith("est. speed input: ")
