"""The model runner's real step on a Llama-3-8B-shaped model: ``ModelRunner.execute(plan)``.

Part of the GPU check (``bench/gpu_check.py`` runs it once per mode, each in its own process,
so that a CUDA error in one mode, or memory that one runner keeps, cannot spoil the other):

    python3 -m bench.gpu_decode --mode eager|graphs [--bandwidth-gbps X] [--out FILE] [--tiny]

One runner (``--load-format dummy``: random N(0, 0.02) weights, made on the device; bf16 on
CUDA, fp32 on a CPU) with ``enforce_eager`` set by ``--mode``; after its KV cache,
``capture_cuda_graphs()`` (the CUDA graphs of decode; a no-op on a CPU and with
enforce_eager; timed, with the memory it took). Then, timed on the host around
``execute()`` (inputs, forward, sampling, the sampled ids back: the step the worker runs):

- decode at batch 1, 16, 64 and 256, context 2048: step 0 adds the requests
  (``NewRequest``: a 2,048-token prompt, 2,047 tokens computed, its blocks) and computes
  their last prompt token; every later step computes one token per request, its plan a
  ``RunningRequestDelta`` (with a new block when the request crosses a block boundary), as
  the scheduler sends it. Greedy sampling (as ``bench/gpu_serve.py``'s requests). Steps 1-3
  warm up, the next ``--steps`` are timed, then ``--check-steps`` more (not timed: below);
  the context grows from 2,048 by that many tokens.
- one row at batch 64 with temperature 0.8 and top-p 0.95 (the sampler's other path);
- a 1,024-token prefill (one request, its whole prompt in one step).

The "computed" 2,047 tokens' K/V are random (``fill_kv_cache``: N(0, 1) from a fixed seed,
the same in both modes; only where the cache holds the model's float dtype, zeros for a
quantized ``--kv-cache-dtype``): each decode attends over 2,047 distinct keys, so a step
that read the wrong context (a replay with stale sequence lengths, block tables or
positions) would give other tokens, where over an all-zero cache it would give the same.

Each decode row has its floor, (weight bytes + KV bytes read) / the copy bandwidth, where
the weights are every matrix the step reads (the embedding table is a lookup: not counted)
and the KV bytes those of the rows' contexts. Every greedy step's sampled tokens
(``step_tokens``) and the prefill's are kept, so that the two modes' outputs can be
compared step by step (same seed, same weights, same K/V).

``graph_vs_eager`` (graphs mode, where the runner has graphs): each decode batch's
``--check-steps`` run ``execute()`` as usual (the graph of its padded size replays; its
output rows are copied) and then the model eagerly over the very same padded step inputs
(the buffers ``execute()`` prepared, still in place), on the same cache: the replay wrote
this step's K/V and the eager forward writes the same values to the same slots, so both
read the same context. The hidden rows are compared (max abs difference, largest per-row
relative error) and so are the greedy tokens of their logits. Same kernels, same inputs:
only the recording differs, so anything a graph baked in at capture (a stale pointer, a
host-side value, last step's lengths) shows up as a row off by more than rounding (past
``ROW_REL_ERROR``, 2e-2 relative: an error, and gpu_check then serves without graphs). On a CPU the "graphs" are the same padded steps run eagerly
(``capture_cuda_graphs(record=False)``, where the attention backend supports them): the
check's code runs, and agrees exactly.

``--tiny`` (a 2-layer model, small vocabulary, batches 1/4/8, context 64, prefill 32; the CPU
when there is no GPU) is the dry run of all of it. Writes JSON after every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import gpu_check as gcheck

GiB = 1 << 30
TINY = {**gcheck.LLAMA3_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
        "max_position_embeddings": 1024}  # fmt: skip
# (batches, context, prefill tokens, the batch of the sampled row) of each scale
SHAPES = {"8b": ((1, 16, 64, 256), 2048, 1024, 64), "tiny": ((1, 4, 8), 64, 32, 4)}
NUM_SPECIAL = 256  # Llama-3's reserved specials: the top 256 ids, never in a prompt here
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
KV_FILL_SEED = 1234
# graph_vs_eager: the same kernels on the same inputs should agree bit for bit; within
# ROW_REL_OK (relative L2 of a row) it is rounding (bf16: ~4e-3 an element, averaging out
# over a row); past ROW_REL_ERROR a row was computed from other inputs (on the tiny model
# leaving out one of 20 context tokens puts a row 7e-2 off; one of 2,048 on the 8B
# model, ~1/sqrt(2048) of the attention output, a few 1e-2).
ROW_REL_OK, ROW_REL_ERROR = 5e-3, 2e-2


def has_config_field(name: str) -> bool:
    from services.config.engine import WorkerConfig

    return name in {f.name for f in dataclasses.fields(WorkerConfig)}


def build_runner(
    arch_json: dict[str, Any],
    device: str,
    *,
    eager: bool,
    max_batch: int,
    max_model_len: int,
    token_budget: int,
    attention_backend: str | None = None,
) -> tuple[Any, Any, dict[str, Any]]:
    """The runner as the worker builds it (its KV cache not yet): (runner, arch, facts)."""
    from services.config import EngineConfig, ModelArchConfig
    from services.gpu_worker.model_runner import ModelRunner
    from services.model_loader import dummy_weights

    arch = ModelArchConfig.from_hf_config(arch_json)
    config = EngineConfig()
    config.model.load_format = "dummy"
    config.model.dtype = "bfloat16" if device == "cuda" else "float32"
    config.scheduler.max_model_len = max_model_len
    config.scheduler.max_num_seqs = max_batch
    config.scheduler.max_num_batched_tokens = token_budget
    config.worker.device = device
    config.worker.attention_backend = attention_backend or (
        "triton" if device == "cuda" else "torch"
    )
    config.cache.block_size = gcheck.BLOCK_SIZE
    # vLLM's --enforce-eager (being added with the CUDA graphs): set whether or not the field
    # exists yet, so that this runs before it lands; the JSON says which it was.
    config.worker.enforce_eager = eager
    config.finalize(arch)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    start = time.monotonic()
    runner = ModelRunner(config, None, arch=arch, weights=dummy_weights(arch, dtype, 0, device))
    facts = {
        "build_s": round(time.monotonic() - start, 2),
        "enforce_eager_field": has_config_field("enforce_eager"),
        "capture_method": callable(getattr(runner, "capture_cuda_graphs", None)),
    }
    return runner, arch, facts


def capture_graphs(runner: Any, device: str, mode: str) -> dict[str, Any]:
    """``capture_cuda_graphs()`` if the runner has it: its time and the memory it took. On a
    CPU in graphs mode ``record=False``: decode steps padded to the sizes, run eagerly
    (where the attention backend supports graphs; not the torch one)."""
    capture = getattr(runner, "capture_cuda_graphs", None)
    if capture is None:
        return {"called": False, "note": "ModelRunner has no capture_cuda_graphs (not landed)"}
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
    start = time.monotonic()
    if not cuda and mode == "graphs":
        capture(record=False)
    else:
        capture()
    if cuda:
        torch.cuda.synchronize()
    out: dict[str, Any] = {"called": True, "seconds": round(time.monotonic() - start, 2)}
    # What the runner keeps of them (the CUDA-graph change's DecodeGraphs), where it says
    graphs = getattr(runner, "graphs", None)
    out["runner_graphs"] = graphs is not None
    if graphs is not None:
        out["sizes"] = f"{graphs.sizes[0]}..{graphs.sizes[-1]} ({len(graphs.sizes)})"
        out["recorded"] = bool(getattr(graphs, "capture_graphs", cuda))
    if cuda:
        out["memory_gib"] = round((free_before - torch.cuda.mem_get_info()[0]) / GiB, 2)
    return out


GRAPH_VS_EAGER = (
    "each decode batch's check steps: execute() replays the graph of the padded size (its "
    "output rows copied), then runner.model(...) runs eagerly over the same padded step "
    "inputs, still in the buffers, on the same cache (the replay wrote this step's K/V; the "
    "eager forward writes the same values to the same slots); hidden rows and the greedy "
    "tokens of their logits compared. Same kernels, same inputs: only the recording differs"
)


def fill_kv_cache(runner: Any, seed: int = KV_FILL_SEED) -> dict[str, Any]:
    """Random K/V in the whole cache, N(0, 1) from ``seed`` (the same in both modes, for
    the same number of blocks), where the cache holds the model's float dtype; a quantized
    cache (``--kv-cache-dtype`` fp8/int8: bytes and scales) is zeroed instead."""
    key = runner.kv_caches[0][0]
    fill = {"num_blocks": int(key.shape[0]), "cache_dtype": str(key.dtype).removeprefix("torch.")}
    if not (key.dtype.is_floating_point and key.dtype == runner.dtype):
        for k, v in runner.kv_caches:
            k.zero_()
            v.zero_()
        kind = getattr(runner, "kv_cache_dtype", "?")
        return {**fill, "how": f"zeros: the cache stores {kind} ({fill['cache_dtype']}), "
                f"not the model's {runner.dtype}; not filled"}  # fmt: skip
    gen = torch.Generator(device=key.device).manual_seed(seed)
    for k, v in runner.kv_caches:
        k.normal_(generator=gen)
        v.normal_(generator=gen)
    return {**fill, "how": f"normal(0, 1), seed {seed}"}


def weight_bytes(runner: Any) -> int:
    """Bytes of the weights one decode step reads (not the embedding table, a lookup)."""
    tied = runner.arch.tie_word_embeddings
    return sum(
        p.numel() * p.element_size()
        for n, p in runner.model.named_parameters()
        if tied or "embed_tokens" not in n
    )


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Plans:
    """Step plans for one batch of requests that each decode one token per step, and the
    block ids each holds (request i owns blocks ``i * per_seq`` to ``(i + 1) * per_seq - 1``
    and is given them as its context reaches them)."""

    def __init__(self, tag: str, batch: int, context: int, vocab: int, per_seq: int,
                 sampling: Any, rng: np.random.Generator) -> None:  # fmt: skip
        from services.protocol import NewRequest

        bs = gcheck.BLOCK_SIZE
        self.ids = [f"{tag}-{i}" for i in range(batch)]
        self.blocks = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        held = math.ceil(context / bs)
        self.held = [held] * batch
        self.computed = context - 1
        prompts = rng.integers(0, vocab - NUM_SPECIAL, size=(batch, context)).tolist()
        self.new = [
            NewRequest(
                req_id=r,
                token_ids=p,
                num_prompt_tokens=context,
                sampling=sampling,
                block_ids=b[:held],
                num_computed_tokens=context - 1,
            )  # fmt: skip
            for r, p, b in zip(self.ids, prompts, self.blocks, strict=True)
        ]

    def first(self, step_id: int, finished: list[str]) -> Any:
        from services.protocol import StepPlan

        return StepPlan(step_id=step_id, new_requests=self.new,
                        num_scheduled_tokens=[1] * len(self.ids), finished_req_ids=finished)  # fmt: skip

    def next(self, step_id: int) -> Any:
        """The next step: one more token each, a new block where its position needs one."""
        from services.protocol import RunningRequestDelta, StepPlan

        self.computed += 1
        need = self.computed // gcheck.BLOCK_SIZE + 1
        running = []
        for i, req_id in enumerate(self.ids):
            new = self.blocks[i][self.held[i] : need]
            self.held[i] = max(self.held[i], need)
            running.append(RunningRequestDelta(req_id, new, self.computed))
        return StepPlan(step_id=step_id, running=running, num_scheduled_tokens=[1] * len(self.ids))


def _stats(ms: list[float]) -> dict[str, float]:
    q = statistics.quantiles(ms, n=10) if len(ms) > 1 else [ms[0]] * 9
    return {"step_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
            "p10_ms": q[0], "p90_ms": q[8], "min_ms": min(ms)}  # fmt: skip


class Bench:
    """Times ``runner.execute`` over synthetic plans; fills ``out`` (the JSON) as it goes."""

    def __init__(self, runner: Any, device: str, bandwidth: float, out: dict[str, Any],
                 check_steps: int = 0) -> None:  # fmt: skip
        self.runner, self.device, self.bandwidth, self.out = runner, device, bandwidth, out
        self.check_steps = check_steps
        # graphs mode with graphs: the check steps also run the model eagerly (graph_vs_eager)
        self.compare = getattr(runner, "graphs", None) is not None
        self.checks: list[dict[str, Any]] = []
        self.step_id = 0
        self.live: list[str] = []
        self.kv_per_token = runner.kv_cache_bytes_per_block() // gcheck.BLOCK_SIZE
        self.weights = weight_bytes(runner)
        self.rng = np.random.default_rng(0)
        out.update(weight_bytes=self.weights, kv_bytes_per_token=self.kv_per_token)

    def execute(self, plan: Any) -> tuple[Any, float]:
        _sync(self.device)
        start = time.perf_counter()
        result = self.runner.execute(plan)  # ends with the sampled ids on the host: a sync
        ms = (time.perf_counter() - start) * 1e3
        self.step_id += 1
        return result, ms

    def compare_step(self, plan: Any, label: str) -> tuple[Any, dict[str, Any]]:
        """``execute(plan)`` with its graph's output rows copied, then the model eagerly over
        the same padded inputs (see the module's doc): (the step's result, the comparison)."""
        runner = self.runner
        graphs, buffers = runner.graphs, runner.buffers
        seen: dict[str, Any] = {}
        replay, prepare = graphs.replay, buffers.prepare

        def spy_replay(size: int) -> torch.Tensor:
            out = replay(size)
            seen["size"], seen["graph"] = size, out.clone()
            return out

        def spy_prepare(*args: Any, **kwargs: Any) -> Any:
            seen["inputs"] = prepare(*args, **kwargs)
            return seen["inputs"]

        graphs.replay, buffers.prepare = spy_replay, spy_prepare
        try:
            result, _ = self.execute(plan)
        finally:  # the instances' own methods again
            del graphs.replay, buffers.prepare
        check: dict[str, Any] = {"case": label, "step_id": plan.step_id,
                                 "graph_size": seen.get("size")}  # fmt: skip
        if "size" not in seen:
            check["note"] = "not replayed: the step ran eagerly"
            return result, check
        try:  # the step itself ran: its timing row stands whatever happens here
            check.update(self._eager_same_inputs(seen))
        except Exception as e:
            traceback.print_exc()
            check["note"] = f"FAILED: {type(e).__name__}: {e}"[:300]
        return result, check

    def _eager_same_inputs(self, seen: dict[str, Any]) -> dict[str, Any]:
        runner = self.runner
        inputs = seen["inputs"]
        n = inputs.num_tokens
        with torch.inference_mode():
            eager = runner.model(
                inputs.input_ids, inputs.positions, inputs.attn_meta, runner.kv_caches
            )[:n]
            graph = seen["graph"][:n]
            g, e = graph.float(), eager.float()
            row_rel = (g - e).norm(dim=-1) / e.norm(dim=-1).clamp_min(1e-30)
            idx = inputs.logits_indices
            tok_g = runner.model.compute_logits(graph[idx]).argmax(-1).tolist()
            tok_e = runner.model.compute_logits(eager[idx]).argmax(-1).tolist()
        _sync(self.device)
        return dict(
            max_abs_diff=float((g - e).abs().max()), max_abs=float(e.abs().max()),
            max_row_rel_err=float(row_rel.max()),
            tokens_equal=sum(a == b for a, b in zip(tok_g, tok_e, strict=True)), tokens=len(tok_e),
            finite=bool(torch.isfinite(g).all()),
        )  # fmt: skip

    def decode(self, batch: int, context: int, warmup: int, steps: int, per_seq: int,
               sampled: bool = False) -> dict[str, Any]:  # fmt: skip
        from services.protocol import SamplingParams

        params = SAMPLED if sampled else {"temperature": 0.0}
        sampling = SamplingParams(max_tokens=context, ignore_eos=True, **params)
        tag = f"{'s' if sampled else 'd'}{batch}"
        vocab = self.runner.arch.vocab_size
        plans = Plans(tag, batch, context, vocab, per_seq, sampling, self.rng)
        finished, self.live = self.live, self.live + plans.ids  # if it fails: drop them all
        result, first_ms = self.execute(plans.first(self.step_id, finished))
        self.live = plans.ids
        first_tokens = list(result.sampled_token_ids)
        if result.req_ids != plans.ids or not all(0 <= t < vocab for t in first_tokens):
            raise RuntimeError(
                f"B={batch}: step 0 sampled {first_tokens[:8]}... for {result.req_ids[:4]}"
            )
        step_tokens = [first_tokens]
        times, seq_lens = [], []
        for k in range(warmup + steps + self.check_steps):
            plan = plans.next(self.step_id)
            if k >= warmup + steps and self.compare:
                result, check = self.compare_step(plan, f"decode B={batch}" + " sampled" * sampled)
                self.checks.append(check)
                ms = 0.0  # not timed
            else:
                result, ms = self.execute(plan)
            if len(result.sampled_token_ids) != batch:
                raise RuntimeError(f"B={batch}: {len(result.sampled_token_ids)} tokens sampled")
            step_tokens.append(list(result.sampled_token_ids))
            if warmup <= k < warmup + steps:
                times.append(ms)
                seq_lens.append(plans.computed + 1)
        ctx = statistics.fmean(seq_lens)
        kv = batch * ctx * self.kv_per_token
        floor = (self.weights + kv) / self.bandwidth * 1e3
        s = _stats(times)
        row = {
            "case": f"decode B={batch} ctx={context}" + (" T=0.8 top-p 0.95" if sampled else ""),
            "batch": batch, "context": context, "mean_context": round(ctx, 1), "steps": steps,
            **s, "first_step_ms": first_ms, "floor_ms": floor, "floor_frac": floor / s["step_ms"],
            "tok_s": batch / s["step_ms"] * 1e3, "sampling": "greedy" if not sampled else SAMPLED,
        }  # fmt: skip
        if not sampled:
            self.out["first_tokens"][str(batch)] = first_tokens
            self.out["step_tokens"][str(batch)] = step_tokens
        return row

    def prefill(self, tokens: int, warmup: int, steps: int) -> dict[str, Any]:
        from services.protocol import NewRequest, SamplingParams, StepPlan

        sampling = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        blocks = list(range(math.ceil(tokens / gcheck.BLOCK_SIZE)))
        prompt = np.random.default_rng(1).integers(
            0, self.runner.arch.vocab_size - NUM_SPECIAL, size=tokens
        )
        times, first = [], None
        for k in range(warmup + steps):
            req = NewRequest(req_id=f"p{k}", token_ids=prompt.tolist(), num_prompt_tokens=tokens,
                             sampling=sampling, block_ids=blocks, num_computed_tokens=0)  # fmt: skip
            finished, self.live = self.live, [*self.live, req.req_id]
            plan = StepPlan(step_id=self.step_id, new_requests=[req],
                            num_scheduled_tokens=[tokens], finished_req_ids=finished)  # fmt: skip
            result, ms = self.execute(plan)
            self.live = [req.req_id]
            first = result.sampled_token_ids[0] if first is None else first
            if k >= warmup:
                times.append(ms)
        a = self.runner.arch
        head = a.vocab_size * a.hidden_size  # the LM head: the last token's logits only
        matmul = 2 * tokens * (self.weights / self.runner.dtype.itemsize - head) + 2 * head
        attn = 2 * a.num_hidden_layers * a.num_attention_heads * a.head_dim * tokens * (tokens + 1)
        s = _stats(times)
        self.out["prefill_first_token"] = first
        return {"case": f"prefill {tokens} tokens", "tokens": tokens, "steps": steps, **s,
                "tflops": (matmul + attn) / (s["step_ms"] * 1e-3) / 1e12}  # fmt: skip


def cpu_bandwidth(nbytes: int = 256 << 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 2 * nbytes * 5 / (time.perf_counter() - start)


def run(args: argparse.Namespace, out: dict[str, Any], save: Any) -> None:
    device = args.device
    batches, context, prefill_len, sampled_batch = SHAPES["tiny" if args.tiny else "8b"]
    batches = tuple(args.batches or batches)
    context = args.context or context
    prefill_len = args.prefill_len or prefill_len
    steps, warmup = args.steps, args.warmup
    if device == "cuda":
        bandwidth = args.bandwidth_gbps * 1e9 if args.bandwidth_gbps else gcheck.copy_bandwidth()
        torch.cuda.empty_cache()
    else:
        bandwidth = args.bandwidth_gbps * 1e9 if args.bandwidth_gbps else cpu_bandwidth()
    out["bandwidth_gbps"] = round(bandwidth / 1e9, 1)
    per_seq = math.ceil((context + warmup + steps + args.check_steps + 2) / gcheck.BLOCK_SIZE)
    max_batch = max(batches)
    runner, arch, facts = build_runner(
        TINY if args.tiny else gcheck.LLAMA3_8B, device, eager=args.mode == "eager",
        max_batch=max_batch, max_model_len=per_seq * gcheck.BLOCK_SIZE,
        token_budget=max(2048 if device == "cuda" else 512, prefill_len, max_batch),
        attention_backend=args.attention_backend,
    )  # fmt: skip
    out.update(facts)
    print(f"[{args.mode}] runner built in {facts['build_s']} s; enforce_eager field "
          f"{facts['enforce_eager_field']}, capture_cuda_graphs {facts['capture_method']}",
          flush=True)  # fmt: skip
    num_blocks = max_batch * per_seq
    if device == "cuda":  # what fits beside the weights (4 GiB: activations, graphs, slack)
        free = torch.cuda.mem_get_info()[0]
        num_blocks = min(num_blocks, int((free - 4 * GiB) // runner.kv_cache_bytes_per_block()))
    runner.initialize_kv_cache(num_blocks)
    # The plans say 2,047 tokens of each prompt are computed (as a prefix-cache hit would):
    # their K/V must hold numbers, distinct ones (not a CPU's fresh allocation, nor zeros).
    out["kv_fill"] = fill_kv_cache(runner)
    _sync(device)
    out["kv_cache_gib"] = round(num_blocks * runner.kv_cache_bytes_per_block() / GiB, 2)
    out["capture"] = capture_graphs(runner, device, args.mode)
    print(f"[{args.mode}] KV cache: {out['kv_fill']}; capture: {out['capture']}", flush=True)
    save()
    # Both modes run the check steps (the same plans: their tokens compare step by step);
    # where the runner has graphs they also run eagerly on the same inputs.
    bench = Bench(runner, device, bandwidth, out, args.check_steps)
    if args.mode == "graphs":
        out["graph_vs_eager"] = {"method": GRAPH_VS_EAGER, "checks": bench.checks}
    cases: list[tuple[int, bool]] = [(b, False) for b in batches] + [(sampled_batch, True)]
    for batch, sampled in cases:
        name = f"decode B={batch}" + (" sampled" if sampled else "")
        if batch * per_seq > num_blocks:
            out["rows"].append({"case": name, "note": f"skipped: {batch * per_seq} blocks needed, "
                                f"{num_blocks} fit"})  # fmt: skip
            continue
        try:
            r = bench.decode(batch, context, warmup, steps, per_seq, sampled)
        except Exception as e:  # one failing batch must not hide the others
            traceback.print_exc()
            out["rows"].append({"case": name, "note": f"FAILED: {type(e).__name__}: {e}"[:300]})
            save()
            continue
        out["rows"].append(r)
        print(f"[{args.mode}] {r['case']}: {r['step_ms']:.3f} ms (p10 {r['p10_ms']:.3f}, p90 "
              f"{r['p90_ms']:.3f}), floor {r['floor_ms']:.3f} ms = {r['floor_frac']:.0%}, "
              f"{r['tok_s']:.0f} tok/s", flush=True)  # fmt: skip
        if "graph_vs_eager" in out:
            out["graph_vs_eager"].update(summarize_checks(bench.checks))
            for c in bench.checks[-args.check_steps :] if bench.compare else []:
                print(f"[{args.mode}] graph vs eager, {c['case']} step {c['step_id']}: "
                      + _check_text(c), flush=True)  # fmt: skip
        save()
    try:
        p = bench.prefill(prefill_len, warmup=2, steps=max(3, steps // 4))
        out["rows"].append(p)
        print(f"[{args.mode}] {p['case']}: {p['step_ms']:.3f} ms, {p['tflops']:.0f} TFLOP/s",
              flush=True)  # fmt: skip
    except Exception as e:
        traceback.print_exc()
        out["rows"].append({"case": f"prefill {prefill_len} tokens",
                            "note": f"FAILED: {type(e).__name__}: {e}"[:300]})  # fmt: skip
    if "graph_vs_eager" in out:
        summary = summarize_checks(bench.checks)
        out["graph_vs_eager"].update(summary)
        print(f"[{args.mode}] graph vs eager: {summary}", flush=True)
        for c in bench.checks:
            if c.get("note", "").startswith("FAILED"):
                out["errors"].append(f"graph_vs_eager, {c['case']}: {c['note']}"[:300])
                break
        if summary.get("verdict") == "DIFFERENT":
            out["errors"].append(
                f"graph_vs_eager: a replayed row is {summary['max_row_rel_err']:.2g} off the "
                f"eager forward on the same inputs (> {ROW_REL_ERROR}): the graphs compute "
                "from other inputs than the step's"
            )
    save()
    del bench, runner
    gc.collect()


def _check_text(c: dict[str, Any]) -> str:
    if "max_abs_diff" not in c:
        return c.get("note", "?")
    return (f"P={c['graph_size']}, max |diff| {c['max_abs_diff']:.3g} (of {c['max_abs']:.3g}), "
            f"row rel err {c['max_row_rel_err']:.3g}, tokens {c['tokens_equal']}/{c['tokens']}")  # fmt: skip


def summarize_checks(checks: list[dict[str, Any]]) -> dict[str, Any]:
    """graph_vs_eager over all check steps: how many replayed, the largest differences, the
    greedy tokens equal, and a verdict: "identical" (bit for bit), "close" (every row within
    ROW_REL_OK, every token equal), "near" (within ROW_REL_ERROR: rounding, tokens may
    differ at near-ties), "DIFFERENT" (a row past it, or not finite), None (none replayed)."""
    done = [c for c in checks if "max_abs_diff" in c]
    out: dict[str, Any] = {"steps_checked": len(checks), "replayed": f"{len(done)}/{len(checks)}"}
    if not done:
        return {**out, "verdict": None}
    diff = max(c["max_abs_diff"] for c in done)
    rel = max(c["max_row_rel_err"] for c in done)
    same, total = sum(c["tokens_equal"] for c in done), sum(c["tokens"] for c in done)
    finite = all(c["finite"] for c in done)
    if not finite or not rel <= ROW_REL_ERROR:
        verdict = "DIFFERENT"
    elif diff == 0:
        verdict = "identical"
    elif rel <= ROW_REL_OK and same == total:
        verdict = "close"
    else:
        verdict = "near"
    return {**out, "max_abs_diff": diff, "max_row_rel_err": rel,
            "tokens_equal": f"{same}/{total}", "finite": finite, "verdict": verdict}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["eager", "graphs"], required=True)
    p.add_argument("--out", type=Path, default=Path("bench/out/gpu_decode.json"))
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (the dry run)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--bandwidth-gbps", type=float, default=None, help="else measured here")
    p.add_argument("--batches", type=int, nargs="+", default=None)
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--prefill-len", type=int, default=None)
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per batch")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--check-steps", type=int, default=2,
                   help="untimed decode steps per batch after the timed ones; in graphs mode "
                        "each also runs eagerly on the same inputs (graph_vs_eager)")  # fmt: skip
    p.add_argument("--attention-backend", default=None,
                   help="else triton on CUDA, torch on a CPU")  # fmt: skip
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    out: dict[str, Any] = {
        "mode": args.mode, "device": args.device,
        "model": "tiny (2 layers)" if args.tiny else "llama-3-8b shape",
        "dtype": "bfloat16" if args.device == "cuda" else "float32",
        "rows": [], "first_tokens": {}, "step_tokens": {}, "errors": [],
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out["seconds"] = round(time.monotonic() - start, 1)
        args.out.write_text(json.dumps(out, indent=1))

    try:
        run(args, out, save)
    except Exception as e:
        traceback.print_exc()
        out["errors"].append(f"{type(e).__name__}: {e}"[:500])
    save()
    failed = out["errors"] or any(r.get("note", "").startswith("FAILED") for r in out["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
