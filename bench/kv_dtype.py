"""Issue 32's measurements: what ``--kv-cache-dtype`` costs in accuracy and buys in capacity
and speed, on the default model (a GGUF on CPU) with ``--dtype float32`` and ``bfloat16``.

    .venv/bin/python -m bench.kv_dtype accuracy [--dtypes float32 bfloat16] [--kv auto fp8 ...]
    .venv/bin/python -m bench.kv_dtype capacity [--kv-cache-memory-bytes 1GiB]
    .venv/bin/python -m bench.kv_dtype w1 [--kv-cache-memory-bytes 150MiB] [--rounds 2]
    .venv/bin/python -m bench.kv_dtype decode [--contexts 4096 8160] [--batches 1 8]

KV variants (``--kv``): ``auto`` (the model's dtype), ``fp8`` (e4m3, per-layer scales 1.0: the
GGUF carries none), ``fp8+scales`` (``--calculate-kv-scales``: measured on the first step),
``fp8_e5m2``, ``int8`` (a scale per token and KV head).

- ``accuracy``: per model dtype and KV variant, ``bench.perplexity``'s scoring (windows of
  ``--window`` tokens of GPL-3) with ``--max-num-batched-tokens`` ``--chunk`` (128): a window
  scored in one step attends over its own fresh K/V and never reads the cache, so each is
  split into chunks and every chunk after the first reads the earlier ones (and its own K/V)
  back from the cache; two control rows (first model dtype) score ``auto`` and ``fp8`` in
  whole windows (the same perplexity: nothing reads the cache there).
  Then greedy agreement with the same model dtype's ``auto``: ``bench.perplexity``'s short
  prompts (48 tokens each: decode reads the cache) and a long-prompt set (``long_prompts``:
  ``--long-prompts`` prompts of ``--long-len`` tokens cut from local texts, prefilled in the
  default 512-token chunks, ``--long-max-tokens`` greedy tokens each): the share of tokens
  generated before the first divergence, and where each prompt first diverges.
- ``capacity``: the start-up log's KV cache size and maximum concurrency lines (the offline
  engine logs them from the same code as the server) for each KV dtype at one
  ``--kv-cache-memory-bytes`` and ``--max-model-len``.
- ``w1``: ``bench.cpu_peers``' W1 (random 256-token prompts, 128 output tokens, 32 prompts at
  concurrency 16, greedy, ignore EOS) against a fresh ``actorserve serve`` per (KV dtype,
  round) at a KV budget small enough that ``auto`` preempts; rounds interleaved (A B C, C B A);
  ``vllm:num_preemptions_total`` from /metrics before and after, and the server's own
  start-up lines.
- ``decode``: whole ``ModelRunner.execute`` decode steps (inputs, the fused decode layers,
  LM head, greedy sampler) at long context: ``NewRequest`` with ``ctx`` of its ``ctx + 1``
  tokens computed, the cache filled with N(0, 1) K/V quantized as the cache stores it, then
  ``--steps`` timed steps per (batch, context); medians. KV bytes read per step beside.

``--tiny`` (every part, a few tokens, the tiny synthetic model where the part allows) is the
test's dry run. Writes ``bench/results/kv_dtype_<part>.json`` (and a PNG for ``decode``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
KV_VARIANTS: dict[str, dict[str, Any]] = {
    "auto": {},
    "fp8": {"kv_cache_dtype": "fp8"},
    "fp8+scales": {"kv_cache_dtype": "fp8", "calculate_kv_scales": True},
    "fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
    "int8": {"kv_cache_dtype": "int8"},
}
CAPACITY_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
# bench.perplexity's configurations for each model dtype: the default GGUF's blocks, fp32 or
# bf16 activations (and KV cache under auto).
MODEL_CONFIGS = {"float32": "gguf", "bfloat16": "bf16"}
# The long-prompt set's sources: texts Debian ships and this repository's docs, and the token
# offsets prompts are cut at (so the set is the same run after run on one machine).
LONG_SOURCES = (
    ("/usr/share/common-licenses/GPL-3", 0),
    ("/usr/share/common-licenses/GPL-3", 4096),
    ("/usr/share/common-licenses/LGPL-2.1", 0),
    ("/usr/share/common-licenses/GFDL-1.3", 0),
    ("/usr/share/common-licenses/MPL-2.0", 0),
    ("/usr/share/common-licenses/GPL-2", 0),
    ("docs/ARCHITECTURE.md", 0),
    ("docs/ARCHITECTURE.md", 3072),
)


def _load(args: argparse.Namespace) -> dict[str, Any]:
    """``--load-format`` for the engine, when given (the test's dummy-weight tiny model)."""
    return {"load_format": args.load_format} if args.load_format else {}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _write(name: str, payload: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": _cpu_name(), "nproc": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": _commit()}  # fmt: skip
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({**meta, **payload}, indent=1) + "\n")
    _log(f"wrote {path}")
    return path


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))  # noqa: E741
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _commit() -> str:
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                         text=True)  # fmt: skip
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return run.stdout.strip() + ("+uncommitted" if dirty else "")


# ------------------------------------------------------------------------------- accuracy


def divergence(ref: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """Greedy agreement with the reference: per sequence the first position that differs
    (None: identical), the share of sequences identical, and the share of all generated
    tokens produced before the first divergence."""
    first: list[int | None] = []
    prefix = 0
    for a, b in zip(ref, other, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if n is None and len(a) != len(b):
            n = min(len(a), len(b))
        first.append(n)
        prefix += len(a) if n is None else n
    total = sum(len(a) for a in ref)
    return {
        "identical": sum(n is None for n in first) / len(ref),
        "tokens_before_divergence": prefix / total if total else 1.0,
        "first_divergence": first,
    }


def long_prompts(tokenizer: Any, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids, cut from ``LONG_SOURCES`` (a source too
    short for its offset gives its last ``length`` tokens)."""
    prompts = []
    for source, offset in LONG_SOURCES[:count]:
        path = Path(source) if Path(source).is_absolute() else REPO / source
        if not path.exists():
            path = REPO / "README.md"
        ids = tokenizer.encode(path.read_text(encoding="utf-8"))
        start = max(0, min(offset, len(ids) - length))
        prompts.append(ids[start : start + length])
    return prompts


def run_accuracy(args: argparse.Namespace) -> dict[str, Any]:
    from bench import perplexity
    from launch.llm import LLM, SamplingParams

    text = (perplexity.DEFAULT_TEXT if perplexity.DEFAULT_TEXT.exists()
            else REPO / "README.md").read_text(encoding="utf-8")  # fmt: skip
    pargs = argparse.Namespace(model=args.model, window=args.window, max_windows=args.max_windows,
                               prompts=args.prompts, max_tokens=args.max_tokens)  # fmt: skip
    rows: list[dict[str, Any]] = []
    for dtype in args.dtypes:
        # a dummy-weight model has no GGUF blocks: its dense fp32 / bf16 configurations
        dense = {"float32": "fp32", "bfloat16": "bf16-dense"}
        config = dense[dtype] if args.load_format == "dummy" else MODEL_CONFIGS[dtype]
        for kv in args.kv:
            chunked = {**KV_VARIANTS[kv], "max_num_batched_tokens": args.chunk, **_load(args)}
            _log(f"{dtype} kv={kv}: perplexity, {args.chunk}-token chunks")
            start = time.perf_counter()
            row = perplexity.run_config(config, pargs, text, chunked)
            row.update(model_dtype=dtype, kv=kv, chunk=args.chunk)
            row["short_greedy"] = row.pop("greedy")
            if args.long_prompts:
                _log(f"{dtype} kv={kv}: {args.long_prompts} long prompts of {args.long_len}")
                llm = LLM(args.model, max_model_len=args.long_len + args.long_max_tokens,
                          enable_prefix_caching=False, **perplexity.CONFIGS[config],
                          **KV_VARIANTS[kv], **_load(args))  # fmt: skip
                prompts = long_prompts(llm.tokenizer, args.long_prompts, args.long_len)
                params = SamplingParams(temperature=0, max_tokens=args.long_max_tokens,
                                        ignore_eos=True)  # fmt: skip
                row["long_greedy"] = [list(o.outputs[0].token_ids)
                                      for o in llm.generate(prompts, params)]  # fmt: skip
                row["long_prompt_lens"] = [len(p) for p in prompts]
                llm.close()
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            _log(f"  perplexity {row['perplexity']:.4f} ({row['seconds']:.0f} s)")
        if args.control and dtype == args.dtypes[0]:
            for kv in ("auto", "fp8"):
                _log(f"{dtype} kv={kv}, whole windows (control: the cache is never read)")
                row = perplexity.run_config(config, pargs, text, {**KV_VARIANTS[kv], **_load(args)})
                row.update(model_dtype=dtype, kv=f"{kv} (whole windows)", chunk=None, control=True)
                row["short_greedy"] = row.pop("greedy")
                rows.append(row)
    for row in rows:
        ref_kv = "auto (whole windows)" if row.get("control") else "auto"
        ref = next(r for r in rows if r["model_dtype"] == row["model_dtype"] and r["kv"] == ref_kv)
        row["delta_nll"] = row["mean_nll"] - ref["mean_nll"]
        row["ppl_ratio"] = row["perplexity"] / ref["perplexity"]
        row["short_agreement"] = divergence(ref["short_greedy"], row["short_greedy"])
        if "long_greedy" in row and "long_greedy" in ref:
            row["long_agreement"] = divergence(ref["long_greedy"], row["long_greedy"])
    print(accuracy_table(rows, args))
    return {"part": "accuracy", "window": args.window, "max_windows": args.max_windows,
            "chunk": args.chunk, "short_max_tokens": args.max_tokens,
            "long_len": args.long_len, "long_max_tokens": args.long_max_tokens,
            "long_sources": LONG_SOURCES[: args.long_prompts], "rows": rows}  # fmt: skip


def accuracy_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = ["| model dtype | KV | perplexity | vs auto | short greedy: identical, tokens before "
             "1st divergence | long greedy: identical, tokens before 1st divergence, "
             "first divergences |", "|---|---|---:|---:|---|---|"]  # fmt: skip
    for r in rows:
        s = r["short_agreement"]
        cells = [r["model_dtype"], r["kv"], f"{r['perplexity']:.4f}",
                 f"{100 * (r['ppl_ratio'] - 1):+.2f} %",
                 f"{s['identical']:.0%}, {s['tokens_before_divergence']:.0%}"]  # fmt: skip
        la = r.get("long_agreement")
        cells.append(
            f"{la['identical']:.0%}, {la['tokens_before_divergence']:.0%}, {la['first_divergence']}"
            if la
            else "-"
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- capacity


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith(("KV cache size", "Maximum concurrency")):
            self.lines.append(msg)


def run_capacity(args: argparse.Namespace) -> dict[str, Any]:
    from launch.llm import LLM

    rows = []
    for dtype in args.dtypes:
        for kv in CAPACITY_DTYPES:
            capture = _Capture()
            logging.getLogger("services").addHandler(capture)
            try:
                extra = {} if kv == "auto" else {"kv_cache_dtype": kv}
                llm = LLM(args.model, dtype=dtype, max_model_len=args.max_model_len,
                          kv_cache_memory_bytes=args.kv_cache_memory_bytes, **extra,
                          **_load(args))  # fmt: skip
                executor = llm.core.executor
                block_bytes = executor.kv_block_bytes  # type: ignore[attr-defined]
                num_blocks = executor.num_blocks  # type: ignore[attr-defined]
                llm.close()
            finally:
                logging.getLogger("services").removeHandler(capture)
            tokens = next(l for l in capture.lines if l.startswith("KV cache size"))  # noqa: E741
            conc = next(l for l in capture.lines if l.startswith("Maximum concurrency"))  # noqa: E741
            rows.append({"model_dtype": dtype, "kv": kv, "num_blocks": num_blocks,
                         "bytes_per_block": block_bytes, "kv_cache_size_line": tokens,
                         "max_concurrency_line": conc,
                         "max_concurrency": float(conc.rsplit(" ", 1)[1].rstrip("x"))})  # fmt: skip
            _log(f"{dtype} {kv}: {block_bytes} B/block, {tokens}; {conc}")
    return {"part": "capacity", "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
            "max_model_len": args.max_model_len, "rows": rows}  # fmt: skip


# ------------------------------------------------------------------------------------- W1


def run_w1(args: argparse.Namespace) -> dict[str, Any]:
    from bench.cpu_peers import COMMON, WORKLOADS, tree_rss_mb
    from bench.procs import _Process, free_port

    kvs = args.w1_kv
    order: list[str] = []
    for r in range(args.rounds):
        order += kvs if r % 2 == 0 else kvs[::-1]
    workload = ["--num-prompts", "4", "--max-concurrency", "4", "--seed", "0",
                "--random-input-len", "32", "--random-output-len", "8"] if args.tiny \
        else WORKLOADS["W1"]  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, kv in enumerate(order):
            cmd = [sys.executable, "-m", "launch.cli", "serve", "--port", str(free_port()),
                   "--max-model-len", str(args.max_model_len), "--served-model-name", "smol",
                   "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]  # fmt: skip
            if args.model:
                cmd += ["--model", args.model]
            if args.load_format:
                cmd += ["--load-format", args.load_format]
            if kv != "auto":
                cmd += ["--kv-cache-dtype", kv]
            cmd += shlex.split(args.server_args)
            _log(f"W1 {kv} (run {i + 1}/{len(order)})")
            proc = _Process(cmd, name=f"kv-{kv}")
            try:
                proc.wait_ready(300)
                time.sleep(2)
                memory = tree_rss_mb(proc.popen.pid)
                before = proc.metrics()
                name = f"w1-{i}-{kv}.json"
                bench = [sys.executable, "-m", "launch.cli", "bench", "--base-url", proc.url,
                         *COMMON, *workload, "--result-dir", tmp, "--result-filename", name]  # fmt: skip
                run = subprocess.run(bench, cwd=REPO, capture_output=True, text=True)
                if run.returncode:
                    raise RuntimeError(f"bench against kv={kv} failed: {run.stderr[-2000:]}")
                after = proc.metrics()
                log = Path(proc.log.name).read_text()
            finally:
                proc.close()
            result = json.loads((Path(tmp) / name).read_text())
            startup = [line.split("] ", 1)[-1] for line in log.splitlines()
                       if "KV cache size" in line or "Maximum concurrency" in line]  # fmt: skip

            def delta(metric: str, before=before, after=after) -> float | None:
                return after[metric] - before.get(metric, 0.0) if metric in after else None

            rows.append({
                "kv": kv, "run": i, **memory, "startup": startup,
                "completed": result["completed"], "output_throughput": result["output_throughput"],
                "median_ttft_ms": result["median_ttft_ms"], "median_tpot_ms": result["median_tpot_ms"],
                "p99_itl_ms": result.get("p99_itl_ms"), "duration_s": result.get("duration"),
                "preemptions": delta("vllm:num_preemptions_total"),
                "prompt_tokens_computed": delta("vllm:prompt_tokens_total"),
            })  # fmt: skip
            r = rows[-1]
            _log(f"  {r['output_throughput']:.1f} tok/s, TTFT p50 {r['median_ttft_ms']:.0f} ms, "
                 f"TPOT p50 {r['median_tpot_ms']:.1f} ms, preemptions {r['preemptions']}; "
                 f"{'; '.join(startup)}")  # fmt: skip
    return {"part": "w1", "workload": [*COMMON, *workload], "server_args": args.server_args,
            "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
            "max_model_len": args.max_model_len, "order": order, "rows": rows}  # fmt: skip


# --------------------------------------------------------------------------------- decode


def fill_quantized(runner: Any, num_blocks: int, seed: int = 1234) -> str:
    """Blocks [0, num_blocks) of every layer: N(0, 1) K/V written as the cache stores them
    (an fp8 cache at the layer's scale, 1.0 here; int8 with each row's scale)."""
    import torch

    from actorserve_kernels import kv_quant

    gen = torch.Generator().manual_seed(seed)
    one = torch.ones(1)
    for key_cache, value_cache in runner.kv_caches:
        for cache in (key_cache, value_cache):
            _, bs, heads, _ = cache.shape
            for b in range(0, num_blocks, 256):  # in slices: no 8k-token float temporary
                n = min(256, num_blocks - b)
                x = torch.randn(n, bs, heads, runner.arch.head_dim, generator=gen)
                rows = kv_quant.quantize(x, cache.dtype, one)
                kv_quant.as_bytes(cache[b : b + n]).copy_(kv_quant.as_bytes(rows))
    return f"normal(0, 1), seed {seed}, stored as {runner.kv_cache_dtype}"


def time_decode(runner: Any, batch: int, ctx: int, steps: int, warmup: int) -> dict[str, Any]:
    """Median seconds of ``execute`` decode steps of ``batch`` requests at context ``ctx``."""
    import numpy as np

    from services.protocol import NewRequest, RunningRequestDelta, SamplingParams, StepPlan

    bs = runner.block_size
    per_req = -(-(ctx + 1 + warmup + steps + 1) // bs)
    greedy = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 2, ignore_eos=True)
    rng = np.random.default_rng(0)
    ids = [f"b{batch}c{ctx}r{i}" for i in range(batch)]
    new = [NewRequest(r, rng.integers(0, runner.arch.vocab_size, ctx + 1).tolist(), ctx + 1,
                      greedy, list(range(i * per_req, (i + 1) * per_req)), ctx)
           for i, r in enumerate(ids)]  # fmt: skip
    step_id = 0
    times, cpu = [], []
    for k in range(warmup + steps + 1):
        plan = (StepPlan(step_id, new_requests=new, num_scheduled_tokens=[1] * batch) if k == 0
                else StepPlan(step_id, running=[RunningRequestDelta(r, [], ctx + k) for r in ids],
                              num_scheduled_tokens=[1] * batch))  # fmt: skip
        t0, c0 = time.perf_counter(), time.process_time()
        runner.execute(plan)
        if k > warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        step_id += 1
    runner.execute(StepPlan(step_id, finished_req_ids=ids))
    # process CPU time beside wall time: on a shared machine it is the steadier of the two
    # with one thread (it still grows when others load the memory bus)
    return {"step_ms": float(np.median(times)) * 1e3, "min_ms": float(np.min(times)) * 1e3,
            "cpu_ms": float(np.median(cpu)) * 1e3, "steps": len(times)}  # fmt: skip


def run_decode(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from services.config import EngineConfig, ModelArchConfig
    from services.gpu_worker.model_runner import ModelRunner
    from services.model_loader import load_hf_config, prepare_model

    folder = prepare_model(args.model, args.load_format or "auto")
    arch = ModelArchConfig.from_hf_config(load_hf_config(folder))
    rows = []
    for dtype in args.dtypes:
        for kv in args.decode_kv:
            extra = {} if kv == "auto" else {"kv_cache_dtype": kv}
            config = EngineConfig.from_kwargs(dtype=dtype, **extra, **_load(args))
            config.finalize(arch)  # max_model_len: the model's (8,192 for the default)
            span = max(args.contexts) + args.steps + args.warmup + 2
            if span > config.scheduler.resolved_max_model_len:
                raise SystemExit(f"--contexts: {span} tokens is past the model's length")
            runner = ModelRunner(config, folder)
            bs = runner.block_size
            blocks = max(args.batches) * -(-span // bs)
            runner.initialize_kv_cache(blocks)
            how = fill_quantized(runner, blocks)
            row_bytes = runner.kv_cache_bytes_per_block() / bs  # all layers, K and V
            for ctx in args.contexts:
                for batch in args.batches:
                    t = time_decode(runner, batch, ctx, args.steps, args.warmup)
                    kv_mb = batch * ctx * row_bytes / 1e6
                    rows.append({"model_dtype": dtype, "kv": kv, "batch": batch, "context": ctx,
                                 **t, "kv_mb_read": kv_mb,
                                 "kv_gb_s": kv_mb / t["step_ms"], "fill": how})  # fmt: skip
                    _log(f"{dtype} kv={kv} batch {batch} ctx {ctx}: {t['step_ms']:.2f} ms/step "
                         f"(min {t['min_ms']:.2f}, CPU {t['cpu_ms']:.2f}), KV {kv_mb:.0f} MB")  # fmt: skip
            del runner
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"part": "decode", "threads": torch.get_num_threads(), "steps": args.steps,
            "warmup": args.warmup, "rows": rows}  # fmt: skip


def plot_decode(payload: dict[str, Any], path: Path) -> None:
    from bench.plots import _pyplot

    plt = _pyplot()
    rows = payload["rows"]
    # one thread: the process's CPU time per step (steady on a shared machine); else wall time
    key, what = ("cpu_ms", "CPU ms") if payload["threads"] == 1 else ("step_ms", "ms")
    dtypes = list(dict.fromkeys(r["model_dtype"] for r in rows))
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    fig, axes = plt.subplots(1, len(dtypes) * len(batches), figsize=(4.2 * len(dtypes) * len(batches), 3.8),
                             squeeze=False)  # fmt: skip
    for ax, (dtype, batch) in zip(axes[0], [(d, b) for d in dtypes for b in batches], strict=True):
        sel = [r for r in rows if r["model_dtype"] == dtype and r["batch"] == batch]
        kvs = list(dict.fromkeys(r["kv"] for r in sel))
        ctxs = list(dict.fromkeys(r["context"] for r in sel))
        width = 0.8 / len(kvs)
        for j, kv in enumerate(kvs):
            ys = [next(r[key] for r in sel if r["kv"] == kv and r["context"] == c) for c in ctxs]
            ax.bar([i + j * width for i in range(len(ctxs))], ys, width, label=kv)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(ctxs))], [f"ctx {c}" for c in ctxs])
        ax.set_title(f"--dtype {dtype}, batch {batch}: {what} per decode step", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["accuracy", "capacity", "w1", "decode"])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--load-format", default=None, help="e.g. dummy (the test's tiny model)")
    parser.add_argument("--dtypes", nargs="+", default=list(MODEL_CONFIGS),
                        choices=list(MODEL_CONFIGS))  # fmt: skip
    parser.add_argument("--kv", nargs="+", default=list(KV_VARIANTS), choices=list(KV_VARIANTS))
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=128, help="--max-num-batched-tokens scoring")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--long-prompts", type=int, default=8)
    parser.add_argument("--long-len", type=int, default=1536)
    parser.add_argument("--long-max-tokens", type=int, default=48)
    parser.add_argument("--no-control", dest="control", action="store_false")
    parser.add_argument("--kv-cache-memory-bytes", default=None)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--w1-kv", nargs="+", default=["auto", "fp8", "int8"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--server-args", default="", help="more serve flags (w1), one string")
    parser.add_argument("--decode-kv", nargs="+", default=["auto", "fp8", "fp8_e5m2", "int8"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8160])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a few tokens of each (the test)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--name", default=None, help="result file name (default kv_dtype_<part>)")
    args = parser.parse_args(argv)
    from services.flags import parse_size

    if args.kv_cache_memory_bytes is None:
        args.kv_cache_memory_bytes = {"capacity": "1GiB", "w1": "150MiB"}.get(args.part, "1GiB")
    args.kv_cache_memory_bytes = parse_size(str(args.kv_cache_memory_bytes))
    if args.tiny:
        args.window, args.max_windows, args.chunk, args.prompts = 64, 2, 16, 2
        args.max_tokens, args.long_prompts, args.long_len, args.long_max_tokens = 4, 2, 96, 4
        args.contexts, args.batches, args.steps, args.warmup = [48], [1, 2], 2, 1
        args.rounds, args.max_model_len = 1, 256
    part = {"accuracy": run_accuracy, "capacity": run_capacity, "w1": run_w1,
            "decode": run_decode}[args.part]  # fmt: skip
    payload = part(args)
    path = _write(args.name or f"kv_dtype_{args.part}", payload, args.out_dir)
    if args.part == "decode":
        plot_decode(payload, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
