"""One Llama-family decoder: Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3.

The variants differ only in flags of ``ModelArchConfig``: q/k/v bias (Qwen2),
RMSNorm on q and k per head (Qwen3), tied embeddings, GQA ratio, rope scaling.
Projections are fused as in vLLM (``qkv_proj``, ``gate_up_proj``) and
``load_weights`` maps HF checkpoint names onto them. One ``RotaryEmbedding`` is
shared by the layers, its cos/sin rows gathered once per step.

``forward`` runs a flattened varlen batch (prefill chunks and decode tokens mixed)
and returns the final-normed hidden states; ``compute_logits`` projects only the
rows that are sampled.

Tensor parallelism is Megatron's, as in vLLM: ``qkv_proj`` and ``gate_up_proj`` are
column-parallel (each rank holds its heads and its slice of the MLP), ``o_proj`` and
``down_proj`` row-parallel, each followed by one all-reduce; the embedding and the
LM head are split by vocabulary rows (``VocabParallelEmbedding``), and the logits are
all-gathered, so every rank samples the same token from the same full logits. The
checkpoint is full-size: ``load_weights`` cuts each rank's slice.

Pipeline parallelism: a stage holds a consecutive run of layers; the first also the
embedding, the last the final norm and the LM head (and, with tied embeddings, the
embedding it reuses). A stage that is not the last returns ``(hidden, residual)``
for the next one, which takes them as ``intermediate``.

Mixture-of-experts models (Qwen3-MoE, Mixtral) are this decoder with a ``SparseMoeBlock``
(``moe.py``) in place of ``LlamaMLP`` in the layers ``ModelArchConfig.is_moe_layer`` names;
their experts' checkpoint tensors load through it.

The file stays whole: one model family's definition and its weight loading, read together
(as vLLM keeps one file per model).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from services.config import ModelArchConfig
from services.gpu_worker.attention import AttentionBackend, AttentionMetadata, KVCache
from services.gpu_worker.distributed import SINGLE_RANK, HeadShard, ParallelState
from services.gpu_worker.model.expert_dispatch import ExpertDispatch
from services.gpu_worker.model.fused_decode import FusedDecodeWeights, fused_decode_layers
from services.gpu_worker.model.layers import (
    Linear,
    QuantWeight,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    linear,
    silu_and_mul,
    vocab_rows,
)
from services.gpu_worker.model.moe import SparseMoeBlock, checkpoint_module_name, expert_param
from services.model_loader.gguf_tensors import GGUFBlocks

# A pipeline stage's output for the next: (hidden, residual), each [T, H].
IntermediateTensors = tuple[torch.Tensor, torch.Tensor]
# A checkpoint tensor: dense, or a GGUF matrix's blocks (kept quantized where kernels read them).
CheckpointTensor = torch.Tensor | GGUFBlocks

# (fused param, HF name, shard): HF's separate projections land in slices of the fused ones.
_STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class LlamaAttention(nn.Module):
    k_scale: torch.Tensor  # buffers: [1] fp32
    v_scale: torch.Tensor

    def __init__(
        self,
        arch: ModelArchConfig,
        attn_backend: type[AttentionBackend],
        rotary_emb: RotaryEmbedding,
        parallel: ParallelState,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.heads = HeadShard.of(arch, parallel)
        self.num_heads, self.num_kv_heads = self.heads.num_heads, self.heads.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias
        )
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.rotary_emb = rotary_emb
        self.attn = attn_backend(
            self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5
        )
        # An fp8 KV cache's scales (--kv-cache-dtype fp8): the checkpoint's, measured on the
        # first prompt (--calculate-kv-scales), else 1.0 (``LlamaForCausalLM.load_weights``
        # sets them; ``reset_kv_scales`` after the model is materialised).
        self.register_buffer("k_scale", torch.ones(1), persistent=False)
        self.register_buffer("v_scale", torch.ones(1), persistent=False)

    def shard_range(self, shard: str) -> tuple[int, int]:
        """(offset, size) of the q, k or v rows inside ``qkv_proj``."""
        offsets = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}
        return offsets[shard], self.q_size if shard == "q" else self.kv_size

    def forward(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: KVCache,
        attn_meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens, head_dim = hidden.shape[0], self.head_dim
        qkv = self.qkv_proj(hidden).view(num_tokens, -1, head_dim)
        # Heads stay strided views of the fused output: q and k rotate in one pass.
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        if attn_meta.compute_kv_scales:
            self._measure_kv_scales(qk[:, self.num_heads :], v)
        scales = (self.k_scale, self.v_scale)
        if self.attn.fuses_rotary:
            out = self.attn.forward_rotary(qk, v, cos_sin, kv_cache, attn_meta, scales)
        else:
            qk = self.rotary_emb(qk, *cos_sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            out = self.attn.forward(q, k, v, kv_cache, attn_meta, scales)
        return self.parallel.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))

    def _measure_kv_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """vLLM's --calculate-kv-scales: absmax / 200 for K, / 100 for V (headroom under
        e4m3's 448). K is measured before rotary, the same in every backend (a rotation
        grows an element by at most sqrt(2), well inside that headroom)."""
        self.k_scale.copy_((k.abs().amax().float() / K_SCALE_RANGE).clamp_min(1e-12))
        self.v_scale.copy_((v.abs().amax().float() / V_SCALE_RANGE).clamp_min(1e-12))


# vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT: the absmax a measured fp8 scale maps to.
K_SCALE_RANGE, V_SCALE_RANGE = 200.0, 100.0


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArchConfig, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel = parallel
        self.intermediate_size = arch.intermediate_size // parallel.tp_size  # this rank's
        self.gate_up_proj = Linear(arch.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = Linear(self.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        attn_backend: type[AttentionBackend],
        rotary_emb: RotaryEmbedding,
        parallel: ParallelState,
        layer: int = 0,
        dispatch: ExpertDispatch | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, attn_backend, rotary_emb, parallel)
        self.mlp: LlamaMLP | SparseMoeBlock = (
            SparseMoeBlock(arch, parallel, dispatch)
            if arch.is_moe_layer(layer)
            else LlamaMLP(arch, parallel)
        )
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        attn_meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden, kv_cache, attn_meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        attn_backend: type[AttentionBackend],
        max_positions: int,
        parallel: ParallelState,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        needs_embedding = parallel.is_first_stage or (
            parallel.is_last_stage and arch.tie_word_embeddings
        )
        self.embed_tokens = (
            VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, parallel)
            if needs_embedding
            else None
        )
        self.rotary_emb = RotaryEmbedding(
            arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling
        )
        heads = HeadShard.of(arch, parallel)
        # What the attention backend derives from a step's metadata, once per step.
        self.attn_builder = attn_backend.builder(heads.num_heads, heads.num_kv_heads, arch.head_dim)
        self.layer_start, layer_end = parallel.layer_range(arch.num_hidden_layers)
        # The MoE layers' shared state: the step's token counts, the experts' load.
        self.expert_dispatch = ExpertDispatch(parallel, arch.num_experts) if arch.is_moe else None
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                arch, attn_backend, self.rotary_emb, parallel, i, self.expert_dispatch
            )
            for i in range(self.layer_start, layer_end)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if parallel.is_last_stage else None
        self.is_moe = arch.is_moe

    def moe_blocks(self) -> list[SparseMoeBlock]:
        """This stage's MoE layers, in order (what a dummy forward runs)."""
        return [
            layer.mlp
            for layer in self.layers
            if isinstance(layer, LlamaDecoderLayer) and isinstance(layer.mlp, SparseMoeBlock)
        ]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_meta: AttentionMetadata,
        kv_caches: list[KVCache],
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if intermediate is None:
            assert self.embed_tokens is not None
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        if not attn_meta.backend_state:  # else built already (a CUDA graph's, at capture)
            self.attn_builder.build(attn_meta, kv_caches[0])
        cos_sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        fused = self._fused_decode_args(hidden, attn_meta) if intermediate is None else None
        if fused is not None:
            hidden, residual = fused_decode_layers(hidden, cos_sin, kv_caches, attn_meta, fused)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                hidden, residual = layer(cos_sin, hidden, residual, kv_cache, attn_meta)
        if self.norm is None:
            assert residual is not None  # every stage has a layer
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden

    # A decode step's layers in one C++ call (actorserve_kernels/cpu/decode_layers.cpp) when the model
    # and the batch allow it; ``fused_decode = False`` keeps the Python layers (tests).
    fused_decode = True
    _fused: FusedDecodeWeights | None | bool = False  # False: not decided yet

    def _fused_decode_args(
        self, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> FusedDecodeWeights | None:
        tokens = hidden.shape[0]
        if (
            not self.fused_decode
            or self.is_moe  # the C++ decode layers are dense
            or hidden.device.type != "cpu"  # a C++ op of the CPU kernels
            or meta.max_query_len != 1
            or tokens != meta.num_reqs
            or int(meta.query_start_loc_cpu[-1]) != tokens  # padding rows
        ):
            return None
        if self._fused is False:
            self._fused = FusedDecodeWeights.of(self)
        return self._fused if isinstance(self._fused, FusedDecodeWeights) else None


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a paged KV cache.

    ``forward(input_ids[T], positions[T], attn_meta, kv_caches) -> hidden[T, H]``
    (final-normed; on a stage before the last, ``(hidden, residual)``; a stage after the
    first takes the previous one's as ``intermediate``);
    ``compute_logits(hidden[N, H]) -> logits[N, vocab]`` in fp32 (last stage only);
    ``load_weights`` takes (HF name, tensor) pairs and raises ``ValueError`` on an
    unknown name or a parameter left unloaded.
    """

    def __init__(
        self,
        arch: ModelArchConfig,
        attn_backend: type[AttentionBackend],
        max_positions: int | None = None,
        parallel: ParallelState = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.parallel = parallel
        # --cpu-activation-quant int8: quantized linears take activations rounded to int8
        # (set before load_weights, which packs them for it).
        self.int8_activations = False
        self.model = LlamaModel(
            arch, attn_backend, max_positions or arch.max_position_embeddings, parallel
        )
        self.lm_head = (
            Linear(arch.hidden_size, vocab_rows(arch.vocab_size, parallel.tp_size), bias=False)
            if parallel.is_last_stage and not arch.tie_word_embeddings
            else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_meta: AttentionMetadata,
        kv_caches: list[KVCache],
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, attn_meta, kv_caches, intermediate)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head if self.lm_head is not None else self.model.embed_tokens
        assert head is not None
        if head.quant is not None:
            # Quantized: a bf16 model's hidden is widened (exactly) for fp32 logits, which the
            # few-row kernels compute anyway; rounding them to bf16 would only add ties.
            logits = head.quant.linear(hidden.float())
        elif self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            logits = linear(hidden, head.weight)
        if self.parallel.tp_size == 1:
            return logits.float()
        # Each rank's padded vocabulary slice, gathered in rank order; drop the padding.
        return self.parallel.all_gather(logits)[:, : self.arch.vocab_size].float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Load (HF name, tensor) pairs; a ``GGUFBlocks`` matrix stays quantized where the
        CPU kernels read its type (fp32 or bf16 CPU model), and is expanded otherwise."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        pending: dict[str, dict[str | int, GGUFBlocks]] = {}  # fused shards seen quantized
        for hf_name, checkpoint_tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue  # tied (some checkpoints store the copy anyway), or not the last stage
            if not self._on_this_stage(hf_name):
                continue
            hf_name = checkpoint_module_name(self._local_layer_name(hf_name))
            if self._load_kv_scale(hf_name, checkpoint_tensor):
                continue
            if self._load_expert(hf_name, checkpoint_tensor, params, loaded):
                continue
            name, shard = hf_name, None
            for fused, part, shard_id in _STACKED_PARAMS:
                if f".{part}." in hf_name:
                    name, shard = hf_name.replace(f".{part}.", f".{fused}."), shard_id
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {hf_name!r} matches no model parameter")
            sliced = self._rank_slice(hf_name, checkpoint_tensor)
            if isinstance(sliced, GGUFBlocks):
                if self._load_quantized(name, shard, sliced, pending):
                    loaded.add(f"{name}#{shard}")
                    continue
                sliced = sliced.dequantize().to(param.dtype)
            tensor = sliced
            target = param.data
            if shard is not None:
                target = target.narrow(0, *self._shard_range(name, shard))
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                # The last rank's vocabulary slice is padded: zero rows never win a logit
                # that survives the gather's cut.
                target[tensor.shape[0] :].zero_()
                target = target.narrow(0, 0, tensor.shape[0])
            if target.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(f"{name}#{shard}")
        for name, parts in pending.items():  # a sibling shard came dense: expand these too
            weight = params[name].data
            for shard_id, blocks in parts.items():
                self._copy_dense_shard(name, shard_id, blocks, weight)
        expected = {f"{n}#{s}" for n, s in self._expected_shards(params)}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

    def _load_expert(
        self,
        hf_name: str,
        tensor: CheckpointTensor,
        params: dict[str, nn.Parameter],
        loaded: set[str],
    ) -> bool:
        """One expert's projection into its MoE block's stacked ``w13``/``w2``, or, GGUF
        blocks the CPU kernels read, kept quantized (``SparseMoeBlock.load_quantized_expert``);
        True if ``hf_name`` was one."""
        found = expert_param(hf_name)
        if found is None:
            return False
        name, expert, shard = found
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} matches no model parameter")
        block = self.get_submodule(name.rsplit(".", 1)[0])
        assert isinstance(block, SparseMoeBlock)
        param = name.rsplit(".", 1)[1]
        if not 0 <= expert < block.num_experts:
            raise ValueError(
                f"checkpoint tensor {hf_name!r}: expert {expert} out of range: the model has "
                f"{block.num_experts}"
            )
        if not block.is_local(expert):
            return True  # another expert-parallel rank holds it: not even converted here
        try:
            local = block.load_quantized_expert(param, expert, shard, tensor, self.int8_activations)
            if not local:
                if isinstance(tensor, GGUFBlocks):  # expanded only if this rank holds it
                    tensor = tensor.dequantize() if block.is_local(expert) else torch.empty(0)
                local = block.load_expert(param, expert, shard, tensor.to(params[name].dtype))
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {hf_name!r}: {e}") from None
        if local:  # else another expert-parallel rank holds it
            loaded.add(f"{name}#{expert}:{shard}")
        return True

    def reset_kv_scales(self) -> None:
        """Every layer's fp8 KV scales to 1.0 (after the model is materialised: the buffers
        are uninitialised then), before ``load_weights`` may read the checkpoint's."""
        for module in self.modules():
            if isinstance(module, LlamaAttention):
                module.k_scale.fill_(1.0)
                module.v_scale.fill_(1.0)

    def _load_kv_scale(self, hf_name: str, tensor: CheckpointTensor) -> bool:
        """A checkpoint's fp8 KV scale (``...self_attn.k_scale``, or as quantization tools
        name it, ``...self_attn.k_proj.k_scale``): into the layer's buffer; True if it was one."""
        for which in ("k_scale", "v_scale"):
            for suffix in (f".self_attn.{which}", f".self_attn.{which[0]}_proj.{which}"):
                if hf_name.endswith(suffix):
                    assert isinstance(tensor, torch.Tensor)
                    attn = self.get_submodule(hf_name.removesuffix(suffix) + ".self_attn")
                    getattr(attn, which).copy_(tensor.float().reshape(1))
                    return True
        return False

    def int8_linears(self) -> int:
        """How many linears were packed for int8 activations."""
        return sum(
            1
            for m in self.modules()
            if isinstance(m, Linear) and m.quant is not None and m.quant.int8_activations
        )

    def _load_quantized(
        self,
        name: str,
        shard: str | int | None,
        blocks: GGUFBlocks,
        pending: dict[str, dict[str | int, GGUFBlocks]],
    ) -> bool:
        """Keep ``blocks`` quantized in the module that owns ``name`` (a fused projection
        once all its shards arrived, as one matrix); False when it must be loaded dense."""
        module = self.get_submodule(name.rsplit(".", 1)[0])
        weight = getattr(module, "weight", None)
        if (
            not name.endswith(".weight")
            or not isinstance(module, Linear | VocabParallelEmbedding)
            or weight is None
            or weight.dtype not in (torch.float32, torch.bfloat16)
            or weight.device.type != "cpu"
        ):
            return False
        int8 = self.int8_activations and isinstance(module, Linear)  # not embedding lookups
        if shard is None:
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                blocks = _pad_rows(blocks, weight.shape[0])  # the last rank's padded vocabulary
            quant = QuantWeight.pack(blocks, int8)
            if quant is None:
                return False
            module.set_quantized(quant)
            return True
        parts = pending.setdefault(name, {})
        parts[shard] = blocks
        order: tuple[str | int, ...] = ("q", "k", "v") if ".qkv_proj." in name else (0, 1)
        if len(parts) < len(order):
            return True  # packed with the other shards
        del pending[name]
        chunks = [parts[s] for s in order]
        quant = None
        if len({c.ggml_type for c in chunks}) == 1 and len({c.shape[1] for c in chunks}) == 1:
            data = torch.cat([c.data for c in chunks])
            rows = sum(c.shape[0] for c in chunks)
            quant = QuantWeight.pack(
                GGUFBlocks(data, chunks[0].ggml_type, (rows, chunks[0].shape[1])), int8
            )
        if quant is not None:
            module.set_quantized(quant)
            return True
        for s, chunk in zip(order, chunks, strict=True):  # mixed types: expand each shard
            self._copy_dense_shard(name, s, chunk, weight.data)
        return True

    def _copy_dense_shard(
        self, name: str, shard: str | int, blocks: GGUFBlocks, weight: torch.Tensor
    ) -> None:
        target = weight.narrow(0, *self._shard_range(name, shard))
        if target.shape != blocks.shape:
            raise ValueError(
                f"checkpoint shard {shard!r} of {name!r} has shape {blocks.shape}, "
                f"expected {tuple(target.shape)}"
            )
        target.copy_(blocks.dequantize())

    def _on_this_stage(self, hf_name: str) -> bool:
        m = self.model
        if hf_name.startswith("model.layers."):
            return 0 <= int(hf_name.split(".")[2]) - m.layer_start < len(m.layers)
        if hf_name == "model.embed_tokens.weight":
            return m.embed_tokens is not None
        if hf_name == "model.norm.weight":
            return m.norm is not None
        return True

    def _local_layer_name(self, hf_name: str) -> str:
        """``model.layers.{i}.…`` with i counted from this stage's first layer."""
        if not hf_name.startswith("model.layers.") or not self.model.layer_start:
            return hf_name
        parts = hf_name.split(".")
        parts[2] = str(int(parts[2]) - self.model.layer_start)
        return ".".join(parts)

    def _rank_slice(self, hf_name: str, tensor: CheckpointTensor) -> CheckpointTensor:
        """This TP rank's slice of a full checkpoint tensor (the whole one for TP 1)."""
        cut = self._rank_cut(hf_name, tensor.shape[0])
        if cut is None:
            return tensor
        if isinstance(tensor, GGUFBlocks):
            part = tensor.narrow(*cut)
            return part if part is not None else tensor.dequantize().narrow(*cut)
        return tensor.narrow(*cut)

    def _rank_cut(self, hf_name: str, rows: int) -> tuple[int, int, int] | None:
        """(dim, start, length) of this TP rank's slice of a tensor, None for all of it."""
        p = self.parallel
        if p.tp_size == 1:
            return None
        attn = self.model.layers[0].self_attn
        assert isinstance(attn, LlamaAttention)
        heads, d = attn.heads, attn.head_dim
        width = self.arch.intermediate_size // p.tp_size  # a dense MLP's (experts cut their own)
        if ".q_proj." in hf_name:
            return 0, heads.q_start * d, heads.num_heads * d
        if ".k_proj." in hf_name or ".v_proj." in hf_name:
            return 0, heads.kv_start * d, heads.num_kv_heads * d
        if ".o_proj." in hf_name:
            return 1, heads.q_start * d, heads.num_heads * d
        if ".gate_proj." in hf_name or ".up_proj." in hf_name:
            return 0, p.tp_rank * width, width
        if ".down_proj." in hf_name:
            return 1, p.tp_rank * width, width
        if hf_name.endswith(("embed_tokens.weight", "lm_head.weight")):
            num_rows = vocab_rows(self.arch.vocab_size, p.tp_size)
            start = p.tp_rank * num_rows
            return 0, start, max(0, min(num_rows, rows - start))
        return None  # norms: replicated

    def _shard_range(self, name: str, shard: str | int) -> tuple[int, int]:
        layer = self.model.layers[int(name.split(".")[2])]
        assert isinstance(layer, LlamaDecoderLayer)
        if isinstance(shard, str):
            return layer.self_attn.shard_range(shard)
        size = layer.mlp.intermediate_size
        return shard * size, size

    def _expected_shards(self, params: dict[str, nn.Parameter]) -> Iterable[tuple[str, object]]:
        for name in params:
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                yield from ((name, s) for s in ("q", "k", "v"))
            elif name.endswith("gate_up_proj.weight"):
                yield from ((name, s) for s in (0, 1))
            elif name.endswith((".mlp.w13", ".mlp.w2")):
                block = self.get_submodule(name.rsplit(".", 1)[0])
                assert isinstance(block, SparseMoeBlock)
                experts = range(block.expert_start, block.expert_start + block.num_local_experts)
                shards = (0, 1) if name.endswith("w13") else (None,)
                yield from ((name, f"{e}:{s}") for e in experts for s in shards)
            else:
                yield name, None


def _pad_rows(blocks: GGUFBlocks, rows: int) -> GGUFBlocks:
    """``blocks`` with zero rows appended up to ``rows`` (all-zero bytes: zero weights)."""
    extra = rows - blocks.shape[0]
    if extra <= 0:
        return blocks
    data = torch.cat([blocks.data, blocks.data.new_zeros(extra, blocks.data.shape[1])])
    return GGUFBlocks(data, blocks.ggml_type, (rows, blocks.shape[1]))
