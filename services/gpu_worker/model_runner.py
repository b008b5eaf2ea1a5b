"""The model runner: turns each StepPlan into one forward pass and one sampled token per
finishing request, over a paged KV cache it owns.

Lifecycle: ``ModelRunner(config, folder)`` loads the weights;
``determine_num_blocks()`` sizes the KV cache from the memory budget;
``initialize_kv_cache(num_blocks)`` allocates it; ``capture_cuda_graphs()`` records the
decode graphs (on CUDA); then ``execute(plan)`` per step.

A step's inputs are written into buffers allocated once (``step_inputs.py``); a decode-only
step replays the CUDA graph of its padded batch size (``cuda_graphs.py``), any other runs
the model eagerly over the same buffers.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from actorserve_kernels import kv_quant
from services.config import DTYPES, EngineConfig, ModelArchConfig
from services.gpu_worker import step_outputs
from services.gpu_worker.attention import KVCache, get_attention_backend
from services.gpu_worker.base import WorkerBackend
from services.gpu_worker.cuda_graphs import DecodeGraphs, capture_all, capture_sizes
from services.gpu_worker.distributed import SINGLE_RANK, HeadShard, ParallelState, StageLink
from services.gpu_worker.input_batch import InputBatch
from services.gpu_worker.model.llama import CheckpointTensor, LlamaForCausalLM
from services.gpu_worker.pooler import Pooler
from services.gpu_worker.sampler import Sampler
from services.gpu_worker.step_inputs import StepBuffers, build_attention_metadata
from services.logging_utils import init_logger
from services.model_loader import ModelLoadError, dummy_weights, iter_weights, load_hf_config
from services.model_loader.gguf_convert import gguf_source, iter_gguf_weights
from services.protocol import KVLayout, StepPlan, StepResult

logger = init_logger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, DTYPES[name])  # type: ignore[no-any-return]


def _check_kv_cache_dtype(kv_cache_dtype: str, backend: str, device: torch.device) -> None:
    """--kv-cache-dtype combinations that cannot run, refused at start-up (the triton
    backend's power-of-two head_dim already makes int8 rows whole fp32 words)."""
    if backend != "triton" or kv_cache_dtype == "auto":
        return
    e4m3 = kv_cache_dtype in ("fp8", "fp8_e4m3")
    if e4m3 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ModelLoadError(
            "--kv-cache-dtype fp8 (e4m3) needs a GPU of compute capability 8.9 or newer "
            "(Ada, Hopper) for Triton's fp8 conversions; use fp8_e5m2 or int8"
        )


def _available_ram_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line; set --kv-cache-memory-bytes")


class ModelRunner(WorkerBackend):
    """Owns the model, the KV cache and the persistent batch of one worker rank
    (``--worker-backend torch``); with tensor parallelism, its shard of each.

    ``execute(plan)`` follows ``StepPlan``'s contract: drop ``finished_req_ids``, add
    ``new_requests``, apply ``running`` deltas, compute ``num_scheduled_tokens[i]``
    tokens of the i-th request of ``new_requests + running`` from its
    ``num_computed_tokens``, and sample for each request whose scheduled tokens reach
    the end of its known tokens; the sampled token is appended to the request (the
    next step computes it). ``arch`` and ``weights`` override reading ``folder``
    (tests share one dequantised copy of the weights).
    """

    def __init__(
        self,
        config: EngineConfig,
        folder: Path | None,
        parallel: ParallelState = SINGLE_RANK,
        *,
        arch: ModelArchConfig | None = None,
        weights: Iterable[tuple[str, CheckpointTensor]] | None = None,
    ) -> None:
        self.config = config
        self.device = resolve_device(config.worker.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        if self.device.type == "cpu":
            # --num-threads wins; else an explicit OMP_NUM_THREADS (as in tests); else the
            # cores shared out between the ranks on this machine (of every DP engine).
            threads = config.worker.num_threads
            if threads is None and "OMP_NUM_THREADS" not in os.environ:
                p = config.parallel
                ranks_here = len(p.local_ranks) * len(p.local_engines)
                threads = max(1, (os.cpu_count() or 1) // ranks_here)
            if threads is not None:
                torch.set_num_threads(threads)
            if self.dtype == torch.bfloat16:
                from actorserve_kernels.cpu import bf16_dot_products

                if not bf16_dot_products():
                    logger.warning(
                        "--dtype bfloat16 on a CPU without AVX512_BF16 or AMX: bf16 matrix "
                        "products are emulated there, slower than --dtype float32"
                    )
        if arch is None:
            if folder is None:
                raise ValueError("ModelRunner needs a model folder or an arch config")
            arch = ModelArchConfig.from_hf_config(load_hf_config(folder))
        if weights is None:
            if config.model.load_format == "dummy":
                weights = dummy_weights(arch, self.dtype, config.model.seed, self.device)
            elif folder is None:
                raise ValueError("ModelRunner needs a model folder or weights")
            else:
                weights = self._checkpoint(folder, config.model.quantization)
        self.arch = arch
        self.parallel = parallel
        self.num_kv_heads = HeadShard.of(arch, parallel).num_kv_heads  # this rank's
        self.max_model_len = config.scheduler.max_model_len or arch.derived_max_model_len
        backend_name = config.worker.attention_backend or (
            "triton" if self.device.type == "cuda" else "torch"
        )
        self.attn_backend = get_attention_backend(backend_name)
        _check_kv_cache_dtype(config.cache.kv_cache_dtype, backend_name, self.device)
        if self.device.type == "cpu":
            from actorserve_kernels.cpu import load_cpu_ops

            load_cpu_ops()  # build (first run on a machine) during start-up, not mid-request
        # Built on the meta device, then materialised once in the target dtype: no
        # throw-away random init of large models.
        with torch.device("meta"):
            model = LlamaForCausalLM(
                arch,
                self.attn_backend,
                max(self.max_model_len, arch.max_position_embeddings),
                parallel,
            )
        self.model = model.to(self.dtype).to_empty(device=self.device).eval()
        self.model.reset_kv_scales()
        int8 = config.model.cpu_activation_quant == "int8"
        only_quantized = (
            "--cpu-activation-quant int8 applies to a GGUF model's quantized matrices "
            "(Q4_0/Q4_1/Q8_0) on CPU with --dtype float32 and --quantization auto or "
            "gguf; this model has none loaded that way"
        )
        if int8 and (config.model.quantization == "none" or self.dtype != torch.float32):
            raise ModelLoadError(only_quantized)  # whatever the CPU: the flags do not fit
        if int8:
            from actorserve_kernels.cpu import int8_activations_supported

            if not int8_activations_supported():
                raise ModelLoadError(
                    "--cpu-activation-quant int8 needs a CPU with AVX-512 VNNI (this one has "
                    "none, or the C++ ops did not build); use --cpu-activation-quant none"
                )
            self.model.int8_activations = True
        self.model.load_weights(weights)
        if int8 and not self.model.int8_linears():
            raise ModelLoadError(only_quantized)
        self.num_layers = len(self.model.model.layers)  # this pipeline stage's
        self.link = StageLink(parallel, arch.hidden_size, self.dtype, self.device)
        self.block_size = config.cache.block_size
        self.input_batch = InputBatch(
            config.scheduler.max_num_seqs, self.max_model_len, self.block_size, self.device
        )
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.model.seed))
        self.pooler = Pooler()  # embedding requests: pooled, never sampled (pooler.py)
        self.kv_caches: list[KVCache] = []
        sched = config.scheduler
        self.buffers = StepBuffers(
            sched.max_num_seqs,
            sched.max_num_batched_tokens or max(self.max_model_len, sched.max_num_seqs),
            self.input_batch.block_table.shape[1],
            self.device,
        )
        self.graphs: DecodeGraphs | None = None
        # --kv-cache-dtype: how the cache stores K and V (actorserve_kernels/kv_quant.py)
        self.kv_cache_dtype = config.cache.kv_cache_dtype
        self.kv_storage_dtype = kv_quant.storage_dtype(self.kv_cache_dtype, self.dtype)
        # --calculate-kv-scales: the first step with tokens measures them
        self._measure_kv_scales = config.cache.calculate_kv_scales

    def _checkpoint(
        self, folder: Path, quantization: str
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """The folder's weights; a GGUF model's quantized matrices as their blocks when
        ``--quantization`` (auto or gguf) lets the CPU kernels read them."""
        source = gguf_source(folder)
        if quantization == "gguf" and source is None:
            raise ModelLoadError(
                f"--quantization gguf needs a GGUF model; {folder} has no GGUF file it was "
                "converted from that still exists unchanged (source.json)"
            )
        if quantization == "none" or source is None:
            return iter_weights(folder, self.dtype)
        usable = self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
        if usable:
            from actorserve_kernels.cpu import QUANT_TYPES, load_cpu_ops

            usable = load_cpu_ops()
        if not usable:
            if quantization == "gguf":
                raise ModelLoadError(
                    "--quantization gguf runs on the CPU kernels with --dtype float32 or "
                    f"bfloat16 (device {self.device.type}, dtype {self.dtype}); use "
                    "--quantization none"
                )
            return iter_weights(folder, self.dtype)
        return iter_gguf_weights(source, load_hf_config(folder), self.dtype, QUANT_TYPES.values())

    # ------------------------------------------------------------------ KV cache

    def kv_cache_bytes_per_block(self) -> int:
        row = kv_quant.row_bytes(self.kv_cache_dtype, self.arch.head_dim, self.dtype)
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * row

    def determine_num_blocks(self) -> int:
        """KV cache blocks that fit the memory budget (``--num-gpu-blocks-override`` wins)."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:
            budget = int(_available_ram_bytes() * cache.cpu_kv_cache_fraction)
        num_blocks = budget // self.kv_cache_bytes_per_block()
        if num_blocks < 1:
            raise RuntimeError(
                f"no KV cache block fits the memory budget of {budget} bytes "
                f"({self.kv_cache_bytes_per_block()} bytes per block); raise the budget"
            )
        return num_blocks

    def _profile_cuda_budget(self) -> int:
        """gpu_memory_utilization of the device, less the weights and the peak
        activations of a forward over max_num_batched_tokens."""
        num_tokens = min(self.config.scheduler.token_budget, self.max_model_len)
        blocks = -(-num_tokens // self.block_size)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.initialize_kv_cache(blocks)
        meta, _, _ = build_attention_metadata(
            np.array([0]),
            np.array([num_tokens]),
            np.arange(blocks, dtype=np.int32)[None, :],
            self.block_size,
            self.device,
        )
        self.begin_dp_step((num_tokens,) * self.parallel.dp_size)  # every rank profiles alike
        with torch.inference_mode():
            zeros = torch.zeros(num_tokens, self.arch.hidden_size, dtype=self.dtype)
            out = self.model(
                torch.zeros(num_tokens, dtype=torch.long, device=self.device),
                torch.arange(num_tokens, device=self.device),
                meta,
                self.kv_caches,
                None if self.parallel.is_first_stage else (zeros.to(self.device),) * 2,
            )
            if not isinstance(out, tuple):
                self.model.compute_logits(out[-self.config.scheduler.max_num_seqs :])
        torch.cuda.synchronize(self.device)
        kv_profile = blocks * self.kv_cache_bytes_per_block()
        peak = torch.cuda.max_memory_allocated(self.device) - kv_profile
        self.kv_caches = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        return int(total * self.config.cache.gpu_memory_utilization) - peak - non_torch

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if self.graphs is not None:
            raise RuntimeError("the KV cache is reallocated after the CUDA graphs read it")
        width = kv_quant.row_width(self.kv_cache_dtype, self.arch.head_dim)
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, width)
        self.kv_caches = []
        # On CPU, empty (fresh, untouched pages) so RAM is committed only as blocks fill;
        # backends never read a slot before it is written (see AttentionBackend).
        alloc = torch.empty if self.device.type == "cpu" else torch.zeros
        for _ in range(self.num_layers):
            kv = alloc(shape, dtype=self.kv_storage_dtype, device=self.device)
            self.kv_caches.append((kv[0], kv[1]))
        self.num_blocks = num_blocks

    # ------------------------------------------------------------------ CUDA graphs

    def capture_cuda_graphs(self, *, record: bool = True) -> None:
        """Capture the decode graphs (after ``initialize_kv_cache``), when this runner can:
        on CUDA, without ``--enforce-eager``, on an attention backend that supports them,
        with one rank (the collectives of TP and the stage links of PP are not captured
        here). ``record=False`` pads decode steps to the same sizes but runs them eagerly,
        on any device: the padding and bucketing without a GPU (tests), or eager against
        graphs on one."""
        w, sched = self.config.worker, self.config.scheduler
        why_not = None
        if self.device.type != "cuda" and record:
            return  # a CPU runs eagerly; nothing to say
        if not self.attn_backend.supports_cuda_graphs:
            why_not = f"the {self.attn_backend.name} attention backend does not support them"
        elif w.enforce_eager and record:
            why_not = "--enforce-eager"
        elif self.parallel.tp_size > 1 or self.parallel.pp_size > 1:
            why_not = "tensor or pipeline parallelism (graphs are captured for one rank)"
        elif self.parallel.ep_size > 1:
            why_not = "expert parallelism (its dispatch sizes change every step)"
        if why_not is not None:
            logger.info("no CUDA graphs: %s; decode steps run eagerly", why_not)
            return
        # A decode step has as many tokens as requests: no size past the token budget.
        most = min(sched.max_num_seqs, sched.max_num_batched_tokens or sched.max_num_seqs)
        sizes = capture_sizes(w.cuda_graph_sizes, w.max_cudagraph_capture_size, most)
        if not sizes:
            return
        self.buffers.reserve(sizes[-1], sizes[-1])  # before: the graphs read these buffers
        self.graphs = DecodeGraphs(sizes, capture=record, generation=self.buffers.generation)
        with torch.inference_mode():
            capture_all(self.graphs, self._capture_one, self.device)

    def _capture_one(self, size: int) -> None:
        assert self.graphs is not None
        inputs = self.buffers.prepare(
            np.arange(size),
            np.zeros(size, dtype=np.int64),
            np.ones(size, dtype=np.int64),
            np.zeros((size, 1), dtype=np.int32),
            self.block_size,
            pad_to=size,
            max_seq_len=self.max_model_len,
        )
        # The warm-up runs execute: the dummy tokens write no K/V (slot -1).
        inputs.attn_meta.slot_mapping.fill_(-1)
        self.model.model.attn_builder.build(inputs.attn_meta, self.kv_caches[0], graph_size=size)
        self.graphs.capture(
            size,
            inputs.input_ids,
            inputs.positions,
            inputs.attn_meta,
            lambda ids, pos, meta: self.model(ids, pos, meta, self.kv_caches),  # type: ignore[arg-type,return-value]
        )

    def _graph_size(self, scheduled: np.ndarray) -> int | None:
        """The captured size a step pads to: a decode-only step (one token a request) that
        fits one, while the buffers the graphs read are still the ones in use."""
        g = self.graphs
        if g is None or scheduled.max() != 1:
            return None
        if g.generation != self.buffers.generation:
            # A step past --max-num-seqs / --max-num-batched-tokens grew the buffers (only a
            # caller not bound by the scheduler's budget does that): graphs no more.
            logger.warning("the step buffers grew: CUDA graphs dropped, decode runs eagerly")
            self.graphs = None
            return None
        return g.padded_size(len(scheduled))

    def kv_caches_for_transfer(self) -> tuple[list[KVCache], KVLayout]:
        layout = KVLayout(
            num_layers=len(self.kv_caches),
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.arch.head_dim,
            dtype=str(self.kv_storage_dtype).removeprefix("torch."),
        )
        return self.kv_caches, layout

    # ------------------------------------------------------------------ step

    def begin_dp_step(self, num_tokens: tuple[int, ...]) -> None:
        if (dispatch := self.model.model.expert_dispatch) is not None:
            dispatch.begin_step(num_tokens)

    def execute_dummy(self) -> None:
        model = self.model.model
        if model.expert_dispatch is not None:
            with torch.inference_mode():
                model.expert_dispatch.dummy_forward(
                    model.moe_blocks(), self.arch.hidden_size, self.dtype, self.device
                )

    def expert_load(self) -> list[int] | None:
        dispatch = self.model.model.expert_dispatch
        return None if dispatch is None else dispatch.take_load()

    def execute(self, plan: StepPlan) -> StepResult:
        batch = self.input_batch
        for req_id in plan.finished_req_ids:
            batch.remove(req_id)
            self.pooler.drop(req_id)
        for new in plan.new_requests:
            batch.add(new)
            if self.parallel.is_last_stage:  # the only stage with the final hidden states
                self.pooler.add(new)
        for delta in plan.running:
            # Only the last stage samples; the others learn the tokens from the plan.
            batch.update(delta, take_tokens=not self.parallel.is_last_stage)
        if plan.is_empty:
            return StepResult(step_id=plan.step_id)
        req_ids = [r.req_id for r in plan.new_requests] + [r.req_id for r in plan.running]
        if len(req_ids) != len(plan.num_scheduled_tokens):
            raise ValueError(
                f"step {plan.step_id}: {len(plan.num_scheduled_tokens)} scheduled counts "
                f"for {len(req_ids)} requests"
            )
        states = [batch.requests[r] for r in req_ids]
        rows = np.array([s.row for s in states], dtype=np.int64)
        computed = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        scheduled = np.array(plan.num_scheduled_tokens, dtype=np.int64)
        known = np.array([s.num_tokens for s in states], dtype=np.int64)
        if (scheduled < 1).any() or (computed + scheduled > known).any():
            raise ValueError(f"step {plan.step_id}: scheduled tokens past a request's known tokens")
        at_end = computed + scheduled == known
        if self.pooler:  # embedding requests in the step: pooled, no token sampled
            at_end &= ~np.array([r in self.pooler for r in req_ids], dtype=bool)
        sampling = np.flatnonzero(at_end)
        measure, self._measure_kv_scales = self._measure_kv_scales, False
        graph_size = None if measure else self._graph_size(scheduled)
        inputs = self.buffers.prepare(
            rows,
            computed,
            scheduled,
            batch.block_table,
            self.block_size,
            token_ids=batch.token_ids,
            sampling=sampling,
            pad_to=graph_size,
            max_seq_len=None if graph_size is None else self.max_model_len,
        )
        inputs.attn_meta.compute_kv_scales = measure
        for s, n in zip(states, scheduled, strict=True):
            s.num_computed_tokens += int(n)
        sample_states = [states[i] for i in sampling]
        with torch.inference_mode():
            p = self.parallel
            out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
            if graph_size is not None:
                assert self.graphs is not None
                out = self.graphs.replay(graph_size)[: inputs.num_tokens]
            else:
                out = self.model(
                    inputs.input_ids,
                    inputs.positions,
                    inputs.attn_meta,
                    self.kv_caches,
                    None if p.is_first_stage else self.link.recv(inputs.num_tokens),
                )
            if isinstance(out, tuple):  # a stage before the last
                self.link.send(*out)
                return StepResult(step_id=plan.step_id)
            hidden = out
            pooled = self.pooler.step(hidden, req_ids, computed, scheduled, known)
            prompt_logprobs = step_outputs.prompt_logprobs(
                self.model, batch.token_ids, hidden, states, computed, scheduled
            )
            if not sample_states:
                return StepResult(plan.step_id, prompt_logprobs=prompt_logprobs, pooled=pooled)
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            constrained = step_outputs.apply_grammar(logits, plan, sample_states)
            md = batch.sampling_metadata(sample_states, logits.shape[1], rows=rows[sampling])
            md.constrained = constrained
            sampler_out = self.sampler(logits, md)
        # The step's one wait for the device: only the sampled ids (and logprobs, if asked).
        sampled = sampler_out.sampled_token_ids.cpu().numpy()
        batch.append_tokens(rows[sampling], sampled, sample_states)
        return StepResult(
            step_id=plan.step_id,
            req_ids=[s.req_id for s in sample_states],
            sampled_token_ids=sampled.tolist(),
            logprobs=step_outputs.to_token_logprobs(sampler_out, sample_states),
            prompt_logprobs=prompt_logprobs,
            pooled=pooled,
        )
