"""Engine flags a worker would refuse once started, refused by the configuration instead.

``EngineConfig.validate`` and ``finalize`` call ``check_worker_flags``, so ``actorserve serve`` (and the
offline ``LLM``) prints one ``error:`` line and exits 2 before any process starts or any
weight loads. What only the worker can know (the CPU's instruction set, the GPU's compute
capability, the memory left after the weights) stays the worker's, as one line too
(``launch/child.py``).

- ``check_sim_hardware``, ``check_sim_eos``: ``--worker-backend sim``'s device and output
  lengths (the sim worker's ``SimHardware.load`` and ``OutputLengths`` rules, read here by
  path: configuration imports no service);
- ``check_weight_flags``: ``--quantization`` and ``--cpu-activation-quant`` against
  ``--dtype``, ``--load-format`` and the device (the model runner's rules);
- ``check_kv_fits``: with ``--kv-cache-memory-bytes`` or ``--num-gpu-blocks-override`` the
  pool is known before the weights load; one request of ``--max-model-len`` must fit
  (``services/kv_cache/capacity.py``'s rule, with the model runner's block size).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from services.flags import ConfigError
from services.model_arch import ModelArchConfig, kv_row_bytes
from services.parallel_config import ParallelConfig


class EngineConfig(Protocol):
    """What these checks read of ``services/config/engine.py:EngineConfig`` (which imports
    this module, so not the other way round)."""

    model: Any
    cache: Any
    scheduler: Any
    worker: Any
    parallel: ParallelConfig

    def resolved_dtype(self, device: str | None) -> str: ...


# --sim-hardware's shipped devices: the sim worker's files
SIM_HARDWARE_DIR = Path(__file__).resolve().parents[1] / "gpu_worker" / "sim" / "hardware"
_SIM_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # peak_flops' keys
INT8_ACTIVATIONS = (
    "--cpu-activation-quant int8 applies to a GGUF model's quantized matrices "
    "(Q4_0/Q4_1/Q8_0) on CPU with --dtype float32 and --quantization auto or gguf"
)


def sim_hardware_names() -> list[str]:
    """The shipped simulated devices (``--sim-hardware NAME``)."""
    return sorted(p.stem for p in SIM_HARDWARE_DIR.glob("*.json"))


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def check_sim_hardware(name_or_path: str, dtype: str, needs_link: bool) -> None:
    """``--sim-hardware``: a shipped device or a JSON file with ``peak_flops`` (one for
    ``dtype``, a canonical ``--dtype`` name, unless auto) and ``memory_bandwidth``, and an
    ``interconnect_bandwidth`` when ranks talk (``needs_link``: TP, PP or lock-step EP)."""
    shipped = SIM_HARDWARE_DIR / f"{name_or_path}.json"
    path = shipped if shipped.exists() else Path(name_or_path).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"--sim-hardware {name_or_path!r} is neither a shipped device "
            f"({', '.join(sim_hardware_names())}) nor a JSON file"
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--sim-hardware {path}: {e}") from None
    peak = raw.get("peak_flops") if isinstance(raw, dict) else None
    if (
        not isinstance(peak, dict)
        or not peak
        or not all(_positive(v) for v in peak.values())
        or not _positive(raw.get("memory_bandwidth"))
    ):
        raise ConfigError(f"--sim-hardware {path}: needs peak_flops and memory_bandwidth > 0")
    name = raw.get("name", name_or_path)
    key = _SIM_DTYPES.get(dtype, dtype)
    if dtype != "auto" and key not in peak:
        raise ConfigError(
            f"the simulated {name} has no peak FLOP/s for {key} (--dtype {dtype}); "
            f"it lists {', '.join(peak)}"
        )
    if needs_link and not _positive(raw.get("interconnect_bandwidth")):
        raise ConfigError(
            f"the simulated {name} has no interconnect_bandwidth for TP, PP or EP; "
            f"add one to {path} or run one rank"
        )


def check_sim_eos(spec: str) -> None:
    """``--sim-eos``'s form (a JSON file's lengths are the sim worker's to read)."""
    kind, _, args = spec.partition(":")
    try:
        nums = [float(x) for x in args.split(",")] if args else []
    except ValueError:
        nums = []
    ok = (
        (kind == "fixed" and len(nums) == 1)
        or (kind == "uniform" and len(nums) == 2 and nums[0] <= nums[1])
        or (kind == "exp" and len(nums) == 1 and nums[0] > 0)
        or (kind == "lognormal" and len(nums) == 2 and nums[0] > 0)
    )
    if not ok and not Path(spec).is_file():
        raise ConfigError(
            f"--sim-eos {spec!r}: give fixed:N, uniform:LO,HI, exp:MEAN, "
            "lognormal:MEDIAN,SIGMA or a JSON file of lengths"
        )


def check_worker_flags(
    config: EngineConfig, device: str | None, arch: ModelArchConfig | None = None
) -> None:
    """The worker backend's flags: ``validate``'s part (``device`` None while auto, no
    ``arch``), then ``finalize``'s (the resolved device, or "sim", and the model's arch)."""
    w, p = config.worker, config.parallel
    if w.worker_backend == "sim":
        if arch is None:
            links = p.tensor_parallel_size > 1 or p.pipeline_parallel_size > 1 or p.dp_lockstep
            check_sim_hardware(w.sim_hardware, config.resolved_dtype(None), links)
            if w.sim_eos is not None:
                check_sim_eos(w.sim_eos)
        return  # its KV blocks are the modelled device's (sim/worker.py)
    dtype = config.resolved_dtype(device)
    check_weight_flags(config, dtype, device)
    if arch is not None:
        check_kv_fits(config, arch, dtype)


def check_weight_flags(config: EngineConfig, dtype: str, device: str | None) -> None:
    """``--quantization`` and ``--cpu-activation-quant`` against ``dtype`` (canonical,
    ``auto`` while the device is not known), ``--load-format`` and ``device`` (None: not
    known yet), as the model runner would refuse them once its weights are loading."""
    m = config.model
    if m.quantization == "gguf" and (device == "cuda" or dtype == "float16"):
        raise ConfigError(
            "--quantization gguf runs on the CPU kernels with --dtype float32 or bfloat16 "
            f"(device {device or 'cpu'}, dtype {dtype}); use --quantization none"
        )
    if m.quantization == "gguf" and m.load_format == "safetensors":
        raise ConfigError("--quantization gguf needs a GGUF model, not --load-format safetensors")
    if m.cpu_activation_quant != "int8":
        return
    why = (
        "--quantization none" if m.quantization == "none"
        else f"--dtype {m.dtype}" if dtype not in ("auto", "float32")
        else "--device cuda" if device == "cuda"
        else f"--load-format {m.load_format}" if m.load_format in ("dummy", "safetensors")
        else None
    )  # fmt: skip
    if why is not None:
        raise ConfigError(f"{INT8_ACTIVATIONS}; not with {why}")


def check_kv_fits(config: EngineConfig, arch: ModelArchConfig, dtype: str) -> None:
    """One request of ``--max-model-len`` must fit a pool known before any weight loads
    (``--num-gpu-blocks-override``, or ``--kv-cache-memory-bytes`` over the model runner's
    block: K and V rows of this stage's layers and this rank's KV heads; ``dtype`` is the
    resolved model dtype). Else the worker measures the pool and checks it itself."""
    c, p = config.cache, config.parallel
    if c.num_gpu_blocks_override is not None:
        num_blocks = c.num_gpu_blocks_override
    elif c.kv_cache_memory_bytes is not None:
        tp, kv_heads = p.tensor_parallel_size, arch.num_key_value_heads
        heads = kv_heads // tp if kv_heads >= tp else 1  # this rank's (HeadShard's rule)
        layers = max(end - start for start, end in p.stage_layers(arch.num_hidden_layers))
        row = kv_row_bytes(c.kv_cache_dtype, arch.head_dim, 4 if dtype == "float32" else 2)
        block_bytes = 2 * layers * c.block_size * heads * row
        num_blocks = c.kv_cache_memory_bytes // block_bytes
        if num_blocks < 1:
            raise ConfigError(
                f"no KV cache block fits --kv-cache-memory-bytes {c.kv_cache_memory_bytes} "
                f"({block_bytes} bytes per block); raise it"
            )
    else:
        return
    max_len = config.scheduler.resolved_max_model_len
    usable = max(num_blocks - 1, 0)  # the null block holds no tokens
    need = -(-max_len // c.block_size)
    if usable < need:
        tokens = usable * c.block_size
        raise ConfigError(
            f"the KV cache holds {tokens:,} tokens ({usable} blocks of {c.block_size}) "
            f"but one request of --max-model-len {max_len:,} needs "
            f"{need * c.block_size:,} ({need} blocks); lower --max-model-len to at most "
            f"{tokens:,}, or give the KV cache more memory (--kv-cache-memory-bytes, "
            "--num-gpu-blocks-override)"
        )
