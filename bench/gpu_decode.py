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
  warm up, the next ``--steps`` are timed; the context grows from 2,048 by that many tokens.
- one row at batch 64 with temperature 0.8 and top-p 0.95 (the sampler's other path);
- a 1,024-token prefill (one request, its whole prompt in one step).

Each decode row has its floor, (weight bytes + KV bytes read) / the copy bandwidth, where
the weights are every matrix the step reads (the embedding table is a lookup: not counted)
and the KV bytes those of the rows' contexts. The first decode step's sampled tokens and the
prefill's are kept, so that the two modes' outputs can be compared (same seed, same weights).

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
    config.worker.attention_backend = "triton" if device == "cuda" else "torch"
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


def capture_graphs(runner: Any, device: str) -> dict[str, Any]:
    """``capture_cuda_graphs()`` if the runner has it: its time and the memory it took."""
    capture = getattr(runner, "capture_cuda_graphs", None)
    if capture is None:
        return {"called": False, "note": "ModelRunner has no capture_cuda_graphs (not landed)"}
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
    start = time.monotonic()
    capture()
    if cuda:
        torch.cuda.synchronize()
    out: dict[str, Any] = {"called": True, "seconds": round(time.monotonic() - start, 2)}
    # What the runner keeps of them (the CUDA-graph change's DecodeGraphs), where it says
    out["runner_graphs"] = getattr(runner, "graphs", None) is not None
    if cuda:
        out["memory_gib"] = round((free_before - torch.cuda.mem_get_info()[0]) / GiB, 2)
    return out


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

    def __init__(self, runner: Any, device: str, bandwidth: float, out: dict[str, Any]) -> None:
        self.runner, self.device, self.bandwidth, self.out = runner, device, bandwidth, out
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
        times, seq_lens = [], []
        for k in range(warmup + steps):
            plan = plans.next(self.step_id)
            result, ms = self.execute(plan)
            if len(result.sampled_token_ids) != batch:
                raise RuntimeError(f"B={batch}: {len(result.sampled_token_ids)} tokens sampled")
            if k >= warmup:
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
    per_seq = math.ceil((context + warmup + steps + 2) / gcheck.BLOCK_SIZE)
    max_batch = max(batches)
    runner, arch, facts = build_runner(
        TINY if args.tiny else gcheck.LLAMA3_8B, device, eager=args.mode == "eager",
        max_batch=max_batch, max_model_len=per_seq * gcheck.BLOCK_SIZE,
        token_budget=max(2048 if device == "cuda" else 512, prefill_len, max_batch),
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
    # their K/V must hold numbers, not what a CPU's fresh allocation held (a GPU's is zeros).
    for k, v in runner.kv_caches:
        k.zero_()
        v.zero_()
    out["kv_cache_gib"] = round(num_blocks * runner.kv_cache_bytes_per_block() / GiB, 2)
    out["capture"] = capture_graphs(runner, device)
    print(f"[{args.mode}] capture: {out['capture']}", flush=True)
    save()
    bench = Bench(runner, device, bandwidth, out)
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
    save()
    del bench, runner
    gc.collect()


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
        "rows": [], "first_tokens": {}, "errors": [],
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
