"""GPU check of the Triton kernels: correctness on CUDA, then timings against references.

For a machine with an NVIDIA GPU (``make gpu-check``); the whole run fits in ~8 minutes.

1. ``tests/test_kernels.py``, slow tests included, compiled for CUDA (a subprocess).
2. Copy bandwidth: a device-to-device copy, (read + written bytes) / time; every floor
   below divides by it.
3. Attention at Llama-3-8B's heads (32 q, 8 kv, head_dim 128), bf16, block size 16:
   decode (batch 64 and 256, context 2048) and prefill, ours against torch's
   ``scaled_dot_product_attention`` (flash backend; same data, contiguous) and against the
   floor K/V bytes / bandwidth.
4. A Llama-3-8B-shaped model with random weights (the model runner, triton backend):
   one decode step at batch 1, 64 and 256, context 2048, against (weight bytes + KV
   bytes) / bandwidth.

5. NCCL with one rank (the lent machine has one GPU): the process group forms over TCP on
   loopback as ``init_distributed`` forms it, and all-reduce and all-gather on CUDA
   tensors give the right values (the code path of TP; the scaling is not measurable here).

Before any of it, every module these parts use is imported (so that a missing package shows
up at once, also on a machine without a GPU) and the third-party distributions that loaded
are listed. A lent GPU machine runs it with its own torch and triton through
``bench/gpu_check_device.sh``, which brings the few packages it lacks as wheels.

Times are medians over many runs after warm-up, from CUDA events. Prints one table and
writes the results as JSON (``--out``), after each part, so that a part that fails, a
timeout (SIGTERM) or Ctrl-C still leaves the table and JSON of what ran. Exit status: 0 if
the tests passed and every part ran, 1 if not, 2 without a GPU (after the imports).
"""

from __future__ import annotations

import argparse
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
MODULES = (
    "triton", "numpy", "pytest", "actorserve_kernels", "actorserve_kernels.attention", "actorserve_kernels.kv_cache",
    "services.config", "services.model_loader.weights", "services.gpu_worker.model_runner",
    "services.gpu_worker.attention.torch_backend", "services.gpu_worker.model.llama",
    "tests.conftest", "tests.test_kernels",
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


def run_tests(timeout_s: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow",
           "tests/test_kernels.py"]  # fmt: skip
    print(f"$ {' '.join(cmd[2:])}", flush=True)
    start = time.monotonic()
    try:
        rc = subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        rc = -1
        print(f"kernel tests did not finish within {timeout_s:.0f} s", flush=True)
    return {"returncode": rc, "passed": rc == 0, "seconds": round(time.monotonic() - start, 1)}


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
    notes = [f"rel err vs sdpa {err:.1e}" + (" (TOO HIGH)" if err > 2e-2 else "")]
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


def bench_attention(bandwidth: float, deadline: float, rows: list[dict]) -> None:
    """Appends one row per case to ``rows`` (as it goes: an interrupt keeps the ones done)."""
    cases = [("decode", 64, 1, CONTEXT), ("decode", 256, 1, CONTEXT), ("decode", 4, 1, 16384),
             ("prefill", 1, 4096, 4096), ("prefill", 8, 1024, 1024)]  # fmt: skip
    for kind, batch, q_len, ctx in cases:
        name = f"attn {kind} B={batch} q={q_len} ctx={ctx}"
        if time.monotonic() > deadline:
            rows.append(row(name, None, None, None, "skipped: out of time"))
            continue
        try:
            rows.append(attention_case(kind, batch, q_len, ctx, bandwidth))
        except Exception as e:  # one failing case must not hide the others
            rows.append(row(name, None, None, None, f"FAILED: {type(e).__name__}: {e}"[:200]))
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- 4. model decode step


def _gpu_dummy_weights(arch: Any):
    """Random N(0, 0.02) weights made on the GPU (the CPU would take minutes for 8B)."""
    from services.model_loader.weights import param_shapes

    for name, shape in param_shapes(arch).items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=DTYPE, device=DEVICE)
        else:
            yield name, torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_(0.0, 0.02)


def bench_model(
    bandwidth: float, deadline: float, batches: tuple[int, ...], rows: list[dict]
) -> None:
    """Appends one row per batch size to ``rows`` (as it goes)."""
    try:
        import numpy as np

        from services.config import EngineConfig, ModelArchConfig
        from services.gpu_worker.model_runner import ModelRunner, build_attention_metadata
    except ImportError as e:
        rows.append(row("model decode", None, None, None, f"skipped: no model runner ({e})"))
        return

    if time.monotonic() > deadline - 60:  # building the model and its cache takes a while
        rows.append(row("model decode", None, None, None, "skipped: out of time"))
        return
    arch = ModelArchConfig.from_hf_config(LLAMA3_8B)
    config = EngineConfig()
    config.model.load_format = "dummy"
    config.model.dtype = "bfloat16"
    config.scheduler.max_model_len = 4096
    config.worker.device = DEVICE
    config.worker.attention_backend = "triton"
    config.cache.block_size = BLOCK_SIZE
    config.scheduler.max_num_seqs = max(batches)
    config.finalize(arch)
    runner = ModelRunner(config, None, arch=arch, weights=_gpu_dummy_weights(arch))
    model = runner.model
    weight_bytes = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if arch.tie_word_embeddings or "embed_tokens" not in n  # a lookup reads B rows only
    )
    blocks_per_seq = math.ceil(CONTEXT / BLOCK_SIZE)
    per_block = runner.kv_cache_bytes_per_block()
    free, _ = torch.cuda.mem_get_info()
    fits = int((free - 4 * GiB) // per_block)  # 4 GiB: activations, logits, allocator slack
    num_blocks = min(max(batches) * blocks_per_seq, fits)
    runner.initialize_kv_cache(num_blocks)

    for batch in batches:
        name = f"model decode B={batch} ctx={CONTEXT}"
        need = batch * blocks_per_seq
        if need > num_blocks:
            rows.append(row(name, None, None, None,
                            f"skipped: KV needs {need * per_block / GiB:.0f} GiB, "
                            f"{num_blocks * per_block / GiB:.0f} GiB fit"))  # fmt: skip
            continue
        if time.monotonic() > deadline:
            rows.append(row(name, None, None, None, "skipped: out of time"))
            continue
        table = np.arange(need, dtype=np.int32).reshape(batch, blocks_per_seq)
        meta, _, positions = build_attention_metadata(
            np.full(batch, CONTEXT - 1), np.ones(batch, dtype=np.int64), table, BLOCK_SIZE,
            torch.device(DEVICE),
        )  # fmt: skip
        ids = torch.randint(0, arch.vocab_size, (batch,), device=DEVICE)
        pos = torch.from_numpy(positions).to(DEVICE)

        def step(meta=meta, ids=ids, pos=pos) -> torch.Tensor:
            with torch.inference_mode():
                return model.compute_logits(model(ids, pos, meta, runner.kv_caches))

        ms = cuda_time_ms(step, warmup=3, iters=10)
        kv_bytes = batch * CONTEXT * per_block // BLOCK_SIZE
        floor = (weight_bytes + kv_bytes) / bandwidth * 1e3
        rows.append(
            row(name, ms, None, floor, f"{batch / ms * 1e3:.0f} tok/s; eager, no CUDA graphs")
        )


# ---------------------------------------------------------------- report


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_table(rows: list[dict]) -> None:
    print(f"\n{'case':<36} {'ours ms':>9} {'sdpa ms':>9} {'floor ms':>9} {'floor/ours':>10}  note")
    for r in rows:
        eff = f"{r['floor_ms'] / r['ours_ms']:.0%}" if r["ours_ms"] and r["floor_ms"] else "-"
        print(f"{r['case']:<36} {_fmt(r['ours_ms']):>9} {_fmt(r['ref_ms']):>9} "
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
    """Parts 1-5, on the GPU; fills ``results`` (saving it after each part), False if one
    failed. An interrupt propagates, with what ran already in ``results``."""
    import triton

    rows, errors = results["rows"], results["errors"]
    props = torch.cuda.get_device_properties(0)
    results.update(
        device=props.name,
        num_sms=props.multi_processor_count,
        memory_gib=round(props.total_memory / GiB, 1),
        triton=triton.__version__,
    )
    print(f"{props.name}, {results['memory_gib']} GiB, torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)  # fmt: skip
    ok = True
    if not args.skip_tests:
        results["tests"] = run_tests(timeout_s=min(300, args.budget_s * 0.6))
        ok = results["tests"]["passed"]
        save()

    try:
        bandwidth = copy_bandwidth()
    except Exception as e:  # every floor divides by it: nothing more to time
        errors.append(f"copy bandwidth: {type(e).__name__}: {e}")
        traceback.print_exc()
        return False
    torch.cuda.empty_cache()
    results["copy_bandwidth_gbps"] = round(bandwidth / 1e9, 1)
    print(f"device-to-device copy bandwidth: {bandwidth / 1e9:.0f} GB/s", flush=True)
    bench_attention(bandwidth, deadline, rows)
    save()
    if args.skip_model:
        rows.append(row("model decode", None, None, None, "skipped (--skip-model)"))
    else:
        try:
            bench_model(bandwidth, deadline, (1, 64, 256), rows)
        except Exception as e:  # report it in the table, keep the rest
            traceback.print_exc()
            rows.append(
                row("model decode", None, None, None, f"FAILED: {type(e).__name__}: {e}"[:200])
            )
        torch.cuda.empty_cache()
    try:
        check_nccl(rows)
    except Exception as e:
        traceback.print_exc()
        rows.append(row("nccl, 1 rank", None, None, None, f"FAILED: {type(e).__name__}: {e}"[:200]))
    save()
    return ok and not any(r["note"].startswith("FAILED") for r in rows)


def report(results: dict) -> None:
    if "tests" in results:
        t = results["tests"]
        print(f"\nkernel tests on CUDA: {'passed' if t['passed'] else 'FAILED'} ({t['seconds']} s)")
    if "copy_bandwidth_gbps" in results:
        print(f"copy bandwidth {results['copy_bandwidth_gbps']} GB/s; floor = bytes / bandwidth")
    if results["rows"]:
        print_table(results["rows"])
    for error in results["errors"]:
        print(f"ERROR: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="JSON results")
    parser.add_argument("--budget-s", type=float, default=470, help="stop starting work after")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-model", action="store_true")
    args = parser.parse_args(argv)
    # Before the imports: on a host without CUDA, importing kernels sets it.
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
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
    save()
    if not torch.cuda.is_available():
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
