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

Mixture of experts (``ModelArchConfig.is_moe_layer``): an MoE layer's MLP is the router
and the shared experts (if any) over the step's tokens, like a dense MLP, plus the routed
experts, one grouped GEMM per rank whose weight bytes are those of the experts the step's
tokens actually reach (uniform routing: ``E * (1 - (1 - k/E)^B)`` distinct experts for
``B`` tokens, this rank's share) and whose FLOPs are ``2 * 3 * hidden * width`` per
(token, expert) pair. Without expert parallelism every rank holds a ``1/tp`` slice of
every expert and the layer ends in the TP all-reduce, as a dense one. With
``--enable-expert-parallel`` each of the ``ep`` ranks holds ``E / ep`` whole experts and
takes ``k / ep`` of the pairs; over data-parallel engines in lock-step the experts run on
every engine's tokens, which an all-gather brings to each rank and a reduce-scatter takes
back (``dispatch_time``), and every engine's step lasts as long as the slowest engine's
attention and dense part (``step_cost``'s ``num_tokens``). Not modelled: routing skew
(a hot expert or rank makes the others wait), overlap of communication with compute,
DeepSeek's grouped (node-limited) routing. DeepSeek's MLA and fp8 weights:
``model_shape.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.flags import ConfigError
from services.gpu_worker.sim.device import HARDWARE_DIR as HARDWARE_DIR
from services.gpu_worker.sim.device import SimHardware as SimHardware
from services.gpu_worker.sim.device import sim_dtype as sim_dtype
from services.gpu_worker.sim.model_shape import SimModelExtras
from services.model_arch import DTYPE_BYTES, ModelArchConfig, kv_row_bytes


@dataclass(frozen=True)
class RequestWork:
    """One request's share of a step."""

    num_new_tokens: int  # computed this step
    num_context_tokens: int  # already in the KV cache before this step
    samples: bool  # the step ends its known tokens: it samples one


@dataclass(frozen=True)
class StepProfile:
    """One engine's step as ``_local_cost`` needs it: its tokens, its attention's FLOPs and
    bytes, its sampled rows and requests. ``StepProfile(n)`` is the least work ``n``
    tokens can be (decodes of no context that sample nothing): what an engine in lock-step
    takes another engine's step for, knowing only its token count."""

    tokens: int = 0
    attention_flops: float = 0.0
    attention_bytes: float = 0.0
    sampled: int = 0
    requests: int = 0


@dataclass
class StepCost:
    """The modelled time of one step, by part (seconds, on the whole pipeline)."""

    linear: float = 0.0  # attention projections, dense MLPs, shared experts, the router
    attention: float = 0.0
    experts: float = 0.0  # the routed experts of the MoE layers
    lm_head: float = 0.0
    all_reduce: float = 0.0
    dispatch: float = 0.0  # expert parallelism over engines: all-gather and reduce-scatter
    hand_off: float = 0.0
    overhead: float = 0.0
    wait: float = 0.0  # lock-step: waiting for the slowest engine's attention and dense part

    @property
    def total(self) -> float:
        return (
            self.linear + self.attention + self.experts + self.lm_head + self.all_reduce
            + self.dispatch + self.hand_off + self.overhead + self.wait
        )  # fmt: skip


class StepCostModel:
    """The modelled step time of one model on one simulated device type.

    ``expert_parallel_size`` (``--enable-expert-parallel``: TP x DP) ranks hold whole
    experts, ``num_experts / ep`` each; 1: every rank holds a ``1/tp`` slice of every
    expert. ``data_parallel_size`` > 1: the engines step in lock-step through the MoE
    layers (``step_cost``'s ``num_tokens``)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        hardware: SimHardware,
        dtype: str = "bf16",
        tensor_parallel_size: int = 1,
        stage_layers: Sequence[int] | None = None,
        kv_cache_dtype: str = "auto",
        *,
        expert_parallel_size: int = 1,
        data_parallel_size: int = 1,
        extras: SimModelExtras | None = None,
    ) -> None:
        self.arch = arch
        self.hw = hardware
        self.dtype = dtype
        self.bytes = DTYPE_BYTES[dtype]
        x = extras or SimModelExtras()
        self.extras = x
        self.mla = x.mla
        # the linear layers' weights: their stored dtype and the peak their GEMMs run at
        self.weight_bytes_per_param = DTYPE_BYTES[x.weight_dtype or dtype]
        self.peak = hardware.flops(dtype) * hardware.compute_efficiency
        self.linear_peak = hardware.flops(x.weight_dtype or dtype) * hardware.compute_efficiency
        self.bandwidth = hardware.memory_bandwidth * hardware.bandwidth_efficiency
        self.tp = tensor_parallel_size
        self.ep = expert_parallel_size
        self.dp = data_parallel_size
        if self.ep > 1 and (not arch.is_moe or arch.num_experts % self.ep):
            raise ConfigError(
                f"{arch.num_experts} experts cannot be split over {self.ep} expert-parallel ranks"
            )
        self.stage_layers = list(stage_layers or [arch.num_hidden_layers])
        starts = [sum(self.stage_layers[:i]) for i in range(len(self.stage_layers))]
        # the MoE layers of each stage (the rest have a dense MLP)
        self.stage_moe_layers = [
            sum(arch.is_moe_layer(i) for i in range(s, s + n))
            for s, n in zip(starts, self.stage_layers, strict=True)
        ]
        a, tp = arch, self.tp
        self.q_heads = a.num_attention_heads // tp
        h = a.hidden_size
        # --kv-cache-dtype: bytes of one K or V row of the cache (fp8 one a value, int8 one
        # a value and a 4-byte scale a row: actorserve_kernels/kv_quant.py); rows per token
        # and layer on one rank
        self.kv_cache_dtype = kv_cache_dtype
        # (in, out) of each attention linear on one rank: column-parallel QKV, row-parallel O
        if self.mla is None:
            self.kv_heads = max(1, a.num_key_value_heads // tp)  # replicated when fewer than tp
            self.kv_row_bytes = kv_row_bytes(kv_cache_dtype, a.head_dim, self.bytes)
            self.kv_rows = 2 * self.kv_heads
            d = a.head_dim
            self.attn_linears = [(h, (self.q_heads + 2 * self.kv_heads) * d), (self.q_heads * d, h)]
        else:
            m, heads = self.mla, self.q_heads
            self.kv_heads = 1  # the latent row, whole on every rank
            self.kv_row_bytes = kv_row_bytes(kv_cache_dtype, m.cache_dim, self.bytes)
            self.kv_rows = 1
            q = [(h, m.q_lora_rank), (m.q_lora_rank, heads * m.qk_head_dim)]
            self.attn_linears = [
                *(q if m.q_lora_rank else [(h, heads * m.qk_head_dim)]),
                (h, m.cache_dim),  # replicated: the latent and the rotary key
                (m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim)),
                (heads * m.v_head_dim, h),
            ]
        # column-parallel gate/up, row-parallel down
        self.dense_linears = [(h, 2 * a.intermediate_size // tp), (a.intermediate_size // tp, h)]
        shared = x.shared_expert_intermediate_size
        self.shared_linears = [(h, 2 * shared // tp), (shared // tp, h)] if shared else []
        # the routed experts on one rank: how many, and each one's MLP width
        self.local_experts = a.num_experts // self.ep
        self.expert_width = a.moe_intermediate_size // (1 if self.ep > 1 else tp)
        # kept for the dense model's terms (the four GEMMs of one layer)
        self.linears = self.attn_linears + self.dense_linears

    # ---- memory

    def layer_weight_bytes(self, layer: int = 0) -> int:
        """Layer ``layer``'s weights on one rank (norms included)."""
        a, w = self.arch, self.weight_bytes_per_param
        params = sum(i * o for i, o in self.attn_linears)
        if a.is_moe_layer(layer):
            params += self.local_experts * 3 * a.hidden_size * self.expert_width
            params += sum(i * o for i, o in self.shared_linears)
            router = a.hidden_size * a.num_experts * self.bytes  # replicated, not quantized
        else:
            params += sum(i * o for i, o in self.dense_linears)
            router = 0
        return params * w + router + 2 * a.hidden_size * 2

    def weight_bytes(self, stage: int) -> int:
        """The weights one rank of ``stage`` holds: its layers, plus the embedding on the
        first stage and the LM head on the last (one matrix when they are tied and
        the model has one stage)."""
        a = self.arch
        table = a.vocab_size * a.hidden_size * self.bytes // self.tp
        start = sum(self.stage_layers[:stage])
        total = sum(
            self.layer_weight_bytes(i) for i in range(start, start + self.stage_layers[stage])
        )
        last = stage == len(self.stage_layers) - 1
        if stage == 0:
            total += table
        if last and not (a.tie_word_embeddings and stage == 0):
            total += table
        return total

    def kv_bytes_per_token(self, stage: int) -> int:
        """The KV cache one token takes on one rank of ``stage``."""
        return self.stage_layers[stage] * self.kv_rows * self.kv_row_bytes

    def active_params(self) -> int:
        """Parameters one token's forward multiplies by over the whole model (every rank
        together): attention projections, the dense MLPs or the top-k and shared experts
        and the router, the LM head; the embedding is a lookup."""
        a = self.arch
        full = StepCostModel(a, self.hw, self.dtype, extras=self.extras)  # unsplit
        per_layer_attn = sum(i * o for i, o in full.attn_linears)
        total = a.vocab_size * a.hidden_size
        for layer in range(a.num_hidden_layers):
            total += per_layer_attn
            if a.is_moe_layer(layer):
                total += a.num_experts_per_tok * 3 * a.hidden_size * a.moe_intermediate_size
                total += sum(i * o for i, o in full.shared_linears)
                total += a.hidden_size * a.num_experts
            else:
                total += sum(i * o for i, o in full.dense_linears)
        return total

    # ---- time

    def _roofline(self, flops: float, nbytes: float) -> float:
        return max(nbytes / self.bandwidth, flops / self.peak)

    def _gemms(
        self, num_tokens: int, shapes: Sequence[tuple[int, int]], quantized: bool = True
    ) -> float:
        """GEMMs of ``(in, out)`` over ``num_tokens`` tokens, one roofline each."""
        t = num_tokens
        if t == 0:
            return 0.0
        fill = t / (t + self.hw.gemm_half_tokens)  # 1 without gemm_half_tokens
        w = self.weight_bytes_per_param if quantized else self.bytes
        peak = self.linear_peak if quantized else self.peak
        return sum(
            max((i * o * w + t * (i + o) * self.bytes) / self.bandwidth,
                2 * t * i * o / (peak * fill))
            for i, o in shapes
        )  # fmt: skip

    def linear_time(self, num_tokens: int) -> float:
        """One dense layer's GEMMs (QKV, O, gate/up, down) over ``num_tokens`` tokens."""
        return self._gemms(num_tokens, self.linears)

    def experts_hit(self, num_tokens: int) -> float:
        """Expected distinct experts of this rank that ``num_tokens`` tokens reach with
        top-k routing, under uniform routing: each expert is missed by a token with
        probability ``1 - k/E``, so ``E * (1 - (1 - k/E)^B)`` in all; this rank's share."""
        a = self.arch
        if not a.is_moe or num_tokens <= 0:
            return 0.0
        miss = 1.0 - a.num_experts_per_tok / a.num_experts
        return self.local_experts * (1.0 - miss**num_tokens)

    def expert_time(self, num_tokens: int) -> float:
        """One MoE layer's routed experts on one rank, for the ``num_tokens`` tokens that
        reach the layer (this engine's; with engines in lock-step, every engine's): the
        weights of the experts hit, and ``num_tokens * k / ep`` (token, expert) pairs on
        average (uniform routing: no hot expert), one grouped GEMM."""
        a = self.arch
        hit = self.experts_hit(num_tokens)
        if hit == 0.0:
            return 0.0
        h, width = a.hidden_size, self.expert_width
        pairs = num_tokens * a.num_experts_per_tok / self.ep
        params = 3 * h * width  # gate, up, down
        nbytes = (
            hit * params * self.weight_bytes_per_param + pairs * (2 * h + 3 * width) * self.bytes
        )
        per_expert = pairs / hit
        fill = per_expert / (per_expert + self.hw.gemm_half_tokens)
        return max(nbytes / self.bandwidth, 2 * pairs * params / (self.linear_peak * fill))

    def moe_local_time(self, num_tokens: int) -> float:
        """What an MoE layer computes on this engine's own tokens: the router and the shared
        experts."""
        router = [(self.arch.hidden_size, self.arch.num_experts)]
        return self._gemms(num_tokens, router, quantized=False) + self._gemms(
            num_tokens, self.shared_linears
        )

    def _attention_terms(self, work: Sequence[RequestWork]) -> tuple[float, float]:
        """One layer's attention over each request's real context: (FLOPs, bytes)."""
        flops = 0.0
        nbytes = 0.0
        heads = self.q_heads
        for w in work:
            q, c = w.num_new_tokens, w.num_context_tokens
            attended = q * c + q * (q + 1) // 2  # causal inside the new tokens
            kv_tokens = c + q  # read the context, write (then read) the new tokens
            nbytes += self.kv_rows * kv_tokens * self.kv_row_bytes
            if self.mla is None:
                flops += 4 * heads * self.arch.head_dim * attended
                nbytes += 2 * heads * q * self.arch.head_dim * self.bytes
            else:
                m = self.mla
                absorbed = heads * m.pair_flops(True) * attended
                expanded = heads * m.pair_flops(False) * attended + kv_tokens * m.expand_flops(
                    heads
                )
                flops += min(absorbed, expanded)
                nbytes += heads * q * (m.cache_dim + m.kv_lora_rank) * self.bytes
        return flops, nbytes

    def _attention_time(self, flops: float, nbytes: float) -> float:
        return max(nbytes / self.bandwidth, flops / (self.peak * self.hw.attention_efficiency))

    def attention_time(self, work: Sequence[RequestWork]) -> float:
        """One layer's attention over each request's real context, as one kernel."""
        return self._attention_time(*self._attention_terms(work))

    def profile(self, work: Sequence[RequestWork]) -> StepProfile:
        flops, nbytes = self._attention_terms(work)
        return StepProfile(
            sum(w.num_new_tokens for w in work), flops, nbytes, sum(w.samples for w in work),
            sum(w.num_new_tokens > 0 for w in work),
        )  # fmt: skip

    def _link(self) -> float:
        link = self.hw.interconnect_bandwidth
        if link <= 0:
            raise ConfigError(
                f"the simulated {self.hw.name} has no interconnect_bandwidth for TP or EP"
            )
        return link

    def all_reduce_time(self, num_tokens: int) -> float:
        """One ring all-reduce of ``num_tokens`` hidden states over the TP group."""
        tp = self.tp
        if tp == 1:
            return 0.0
        nbytes = num_tokens * self.arch.hidden_size * self.bytes
        return (
            2 * (tp - 1) / tp * nbytes / self._link()
            + 2 * (tp - 1) * self.hw.interconnect_latency_s
        )

    def dispatch_time(self, num_tokens: int) -> float:
        """One MoE layer's dispatch and combine over engines in lock-step (vLLM's
        all-gather / reduce-scatter all-to-all): a ring all-gather of the ``num_tokens``
        hidden states of every engine, so each rank has the tokens its experts take, and a
        ring reduce-scatter of the results back to their engines; each moves ``(dp - 1) /
        dp`` of the bytes through every rank's link, with ``dp - 1`` hops of latency."""
        dp = self.dp
        if dp == 1 or num_tokens == 0:
            return 0.0
        nbytes = num_tokens * self.arch.hidden_size * self.bytes
        one_way = (dp - 1) / dp * nbytes / self._link() + (dp - 1) * self.hw.interconnect_latency_s
        return 2 * one_way

    def _local_cost(self, profile: StepProfile) -> StepCost:
        """Everything of a step but the routed experts, their dispatch and the per-step
        overhead: what one engine computes on its own tokens."""
        a = self.arch
        t = profile.tokens
        cost = StepCost()
        if t == 0:
            return cost
        layers = sum(self.stage_layers)
        moe_layers = sum(self.stage_moe_layers)
        cost.linear = (
            layers * self._gemms(t, self.attn_linears)
            + (layers - moe_layers) * self._gemms(t, self.dense_linears)
            + moe_layers * self.moe_local_time(t)
        )
        cost.attention = layers * self._attention_time(
            profile.attention_flops, profile.attention_bytes
        )
        cost.all_reduce = layers * 2 * self.all_reduce_time(t)
        cost.overhead = layers * (
            self.hw.layer_overhead_s + profile.requests * self.hw.request_overhead_s
        )
        if profile.sampled:
            rows = a.vocab_size // self.tp
            cost.lm_head = self._roofline(
                2 * profile.sampled * a.hidden_size * rows,
                (a.hidden_size * rows + profile.sampled * (a.hidden_size + rows)) * self.bytes,
            )
        boundaries = len(self.stage_layers) - 1
        if boundaries:
            handoff = 2 * t * a.hidden_size * self.bytes  # hidden states and residuals
            cost.hand_off = boundaries * (handoff / self._link() + self.hw.interconnect_latency_s)
        return cost

    def step_cost(
        self,
        work: Sequence[RequestWork],
        num_tokens: Sequence[int] | None = None,
        engine: int = 0,
    ) -> StepCost:
        """The modelled time of a step over every stage, by part.

        Engines in lock-step (``num_tokens``: each engine's tokens this step, this one's at
        ``engine``; ``work`` may be empty: a dummy step): the routed experts run on every
        engine's tokens, spread over the EP ranks, with their dispatch and combine, and
        every engine waits at each MoE layer for the slowest one's attention and dense part
        (``wait``). This engine knows its own work exactly and only the others' token
        counts: it takes each of them for the least work its count can be
        (``StepProfile(n)``: its GEMMs exactly, since they depend on the count alone, and
        no attention), a lower bound. So the slowest engine's own exact time is the longest
        any engine computes, and that is the step: the next agreement waits for it (and
        the bench takes the longest). An engine's own ``wait`` is a lower bound."""
        own = self.profile(work)
        cost = self._local_cost(own)
        all_tokens = own.tokens
        if num_tokens is not None:
            slowest = cost.total
            for e, n in enumerate(num_tokens):
                if e != engine and n:
                    slowest = max(slowest, self._local_cost(StepProfile(n)).total)
            cost.wait = slowest - cost.total
            all_tokens = own.tokens + sum(n for e, n in enumerate(num_tokens) if e != engine)
        cost.overhead += self.hw.step_overhead_s
        moe_layers = sum(self.stage_moe_layers)
        cost.experts = moe_layers * self.expert_time(all_tokens)
        cost.dispatch = moe_layers * self.dispatch_time(all_tokens)
        return cost

    def step_time(self, work: Sequence[RequestWork]) -> float:
        return self.step_cost(work).total
