"""GPU check: the Triton kernels on CUDA, the model runner's step and the whole server.

For a machine with an NVIDIA GPU (``make gpu-check``); the whole run fits in ~8 minutes.

1. The kernel tests compiled for CUDA, slow ones included (one pytest subprocess, at most
   ``--tests-timeout-s``, 120 s; a failure or a timeout there is reported and the rest
   still runs): ``tests/test_cuda_graphs.py`` (captured graphs against eager steps),
   ``test_fused_kernels.py``, ``test_kv_quant_kernels.py`` and ``test_kernels.py``, in
   that order; on pytest-xdist's workers where it is installed (compiling in parallel),
   each test at most 90 s where pytest-timeout is.
2. Copy bandwidth: a device-to-device copy, (read + written bytes) / time; every floor
   below divides by it.
3. Attention at Llama-3-8B's heads (32 q, 8 kv, head_dim 128), bf16, block size 16:
   decode (batch 64 and 256, context 2048) and prefill, ours against torch's
   ``scaled_dot_product_attention`` (flash backend; same data, contiguous) and against the
   floor K/V bytes / bandwidth.
4. The model runner's real step, ``ModelRunner.execute(plan)`` over synthetic step plans,
   on a Llama-3-8B-shaped model with random weights (``bench/gpu_decode.py``, one process
   per mode): decode at batch 1, 16, 64 and 256, context 2048 (random K/V), with CUDA
   graphs and then eager (graphs first: issue 31's numbers; the eager run gets what is left),
   against (weight bytes + KV bytes) / bandwidth; a 1,024-token prefill. In the graphs
   process each batch's last steps also run eagerly on the same inputs (``graph_vs_eager``:
   hidden rows and tokens); the two processes' greedy tokens are compared at every step.
5. NCCL with one rank (the lent machine has one GPU): the process group forms over TCP on
   loopback as ``init_distributed`` forms it, and all-reduce and all-gather on CUDA
   tensors give the right values (the code path of TP; the scaling is not measurable here).
6. The whole server on that model (``bench/gpu_serve.py``): ``actorserve serve
   --load-format dummy``, then ``actorserve bench`` 1,024 in / 256 out at concurrency 1, 256
   and 64: throughput, TTFT, TPOT, and the engine's share of a step from the worker's step
   timeline, beside what part 4's step times allow. Then issue 31's goals, met or not.

Before any of it, every module these parts use is imported (so that a missing package shows
up at once, also on a machine without a GPU) and the third-party distributions that loaded
are listed. A lent GPU machine runs it with its own torch and triton through
``bench/gpu_check_device.sh``, which brings the packages it lacks as wheels.

``--dry-run`` runs parts 4 and 6 on the CPU with a 2-layer model (no GPU, a few minutes):
the imports, the plans, the server with its synthetic tokenizer, the client, the JSON.

A reduced rerun (when the full one ran out of device time): ``--skip-tests --skip-serve``
(bandwidth, attention, both runner processes, NCCL: ~3 minutes), with ``--skip-attention``
and ``--decode-modes graphs`` for the graphs process alone (~1.5 minutes).

Kernel times are medians over many runs after warm-up, from CUDA events; runner steps are
host wall time around ``execute()`` (which ends with the sampled ids on the host). Prints
tables and writes the results as JSON (``--out``), after each part, so that a part that
fails, a timeout (SIGTERM) or Ctrl-C still leaves the tables and JSON of what ran. Exit
status: 0 if the tests passed and every part ran, 1 if not, 2 without a GPU (after the
imports; not with ``--dry-run``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
}
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, CONTEXT = 32, 8, 128, 16, 2048
DTYPE = torch.bfloat16
DEVICE = "cuda"  # a name, so that a dry run of the logic on the CPU can swap it
GiB = 1 << 30


def cuda_time_ms(fn: Callable[[], Any], warmup: int = 5, iters: int = 30) -> float:
    """Median wall time of ``fn`` on the GPU, in ms, from CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def row(
    case: str, ours: float | None, ref: float | None, floor: float | None, note: str = ""
) -> dict:
    return {"case": case, "ours_ms": ours, "ref_ms": ref, "floor_ms": floor, "note": note}


# ---------------------------------------------------------------- 0. imports

# Every module that the parts below import, here or in the pytest subprocess: a package that
# is missing (a lent GPU machine's image has no msgspec or gguf, say) shows up at once.
# Parts 4 and 6 start processes: the server's (launch.child ROLE: each role's module below) and
# the bench client's; importing their modules here finds a missing package in the first
# seconds instead of minutes later in a child's log.
MODULES = (
    "triton", "numpy", "pytest", "actorserve_kernels", "actorserve_kernels.attention", "actorserve_kernels.kv_cache",
    "services.config", "services.model_loader.weights", "services.gpu_worker.model_runner",
    "services.gpu_worker.attention.torch_backend", "services.gpu_worker.model.llama",
    "tests.conftest", "tests.test_kernels", "tests.test_cuda_graphs", "tests.test_fused_kernels",
    "tests.test_kv_quant_kernels", "tests.test_fused_moe_triton", "actorserve_kernels.moe",
    "actorserve_kernels.fused_moe_triton", "bench.gpu_decode", "bench.gpu_serve",
    "launch.cli", "launch.serve", "launch.child", "services.gpu_worker.worker",
    "services.scheduler.service", "services.tokenizer.service", "services.detokenizer.service",
    "services.api_server.process", "zmq", "uvicorn", "httptools", "uvloop", "bench.serve",
    "bench.client", "bench.metrics", "prometheus_client.parser",
)  # fmt: skip
OURS = {"services", "actorserve_kernels", "launch", "bench", "tests"}


def check_imports() -> dict[str, str]:
    """Imports ``MODULES``: {module: "ok" or the error}."""
    status = {}
    for name in MODULES:
        try:
            importlib.import_module(name)
            status[name] = "ok"
        except Exception as e:  # ImportError, or whatever a module raises as it loads
            status[name] = f"{type(e).__name__}: {e}"
    return status


def loaded_packages() -> dict[str, str]:
    """{distribution: "version (folder)"} of the third-party packages imported so far."""
    by_module = importlib.metadata.packages_distributions()
    found: dict[str, str] = {}
    for top in sorted({name.split(".")[0] for name in list(sys.modules)}):
        if top in sys.stdlib_module_names or top in OURS:
            continue
        module = sys.modules.get(top)
        where: Any = getattr(module, "__file__", None) or "?"
        if where != "?":  # the folder it was imported from (site-packages, /tmp/site...)
            where = Path(where).parent
            where = where.parent if hasattr(module, "__path__") else where
        for dist in by_module.get(top, []):
            if dist != "actorserve" and dist not in found:
                found[dist] = f"{importlib.metadata.version(dist)} ({where})"
    return dict(sorted(found.items(), key=lambda kv: kv[0].lower()))


def git_commit() -> str | None:
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() or None


# ---------------------------------------------------------------- 1. tests


# In this order: what issue 31 changed first; test_kernels (67 s on the H200) last.
TEST_FILES = ("tests/test_cuda_graphs.py", "tests/test_fused_kernels.py",
              "tests/test_kv_quant_kernels.py", "tests/test_fused_moe_triton.py",
              "tests/test_kernels.py")  # fmt: skip


def tests_command(files: tuple[str, ...] = TEST_FILES, workers: int = 4) -> list[str]:
    """pytest over ``files``, slow tests included; on ``workers`` pytest-xdist processes
    where it is installed (Triton compiles on the CPU: in parallel), each test at most 90 s
    where pytest-timeout is."""
    import importlib.util

    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
           "-m", "slow or not slow"]  # fmt: skip
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(workers)]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", "90"]
    return cmd + list(files)


def run_tests(timeout_s: float, cmd: list[str] | None = None) -> dict:
    """The kernel tests in a subprocess, at most ``timeout_s`` (then SIGINT, so that pytest
    prints what ran, and SIGKILL 15 s later). Returns {passed, returncode, seconds,
    summary, failed, timed_out}: a failure does not stop the check."""
    import collections
    import threading

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = cmd or tests_command()
    print(f"$ {' '.join(cmd[2:])}  (at most {timeout_s:.0f} s)", flush=True)
    start = time.monotonic()
    tail: collections.deque[str] = collections.deque(maxlen=400)
    # (SIGINT as by default in pytest even where this runs with it ignored, as a job that
    # a shell started in the background does: else pytest ignores it too, says nothing)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            tail.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            print(f"kernel tests not done in {timeout_s:.0f} s: interrupted", flush=True)
            _signal_group(proc, signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            rc = -1
    finally:  # Terminated or Ctrl-C here: no test process outlives the check
        if proc.poll() is None:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=5)
    lines = list(tail)
    summary = next((x.strip("= ") for x in reversed(lines)
                    if " in " in x and any(w in x for w in ("passed", "failed", "error"))),
                   None)  # fmt: skip
    failed = [x for x in lines if x.startswith(("FAILED ", "ERROR "))][:50]
    return {"returncode": rc, "passed": rc == 0, "seconds": round(time.monotonic() - start, 1),
            "timed_out": timed_out, "summary": summary, "failed": failed,
            "files": [f for f in cmd if f.startswith("tests/")]}  # fmt: skip


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


# ---------------------------------------------------------------- 2. bandwidth


def copy_bandwidth(nbytes: int = 2 * GiB) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), warmup=3, iters=20)
    return 2 * nbytes / (ms * 1e-3)


# ---------------------------------------------------------------- 3. attention


def paged_inputs(batch: int, q_len: int, ctx: int) -> dict:
    """Random paged K/V of ``batch`` sequences of ``ctx`` tokens, the last ``q_len`` new."""
    blocks_per_seq = math.ceil(ctx / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    i32: dict[str, Any] = {"dtype": torch.int32, "device": DEVICE}
    return {
        "query": torch.randn(batch * q_len, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE),
        "key_cache": torch.randn(shape, dtype=DTYPE, device=DEVICE),
        "value_cache": torch.randn(shape, dtype=DTYPE, device=DEVICE),
        # Scattered pages, as after a while of serving.
        "block_table": torch.randperm(num_blocks, **i32).view(batch, -1),
        "query_start_loc": torch.arange(batch + 1, **i32) * q_len,
        "seq_lens": torch.full((batch,), ctx, **i32),
        "max_query_len": q_len,
        "max_seq_len": ctx,
    }


def sdpa_reference(inp: dict, batch: int, q_len: int, ctx: int) -> tuple[Callable, str]:
    """SDPA (flash) on the same data, laid out contiguously; returns (call, note)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        pages = cache[inp["block_table"].long()]  # [B, blocks, bs, kv, D]
        return (
            pages.reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :ctx].transpose(1, 2).contiguous()
        )

    q = inp["query"].view(batch, q_len, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    k, v = contiguous(inp["key_cache"]), contiguous(inp["value_cache"])
    causal = q_len > 1  # q_len == ctx for prefill here: top-left causal is right

    def call_gqa() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return sdpa(q, k, v, is_causal=causal, enable_gqa=True)

    try:
        call_gqa()
        return call_gqa, ""
    except RuntimeError:
        group = NUM_Q_HEADS // NUM_KV_HEADS
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

        def call_expanded() -> torch.Tensor:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return sdpa(q, k, v, is_causal=causal)

        return call_expanded, "sdpa flash has no GQA here: K/V expanded to 32 heads"


def attention_case(kind: str, batch: int, q_len: int, ctx: int, bandwidth: float) -> dict:
    from actorserve_kernels import num_kv_splits, paged_attention

    name = f"attn {kind} B={batch} q={q_len} ctx={ctx}"
    inp = paged_inputs(batch, q_len, ctx)
    out = torch.empty_like(inp["query"])
    ours = cuda_time_ms(lambda: paged_attention(**inp, out=out))
    ref_call, ref_note = sdpa_reference(inp, batch, q_len, ctx)
    ref = cuda_time_ms(ref_call)
    ref_out = ref_call().transpose(1, 2).reshape(out.shape)
    err = float((out.float() - ref_out.float()).norm() / ref_out.float().norm())
    notes = [f"ref: sdpa; rel err {err:.1e}" + (" (TOO HIGH)" if err > 2e-2 else "")]
    if kind == "prefill":
        flops = 4 * batch * NUM_Q_HEADS * HEAD_DIM * q_len * (q_len + 1) / 2
        notes.append(f"{flops / ours / 1e9:.0f} vs {flops / ref / 1e9:.0f} TFLOP/s")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = num_kv_splits(batch, NUM_KV_HEADS, q_len, ctx, num_sms)
    if splits > 1:  # what the split-KV heuristic buys here
        unsplit = cuda_time_ms(lambda: paged_attention(**inp, out=out, num_splits=1))
        notes.append(f"{splits} splits; unsplit {unsplit:.3f} ms")
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    note = "; ".join(n for n in [*notes, ref_note] if n)
    return row(name, ours, ref, kv_bytes / bandwidth * 1e3, note)


def quantized_attention_case(kv: str, batch: int, ctx: int, bandwidth: float) -> dict:
    """Decode attention over an fp8 or int8 KV cache (--kv-cache-dtype; the same values as
    the bf16 case, quantized): ours against ours on the bf16 cache, and the floor of the
    quantized cache's bytes."""
    from actorserve_kernels import kv_quant, paged_attention

    name = f"attn decode {kv} KV B={batch} ctx={ctx}"
    inp = paged_inputs(batch, 1, ctx)
    out = torch.empty_like(inp["query"])
    plain = cuda_time_ms(lambda: paged_attention(**inp, out=out))
    ref_out = out.clone()
    storage = kv_quant.storage_dtype(kv, DTYPE)
    scales = {"k_scale": torch.tensor([0.02], device=DEVICE),
              "v_scale": torch.tensor([0.02], device=DEVICE)}  # fmt: skip
    quant = dict(inp)
    for name_ in ("key_cache", "value_cache"):
        quant[name_] = kv_quant.quantize(inp[name_], storage, scales["k_scale"])
    ours = cuda_time_ms(lambda: paged_attention(**quant, out=out, **scales))
    err = float((out.float() - ref_out.float()).norm() / ref_out.float().norm())
    row_bytes = kv_quant.row_bytes(kv, HEAD_DIM, DTYPE)
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * row_bytes
    note = f"ref: ours on the bf16 cache; rel err vs it {err:.1e} (quantization)"
    return row(name, ours, plain, kv_bytes / bandwidth * 1e3, note)


# Qwen3-30B-A3B's MoE layer: hidden 2048, 128 experts of width 768, top-8.
MOE_SHAPE = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}


def moe_case(tokens: int, bandwidth: float) -> dict:
    """One MoE layer through the Triton fused-MoE kernel (issue 33) against the torch
    reference (expert by expert); the floor reads the weights of the experts the tokens hit."""
    from actorserve_kernels.fused_moe_triton import fused_moe
    from actorserve_kernels.moe import fused_experts_ref

    h, i, e, k = (MOE_SHAPE[n] for n in ("hidden", "inter", "experts", "top_k"))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(tokens, h, device=DEVICE, dtype=DTYPE, generator=gen)
    w13 = torch.randn(e, 2 * i, h, device=DEVICE, dtype=DTYPE, generator=gen) * 0.02
    w2 = torch.randn(e, h, i, device=DEVICE, dtype=DTYPE, generator=gen) * 0.02
    logits = torch.randn(tokens, e, device=DEVICE, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    ours = cuda_time_ms(lambda: fused_moe(x, w13, w2, weights, ids))
    ref = cuda_time_ms(lambda: fused_experts_ref(x, w13, w2, weights, ids), warmup=2, iters=5)
    got, want = (
        fused_moe(x, w13, w2, weights, ids).float(),
        fused_experts_ref(x, w13, w2, weights, ids).float(),
    )
    err = float((got - want).norm() / want.norm())
    hit = int(torch.unique(ids).numel())
    floor = hit * 3 * h * i * DTYPE.itemsize / bandwidth * 1e3
    note = f"ref: torch expert by expert; {hit} experts hit; rel err {err:.1e}"
    return row(f"fused MoE T={tokens} (qwen3-30b-a3b layer)", ours, ref, floor, note)


def bench_attention(bandwidth: float, deadline: float, rows: list[dict]) -> None:
    """Appends one row per case to ``rows`` (as it goes: an interrupt keeps the ones done)."""
    cases = [("decode", 64, 1, CONTEXT), ("decode", 256, 1, CONTEXT), ("decode", 4, 1, 16384),
             ("prefill", 1, 4096, 4096), ("prefill", 8, 1024, 1024)]  # fmt: skip
    quantized = [(kv, batch) for kv in ("fp8", "int8") for batch in (64, 256)]
    for kind, batch, q_len, ctx in cases + [(kv, b, 1, CONTEXT) for kv, b in quantized]:
        name = f"attn {kind} B={batch} q={q_len} ctx={ctx}"
        if time.monotonic() > deadline:
            rows.append(row(name, None, None, None, "skipped: out of time"))
            continue
        try:
            if kind in ("fp8", "int8"):
                rows.append(quantized_attention_case(kind, batch, ctx, bandwidth))
            else:
                rows.append(attention_case(kind, batch, q_len, ctx, bandwidth))
        except Exception as e:  # one failing case must not hide the others
            rows.append(row(name, None, None, None, f"FAILED: {type(e).__name__}: {e}"[:200]))
        torch.cuda.empty_cache()
    for tokens in (1, 64, 1024):
        if time.monotonic() > deadline:
            break
        try:
            rows.append(moe_case(tokens, bandwidth))
        except Exception as e:
            rows.append(row(f"fused MoE T={tokens}", None, None, None,
                            f"FAILED: {type(e).__name__}: {e}"[:200]))  # fmt: skip
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- 4. the runner's step


GRAPHS_MIN_S = 150  # the graphs process's time, taken from the server's reserve if need be


def bench_decode(
    args: argparse.Namespace, bandwidth: float, deadline: float, results: dict,
    save: Callable[[], None],
) -> None:  # fmt: skip
    """``bench/gpu_decode.py`` once per mode (CUDA graphs, then eager: the graphs' numbers
    are what issue 31 is about, so the deadline cannot starve them), each in its own process
    (a CUDA error or memory held in one cannot spoil the other or what follows); their JSON
    goes to ``results["decode"][mode]``, a table row per step."""
    decode, rows = results.setdefault("decode", {}), results["rows"]
    caps, skipped = {"graphs": 210, "eager": 150}, []
    others = [r for r in rows if not r["case"].startswith("runner ")]
    for mode in [m for m in ("graphs", "eager") if m in args.decode_modes]:
        cap_s = caps[mode]
        # What the server part needs (bench/gpu_serve.py: start-up ~100 s, runs ~60-150 s);
        # the graphs process may take up to GRAPHS_MIN_S of it (late tests, slow attention).
        remaining = deadline - time.monotonic()
        left = remaining - (0 if args.skip_serve else args.serve_reserve_s)
        if mode == "graphs":
            left = max(left, min(GRAPHS_MIN_S, remaining))
        if left < 30:
            skipped.append(row(f"runner {mode}", None, None, None, "skipped: out of time"))
            rows[:] = others + decode_rows(decode) + skipped
            save()
            continue
        path = args.out.with_name(f"{args.out.stem}_decode_{mode}.json")
        path.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "bench.gpu_decode", "--mode", mode, "--out", str(path),
               "--bandwidth-gbps", f"{bandwidth / 1e9:.1f}"] + (["--tiny"] if args.dry_run else [])  # fmt: skip
        print(f"$ {' '.join(cmd[2:])}", flush=True)
        try:
            rc = subprocess.run(cmd, cwd=REPO, timeout=min(cap_s, left)).returncode
        except subprocess.TimeoutExpired:
            rc = None
        result = json.loads(path.read_text()) if path.exists() else {"rows": [], "errors": []}
        if rc is None:
            result["errors"].append(f"not done in {min(cap_s, left):.0f} s: killed")
        elif rc and not result["errors"]:
            result["errors"].append(f"exit status {rc}")
        decode[mode] = result
        # Graphs run first: their rows' reference (eager's step) is filled in once eager ran.
        rows[:] = others + decode_rows(decode) + skipped
        if "graphs" in decode and "eager" in decode:
            results["decode_agreement"] = agreement(decode["eager"], decode["graphs"])
        elif "graphs" in decode:
            results["decode_agreement"] = {"graph_vs_eager": _gve_summary(decode["graphs"])}
        save()


def decode_rows(decode: dict) -> list[dict]:
    """Table rows of the runner's steps, graphs then eager; a graphs greedy row's reference
    is eager's step at the same batch."""
    eager = {r["batch"]: r["step_ms"] for r in decode.get("eager", {}).get("rows", [])
             if "batch" in r and "step_ms" in r and r.get("sampling") == "greedy"}  # fmt: skip
    rows = []
    for mode in [m for m in ("graphs", "eager") if m in decode]:
        result = decode[mode]
        for r in result["rows"]:
            name = f"runner {mode} {r['case']}"
            if "step_ms" not in r:
                rows.append(row(name, None, None, None, r.get("note", "")))
                continue
            ref = (
                eager.get(r.get("batch"))
                if mode == "graphs" and r.get("sampling") == "greedy"
                else None
            )
            note = f"{r['tok_s']:.0f} tok/s" if "tok_s" in r else f"{r['tflops']:.1f} TFLOP/s"
            note += f"; p90 {r['p90_ms']:.2f}" + ("; ref: eager" if ref else "")
            rows.append(row(name, r["step_ms"], ref, r.get("floor_ms"), note))
        for error in result["errors"]:
            rows.append(row(f"runner {mode}", None, None, None, f"FAILED: {error}"[:200]))
    return rows


def agreement(eager: dict, graphs: dict) -> dict:
    """The two processes' greedy tokens at every decode step (same weights, prompts and K/V:
    the graphs replay the eager kernels, so all of them unless the attention's split-KV or
    a fused kernel differs per bucket and a near-tie flips; a request that differs once
    continues from another token, so ``first_divergence`` is the step that matters), the
    first step's alone, the prefill's token (eager in both), and the graphs process's own
    ``graph_vs_eager``. ``comparable``: both filled the same K/V into as many blocks."""
    same = total = first_same = first_total = 0
    reqs_same = reqs = 0
    divergence: dict[str, int] = {}
    steps_e, steps_g = eager.get("step_tokens", {}), graphs.get("step_tokens", {})
    for batch, e_steps in steps_e.items():
        g_steps = steps_g.get(batch)
        if g_steps is None:
            continue
        for i, (a, b) in enumerate(zip(e_steps, g_steps, strict=False)):
            equal = sum(x == y for x, y in zip(a, b, strict=False))
            same, total = same + equal, total + len(a)
            if i == 0:
                first_same, first_total = first_same + equal, first_total + len(a)
            if equal != len(a) and batch not in divergence:
                divergence[batch] = i
        n = min(len(e_steps), len(g_steps))
        for r in range(len(e_steps[0]) if e_steps else 0):
            reqs += 1
            reqs_same += all(e_steps[i][r] == g_steps[i][r] for i in range(n))
    if not steps_e:  # an older gpu_decode JSON: the first step only
        for batch, tokens in eager.get("first_tokens", {}).items():
            other = graphs.get("first_tokens", {}).get(batch)
            if other is not None:
                first_same += sum(a == b for a, b in zip(tokens, other, strict=False))
                first_total += len(tokens)
        same, total = first_same, first_total
    return {
        "decode_tokens_equal": f"{same}/{total}",
        "first_step_tokens_equal": f"{first_same}/{first_total}",
        "requests_all_steps_equal": f"{reqs_same}/{reqs}",
        "first_divergence": divergence or None,  # {batch: step}
        "comparable": eager.get("kv_fill") == graphs.get("kv_fill"),
        "prefill_token_equal": eager.get("prefill_first_token") is not None
        and eager.get("prefill_first_token") == graphs.get("prefill_first_token"),
        "graph_vs_eager": _gve_summary(graphs),
    }


def _gve_summary(graphs: dict) -> dict | None:
    """The graphs process's graph_vs_eager without its per-step list and method text."""
    gve = graphs.get("graph_vs_eager")
    return None if gve is None else {k: v for k, v in gve.items() if k not in ("checks", "method")}


# ---------------------------------------------------------------- 6. the server


def bench_serve(args: argparse.Namespace, deadline: float, results: dict,
                save: Callable[[], None]) -> None:  # fmt: skip
    """``bench/gpu_serve.py`` (the server and the bench client, child processes) until
    ``deadline``, with the graphs' step times (else eager's) for what they allow."""
    from bench import gpu_serve
    from bench.gpu_decode import has_config_field

    decode = results.get("decode", {})
    graphs = decode.get("graphs")
    failed = graphs is not None and (
        bool(graphs["errors"])
        or any(r.get("note", "").startswith("FAILED") for r in graphs["rows"])
    )
    use = graphs if graphs and not failed and graphs.get("rows") else decode.get("eager")
    serve = results["serve"] = {"runs": [], "errors": [],
                                "step_times_from": use.get("mode") if use else None}  # fmt: skip
    extra = list(args.serve_args)
    if failed and has_config_field("enforce_eager") and "--enforce-eager" not in extra:
        # The server's worker would capture the same graphs: serve eagerly, still measured.
        extra.append("--enforce-eager")
        serve["note"] = "part 4's CUDA graphs failed: the server runs with --enforce-eager"
        print(serve["note"], flush=True)
    serve_args = gpu_serve.parse_args(["--tiny"] * args.dry_run + ["--serve-args", *extra])
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the server's worker measures what is free
        serve["check_process_gib"] = round(torch.cuda.memory_reserved() / GiB, 2)
    try:
        gpu_serve.run(serve_args, serve, save, deadline, use)
    except Exception as e:  # Terminated and KeyboardInterrupt go on up, the server closed
        traceback.print_exc()
        serve["errors"].append(f"{type(e).__name__}: {e}"[:1000])
    save()


def goals(results: dict) -> dict:
    """Issue 31's goals against what ran (None: not measured)."""
    graphs = {r["batch"]: r for r in results.get("decode", {}).get("graphs", {}).get("rows", [])
              if "step_ms" in r and r.get("sampling") == "greedy"}  # fmt: skip
    runs = {r["concurrency"]: r for r in results.get("serve", {}).get("runs", [])
            if "output_throughput" in r}  # fmt: skip
    out: dict[str, Any] = {}
    for batch, limit in ((1, 1.3), (64, 1.3), (256, 1.2)):
        r = graphs.get(batch)
        ratio = r["step_ms"] / r["floor_ms"] if r else None
        out[f"decode B={batch} <= {limit}x floor"] = _goal(ratio, limit)
    c1, c256 = runs.get(1), runs.get(256)
    out["TPOT c=1 <= 5.5 ms"] = _goal(c1 and c1.get("median_tpot_ms"), 5.5)
    out["TTFT c=1 <= 60 ms"] = _goal(c1 and c1.get("median_ttft_ms"), 60.0)
    frac = c256 and c256.get("allowed", {}).get("achieved_frac")
    out["c=256 >= 80% of the steps' throughput"] = {
        "value": frac, "met": None if frac is None else frac >= 0.8,
    }  # fmt: skip
    return out


def _goal(value: float | None, limit: float) -> dict:
    return {"value": value, "met": None if value is None else value <= limit}


# ---------------------------------------------------------------- report


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_table(rows: list[dict]) -> None:
    print(f"\n{'case':<44} {'ours ms':>9} {'ref ms':>9} {'floor ms':>9} {'floor/ours':>10}  note")
    for r in rows:
        eff = f"{r['floor_ms'] / r['ours_ms']:.0%}" if r["ours_ms"] and r["floor_ms"] else "-"
        print(f"{r['case']:<44} {_fmt(r['ours_ms']):>9} {_fmt(r['ref_ms']):>9} "
              f"{_fmt(r['floor_ms']):>9} {eff:>10}  {r['note']}")  # fmt: skip


class Terminated(BaseException):
    """SIGTERM (``timeout``'s, say), raised where the check is, so that what ran is reported."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated(signal.Signals(signum).name)


def check_nccl(rows: list[dict]) -> None:
    """Part 5: torch.distributed's NCCL backend with one rank, as the workers call it."""
    import datetime
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        dist.all_reduce(x)
        parts = [torch.empty_like(x)]
        dist.all_gather(parts, x)
        torch.cuda.synchronize()
        if not (torch.equal(x, torch.arange(1 << 20, device="cuda", dtype=torch.float32))
                and torch.equal(parts[0], x)):  # fmt: skip
            raise RuntimeError("NCCL all-reduce/all-gather gave wrong values")
        big = torch.ones(32 << 20, device="cuda", dtype=torch.bfloat16)  # 64 MiB
        ms = cuda_time_ms(lambda: dist.all_reduce(big))
        rows.append(row("nccl all-reduce 64 MiB, 1 rank", ms, None, None, "values ok"))
    finally:
        dist.destroy_process_group()


def run_parts(
    args: argparse.Namespace, deadline: float, results: dict, save: Callable[[], None]
) -> bool:
    """Parts 1-6, on the GPU (``--dry-run``: 4 and 6 on the CPU, tiny); fills ``results``
    (saving it after each part), False if one failed. An interrupt propagates, with what ran
    already in ``results``."""
    import triton

    rows, errors = results["rows"], results["errors"]
    results["triton"] = triton.__version__
    if args.dry_run:
        results.update(device="cpu (dry run: tiny model; parts 1, 3 and 5 skipped)")
    else:
        props = torch.cuda.get_device_properties(0)
        results.update(device=props.name, num_sms=props.multi_processor_count,
                       memory_gib=round(props.total_memory / GiB, 1))  # fmt: skip
    print(f"{results['device']}, {results.get('memory_gib', '-')} GiB, torch "
          f"{torch.__version__}, triton {triton.__version__}", flush=True)  # fmt: skip
    ok = True
    parts, last = results.setdefault("part_seconds", {}), [time.monotonic()]

    def mark(name: str) -> None:  # how long each part took: the next run's budget
        parts[name] = round(time.monotonic() - last[0], 1)
        last[0] = time.monotonic()

    if not (args.skip_tests or args.dry_run):
        cmd = tests_command(workers=args.test_workers)
        results["tests"] = run_tests(min(args.tests_timeout_s, args.budget_s * 0.3), cmd)
        ok = results["tests"]["passed"]
        mark("tests")
        save()

    try:
        if args.dry_run:
            from bench.gpu_decode import cpu_bandwidth

            bandwidth = cpu_bandwidth()
        else:
            bandwidth = copy_bandwidth()
            torch.cuda.empty_cache()
    except Exception as e:  # every floor divides by it: nothing more to time
        errors.append(f"copy bandwidth: {type(e).__name__}: {e}")
        traceback.print_exc()
        return False
    results["copy_bandwidth_gbps"] = round(bandwidth / 1e9, 1)
    print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s", flush=True)
    if not (args.dry_run or args.skip_attention):
        bench_attention(bandwidth, deadline, rows)
        torch.cuda.empty_cache()
    mark("bandwidth and attention")
    save()
    if args.skip_model:
        rows.append(row("runner steps", None, None, None, "skipped (--skip-model)"))
    else:
        bench_decode(args, bandwidth, deadline, results, save)
        mark("runner steps (2 processes)")
    if not args.dry_run:
        try:
            check_nccl(rows)
        except Exception as e:
            traceback.print_exc()
            rows.append(
                row("nccl, 1 rank", None, None, None, f"FAILED: {type(e).__name__}: {e}"[:200])
            )
        mark("nccl")
        save()
    if not args.skip_serve:
        bench_serve(args, deadline, results, save)
        mark("server")
    results["goals"] = goals(results)
    save()
    failed = any(r["note"].startswith("FAILED") for r in rows)
    serve = results.get("serve", {})
    failed |= bool(serve.get("errors")) or any(
        r.get("note", "").startswith("FAILED") for r in serve.get("runs", [])
    )
    return ok and not failed


def report(results: dict) -> None:
    if "tests" in results:
        t = results["tests"]
        verdict = "passed" if t["passed"] else "TIMED OUT" if t.get("timed_out") else "FAILED"
        print(f"\nkernel tests on CUDA: {verdict} ({t['seconds']} s): {t.get('summary')}")
        for line in t.get("failed", []):
            print(f"  {line}")
    if "copy_bandwidth_gbps" in results:
        print(f"copy bandwidth {results['copy_bandwidth_gbps']} GB/s; floor = bytes / bandwidth")
    if results["rows"]:
        print_table(results["rows"])
    if results.get("part_seconds"):
        print("seconds: " + ", ".join(f"{k} {v}" for k, v in results["part_seconds"].items()))
    for mode, d in results.get("decode", {}).items():
        print(f"runner {mode}: built in {d.get('build_s')} s, capture {d.get('capture')}, "
              f"KV {d.get('kv_cache_gib')} GiB")  # fmt: skip
    if "decode_agreement" in results:
        agree = dict(results["decode_agreement"])
        gve = agree.pop("graph_vs_eager", None)
        if agree:
            print(f"eager vs graphs processes, greedy tokens at every step: {agree}")
        print(f"graph replay vs eager forward on the same inputs (graphs process): {gve}")
    if "serve" in results:
        print_serve(results["serve"])
    if results.get("goals"):
        dry = "dry run" in results.get("device", "")
        print("\nissue 31's goals" + (" (dry run: a tiny model on a CPU, not the goals')" * dry))
    for name, g in results.get("goals", {}).items():
        verdict = {True: "met", False: "NOT met", None: "not measured"}[g["met"]]
        value = "-" if g["value"] is None else f"{g['value']:.3g}"
        print(f"goal {name}: {value} ({verdict})")
    for error in results["errors"]:
        print(f"ERROR: {error}")


def print_serve(serve: dict) -> None:
    print(f"\nserver: ready in {serve.get('startup_s', '-')} s; step times from the runner's "
          f"{serve.get('step_times_from')} run")  # fmt: skip
    print(f"{'c':>4} {'n':>4} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
          f"{'TPOT p99':>9} {'wkr idle':>8} {'step':>7} {'gap':>6} {'allowed':>8} {'got':>5}")  # fmt: skip
    for r in serve.get("runs", []):
        if "output_throughput" not in r:
            print(f"{r['concurrency']:>4} {r['prompts']:>4}  {r.get('note', '')}")
            continue
        t, al = r.get("timeline", {}), r.get("allowed", {})

        def f(x: float | None, spec: str = ".1f") -> str:
            return "-" if x is None else format(x, spec)

        print(f"{r['concurrency']:>4} {r['prompts']:>4} {f(r['output_throughput'], '.0f'):>10} "
              f"{f(r.get('median_ttft_ms')):>9} {f(r.get('p99_ttft_ms')):>9} "
              f"{f(r.get('median_tpot_ms'), '.2f'):>9} {f(r.get('p99_tpot_ms'), '.2f'):>9} "
              f"{f(t.get('worker_idle_share'), '.0%'):>8} {f(t.get('decode_step_ms'), '.2f'):>7} "
              f"{f(t.get('decode_gap_ms'), '.2f'):>6} "
              f"{f(al.get('with_prefill_tok_s', al.get('decode_tok_s')), '.0f'):>8} "
              f"{f(al.get('achieved_frac'), '.0%'):>5}")  # fmt: skip
    for e in serve.get("errors", []):
        print(f"server ERROR: {e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="JSON results")
    parser.add_argument("--budget-s", type=float, default=480, help="stop starting work after")
    parser.add_argument("--skip-tests", action="store_true", help="no kernel tests (part 1)")
    parser.add_argument("--tests-timeout-s", type=float, default=120,
                        help="the kernel tests' limit (then interrupted; the rest runs)")  # fmt: skip
    parser.add_argument("--test-workers", type=int, default=4,
                        help="pytest-xdist workers for the tests, where installed (1: none)")  # fmt: skip
    parser.add_argument("--skip-attention", action="store_true", help="no attention (part 3)")
    parser.add_argument("--decode-modes", nargs="+", choices=["graphs", "eager"],
                        default=["graphs", "eager"],
                        help="runner processes of part 4 (always graphs first)")  # fmt: skip
    parser.add_argument("--skip-model", action="store_true", help="no runner steps (part 4)")
    parser.add_argument("--skip-serve", action="store_true", help="no server (part 6)")
    parser.add_argument("--serve-reserve-s", type=float, default=200,
                        help="time part 4 leaves for part 6 (the server)")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU with a tiny model: parts 4 and 6 (imports, plans, "
                             "server, client, JSON); no GPU needed")  # fmt: skip
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                        help="more flags for actorserve serve (last)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.dry_run:
        args.serve_reserve_s = min(args.serve_reserve_s, 90)
    # Before the imports: on a host without CUDA, importing kernels sets it.
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and not args.dry_run:
        print("unset TRITON_INTERPRET: gpu-check times compiled kernels", file=sys.stderr)
        return 2
    start = time.monotonic()
    results: dict[str, Any] = {
        "commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "rows": [],
        "errors": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        results["seconds"] = round(time.monotonic() - start, 1)
        args.out.write_text(json.dumps(results, indent=2))

    imports = results["imports"] = check_imports()
    results["packages"] = loaded_packages()
    print("imported: " + ", ".join(f"{d} {v}" for d, v in results["packages"].items()))
    missing = {m: e for m, e in imports.items() if e != "ok"}
    for module, error in missing.items():
        print(f"MISSING: {module}: {error}", file=sys.stderr)
        results["errors"].append(f"import {module}: {error}")
    print(f"imports: {len(imports) - len(missing)} of {len(imports)} modules import", flush=True)
    results["import_seconds"] = round(time.monotonic() - start, 1)
    save()
    if not torch.cuda.is_available() and not args.dry_run:
        print("gpu-check needs an NVIDIA GPU: torch sees no CUDA device", file=sys.stderr)
        return 2
    if "triton" in missing:
        print("gpu-check needs triton (pip install triton)", file=sys.stderr)
        return 2

    ok = False
    signal.signal(signal.SIGTERM, _terminate)
    try:
        ok = run_parts(args, start + args.budget_s, results, save) and not missing
    except (Terminated, KeyboardInterrupt) as e:
        results["errors"].append(
            f"interrupted ({type(e).__name__} {e}) after {time.monotonic() - start:.0f} s"
        )
    except Exception as e:  # a part broke outside its own guard: still report what ran
        traceback.print_exc()
        results["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    report(results)
    save()
    print(f"\nwrote {args.out} ({results['seconds']} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
