"""A worker's resident memory at idle against the weights it holds (issue 15's memory goal:
at most the weights as the kernels read them + 0.5 GB, one copy of each weight).

    .venv/bin/python -m bench.worker_memory                      # the default GGUF model
    .venv/bin/python -m bench.worker_memory --llama-1b           # a 1.07B dummy Llama, fp32

Starts ``actorserve serve`` (fresh, loopback), waits for /health and a few seconds, and reads
the worker process's RSS (and its anonymous / file-backed parts) from /proc. The weights'
bytes: for a GGUF model the file's tensor data (quantized matrices are served from their
blocks); for a dummy model 4 bytes per parameter. Appends to ``bench/results/worker_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

from bench.procs import REPO, ServerProcess

# Llama-3.2-1B's shape on SmolLM2's vocabulary (so the default tokenizer serves it).
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def worker_status(server_pid: int) -> dict[str, int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True)
    pids = [
        int(line.split()[0]) for line in out.stdout.splitlines() if "launch.child worker" in line
    ]
    if not pids:
        raise RuntimeError("no worker process found")
    fields = {}
    with open(f"/proc/{pids[0]}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def weight_bytes(folder: Path, dummy: bool) -> int:
    from services.config import ModelArchConfig
    from services.model_loader import load_hf_config
    from services.model_loader.gguf_convert import gguf_source, open_gguf
    from services.model_loader.weights import param_shapes

    if dummy:
        arch = ModelArchConfig.from_hf_config(load_hf_config(folder))
        return sum(4 * _prod(s) for s in param_shapes(arch).values())
    source = gguf_source(folder)
    if source is None:
        raise SystemExit("give a GGUF model or --load-format dummy")
    return sum(int(t.n_bytes) for t in open_gguf(source).tensors)


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> int:
    from services.model_loader import prepare_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--llama-1b", action="store_true", help="a 1.07B dummy Llama (fp32)")
    parser.add_argument("--settle-s", type=float, default=5.0)
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, load_format = args.model, args.load_format
        if args.llama_1b:
            default = prepare_model(None)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                (Path(tmp) / name).write_bytes((default / name).read_bytes())
            (Path(tmp) / "config.json").write_text(json.dumps(LLAMA_1B))
            model, load_format = tmp, "dummy"
        folder = prepare_model(model, load_format)
        weights = weight_bytes(folder, load_format == "dummy")
        cmd = ["--load-format", load_format, "--max-model-len", "2048", *extra]
        server = ServerProcess(*([] if model is None else ["--model", model]), *cmd)
        try:
            server.wait_ready(900)
            time.sleep(args.settle_s)
            status = worker_status(server.popen.pid)
        finally:
            server.close()
    label = "llama-1b (dummy)" if args.llama_1b else model or "default"
    row = {"model": label, "load_format": load_format, "flags": extra,
           "weights_bytes": weights, **status, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    over = status["VmRSS"] - weights
    print(f"weights {weights / 1e6:.0f} MB; worker RSS {status['VmRSS'] / 1e6:.0f} MB "
          f"(anon {status['RssAnon'] / 1e6:.0f}, file {status['RssFile'] / 1e6:.0f}): "
          f"{over / 1e6:+.0f} MB over the weights")  # fmt: skip
    path = REPO / "bench" / "results" / "worker_memory.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps([*rows, row], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
