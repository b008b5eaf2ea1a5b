"""The step time of a simulated device: a roofline per operation (Vidur's idea without its
profiling; the seeds' reasoning: prefill is compute-bound, decode bandwidth-bound).

For one rank of a model split ``tp`` ways and over ``pp`` stages, a step of the real
StepPlan costs, per layer of the rank's stage:

- each linear (fused QKV, O, fused gate/up, down) as one GEMM over the step's ``T`` tokens:
  ``max(bytes / (bandwidth * bandwidth_efficiency), flops / (peak * compute_efficiency))``
  with ``flops = 2 * T * params`` and ``bytes = (params + T * (in + out)) * dtype bytes``
  (and, where the device file says so, a peak that small GEMMs only approach:
  ``peak * T / (T + gemm_half_tokens)``);
- attention over each request's real context: ``flops = 4 * heads * head_dim * sum over
  the new tokens of the context each attends to`` (causal inside a prefill chunk) and
  ``bytes`` = the KV it reads and writes plus its queries and outputs, one roofline for the
  whole batch (one kernel launch);
- with ``tp > 1``, two ring all-reduces of ``T * hidden`` activations:
  ``2 * (tp - 1) / tp * bytes / interconnect_bandwidth + 2 * (tp - 1) * latency``;
- ``layer_overhead_s`` (kernel launches not hidden by CUDA graphs; 0 on the GPUs) and
  ``request_overhead_s`` per request (attention that loops over sequences, as our CPU
  path does; 0 on the GPUs, whose kernels take the whole batch).

The last stage adds the LM head over the sampled tokens; each stage boundary the hand-off
of ``T`` hidden states and residuals; every step ``step_overhead_s``. Elementwise kernels
(norms, rotary, activation) are left out: they move ``T * hidden`` values, small next to
the weights.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from services.flags import ConfigError
from services.model_arch import DTYPE_BYTES, ModelArchConfig, kv_row_bytes

HARDWARE_DIR = Path(__file__).parent / "hardware"
_TORCH_DTYPES = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "auto": "bf16",
}


def sim_dtype(name: str) -> str:
    """``--dtype`` (or a config's ``torch_dtype``) as a key of ``peak_flops``."""
    return _TORCH_DTYPES.get(name, name)


@dataclass(frozen=True)
class SimHardware:
    """A device as the roofline sees it (the shipped ones are datasheet numbers)."""

    name: str
    peak_flops: dict[str, float]  # FLOP/s per dtype (dense)
    memory_bandwidth: float  # bytes/s
    memory_capacity: float  # bytes
    interconnect_bandwidth: float = 0.0  # bytes/s, one direction, between two devices
    interconnect_latency_s: float = 0.0
    compute_efficiency: float = 1.0  # achievable share of peak FLOP/s in a large GEMM
    bandwidth_efficiency: float = 1.0  # achievable share of memory bandwidth
    step_overhead_s: float = 0.0  # per step: launch, sampling, host work the device waits on
    layer_overhead_s: float = 0.0  # per layer and step: launches not hidden by CUDA graphs
    request_overhead_s: float = 0.0  # per request, layer and step: per-sequence attention work
    # Tokens at which a GEMM reaches half its peak FLOP/s: a small GEMM does not fill the
    # machine, peak * T / (T + this). 0: every GEMM runs at the peak.
    gemm_half_tokens: float = 0.0
    attention_efficiency: float = 1.0  # attention kernels' FLOP/s as a share of the GEMMs'
    interconnect: str = ""
    source: str = ""
    extra: dict[str, object] = field(default_factory=dict)  # anything else the file holds

    @classmethod
    def load(cls, name_or_path: str) -> SimHardware:
        """A shipped device (``h200``, ``h100``, ``a100``, ``l40s``) or a JSON file."""
        shipped = HARDWARE_DIR / f"{name_or_path}.json"
        path = shipped if shipped.exists() else Path(name_or_path).expanduser()
        if not path.is_file():
            names = ", ".join(sorted(p.stem for p in HARDWARE_DIR.glob("*.json")))
            raise ConfigError(
                f"--sim-hardware {name_or_path!r} is neither a shipped device ({names}) "
                "nor a JSON file"
            )
        try:
            raw = json.loads(path.read_text())
            known = {f.name for f in fields(cls)} - {"extra"}
            hw = cls(
                **{k: v for k, v in raw.items() if k in known},
                extra={k: v for k, v in raw.items() if k not in known},
            )
        except (ValueError, TypeError) as e:
            raise ConfigError(f"--sim-hardware {path}: {e}") from None
        if hw.memory_bandwidth <= 0 or not hw.peak_flops or min(hw.peak_flops.values()) <= 0:
            raise ConfigError(f"--sim-hardware {path}: needs peak_flops and memory_bandwidth > 0")
        return hw

    def flops(self, dtype: str) -> float:
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ConfigError(
                f"the simulated {self.name} has no peak FLOP/s for {dtype}; "
                f"it lists {', '.join(self.peak_flops)}"
            ) from None


@dataclass(frozen=True)
class RequestWork:
    """One request's share of a step."""

    num_new_tokens: int  # computed this step
    num_context_tokens: int  # already in the KV cache before this step
    samples: bool  # the step ends its known tokens: it samples one


@dataclass
class StepCost:
    """The modelled time of one step, by part (seconds, on the whole pipeline)."""

    linear: float = 0.0
    attention: float = 0.0
    lm_head: float = 0.0
    all_reduce: float = 0.0
    hand_off: float = 0.0
    overhead: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.linear + self.attention + self.lm_head + self.all_reduce + self.hand_off
            + self.overhead
        )  # fmt: skip


class StepCostModel:
    """The modelled step time of one model on one simulated device type."""

    def __init__(
        self,
        arch: ModelArchConfig,
        hardware: SimHardware,
        dtype: str = "bf16",
        tensor_parallel_size: int = 1,
        stage_layers: Sequence[int] | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.arch = arch
        self.hw = hardware
        self.dtype = dtype
        self.bytes = DTYPE_BYTES[dtype]
        # --kv-cache-dtype: bytes of one (token, head) K or V row (fp8 one a value, int8 one
        # a value and a 4-byte scale a row: actorserve_kernels/kv_quant.py)
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_row_bytes = kv_row_bytes(kv_cache_dtype, arch.head_dim, self.bytes)
        self.peak = hardware.flops(dtype) * hardware.compute_efficiency
        self.bandwidth = hardware.memory_bandwidth * hardware.bandwidth_efficiency
        self.tp = tensor_parallel_size
        self.stage_layers = list(stage_layers or [arch.num_hidden_layers])
        a, tp = arch, self.tp
        self.q_heads = a.num_attention_heads // tp
        self.kv_heads = max(1, a.num_key_value_heads // tp)  # replicated when fewer than tp
        d = a.head_dim
        # (in, out) of each linear on one rank: column-parallel QKV and gate/up, row-parallel
        # O and down.
        self.linears = [
            (a.hidden_size, (self.q_heads + 2 * self.kv_heads) * d),
            (self.q_heads * d, a.hidden_size),
            (a.hidden_size, 2 * a.intermediate_size // tp),
            (a.intermediate_size // tp, a.hidden_size),
        ]

    # ---- memory

    def layer_weight_bytes(self) -> int:
        """One layer's weights on one rank (norms included)."""
        return sum(i * o for i, o in self.linears) * self.bytes + 2 * self.arch.hidden_size * 2

    def weight_bytes(self, stage: int) -> int:
        """The weights one rank of ``stage`` holds: its layers, plus the embedding on the
        first stage and the LM head on the last (one matrix when they are tied and
        the model has one stage)."""
        a = self.arch
        table = a.vocab_size * a.hidden_size * self.bytes // self.tp
        total = self.stage_layers[stage] * self.layer_weight_bytes()
        last = stage == len(self.stage_layers) - 1
        if stage == 0:
            total += table
        if last and not (a.tie_word_embeddings and stage == 0):
            total += table
        return total

    def kv_bytes_per_token(self, stage: int) -> int:
        """The KV cache one token takes on one rank of ``stage``."""
        return 2 * self.stage_layers[stage] * self.kv_heads * self.kv_row_bytes

    # ---- time

    def _roofline(self, flops: float, nbytes: float) -> float:
        return max(nbytes / self.bandwidth, flops / self.peak)

    def linear_time(self, num_tokens: int) -> float:
        """One layer's four GEMMs over ``num_tokens`` tokens."""
        t = num_tokens
        fill = t / (t + self.hw.gemm_half_tokens)  # 1 without gemm_half_tokens
        return sum(
            max((i * o + t * (i + o)) * self.bytes / self.bandwidth,
                2 * t * i * o / (self.peak * fill))
            for i, o in self.linears
        )  # fmt: skip

    def attention_time(self, work: Sequence[RequestWork]) -> float:
        """One layer's attention over each request's real context, as one kernel."""
        d = self.arch.head_dim
        flops = 0.0
        nbytes = 0.0
        for w in work:
            q, c = w.num_new_tokens, w.num_context_tokens
            attended = q * c + q * (q + 1) // 2  # causal inside the new tokens
            flops += 4 * self.q_heads * d * attended
            kv_tokens = c + q  # read the context, write (then read) the new tokens
            nbytes += 2 * self.kv_heads * kv_tokens * self.kv_row_bytes
            nbytes += 2 * self.q_heads * q * d * self.bytes
        return max(nbytes / self.bandwidth, flops / (self.peak * self.hw.attention_efficiency))

    def all_reduce_time(self, num_tokens: int) -> float:
        """One ring all-reduce of ``num_tokens`` hidden states over the TP group."""
        tp = self.tp
        if tp == 1:
            return 0.0
        nbytes = num_tokens * self.arch.hidden_size * self.bytes
        link = self.hw.interconnect_bandwidth
        if link <= 0:
            raise ConfigError(f"the simulated {self.hw.name} has no interconnect_bandwidth for TP")
        return 2 * (tp - 1) / tp * nbytes / link + 2 * (tp - 1) * self.hw.interconnect_latency_s

    def step_cost(self, work: Sequence[RequestWork]) -> StepCost:
        """The modelled time of a step over every stage, by part."""
        a = self.arch
        tokens = sum(w.num_new_tokens for w in work)
        cost = StepCost(overhead=self.hw.step_overhead_s)
        if tokens == 0:
            return cost
        layers = sum(self.stage_layers)
        cost.linear = layers * self.linear_time(tokens)
        cost.attention = layers * self.attention_time(work)
        cost.all_reduce = layers * 2 * self.all_reduce_time(tokens)
        cost.overhead += layers * (
            self.hw.layer_overhead_s + len(work) * self.hw.request_overhead_s
        )
        sampled = sum(w.samples for w in work)
        if sampled:
            rows = a.vocab_size // self.tp
            cost.lm_head = self._roofline(
                2 * sampled * a.hidden_size * rows,
                (a.hidden_size * rows + sampled * (a.hidden_size + rows)) * self.bytes,
            )
        boundaries = len(self.stage_layers) - 1
        if boundaries:
            link = self.hw.interconnect_bandwidth
            handoff = 2 * tokens * a.hidden_size * self.bytes  # hidden states and residuals
            cost.hand_off = boundaries * (handoff / link + self.hw.interconnect_latency_s)
        return cost

    def step_time(self, work: Sequence[RequestWork]) -> float:
        return self.step_cost(work).total
