"""The processes that do not compute stay small (issue 34): the launcher, tokenizers,
detokenizer, api_server and scheduler never import torch (nor transformers, triton, the
GGUF reader or safetensors), so each holds well under 120 MB at idle.

The import checks run each entry module in a fresh interpreter (this test process has torch
already); the last test starts a real server and reads each process's resident memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest
import torch

from services.config import device as device_mod
from tests.server_utils import REPO, RemoteServer

TORCH_FAMILY = ("torch", "transformers", "triton", "safetensors", "gguf")
# role -> (the modules its process imports to run, what must stay out of it)
ENTRIES = {
    "launcher": (["launch.cli", "launch.serve", "launch.launcher"], (*TORCH_FAMILY, "numpy")),
    "tokenizer": (["launch.child", "services.tokenizer.service"], (*TORCH_FAMILY, "numpy")),
    "detokenizer": (["launch.child", "services.detokenizer.service"], (*TORCH_FAMILY, "numpy")),
    "api_server": (["launch.child", "services.api_server.process"], (*TORCH_FAMILY, "numpy")),
    # numpy is the grammar bitmask's, imported when a constrained request first comes
    "scheduler": (["launch.child", "services.scheduler.service"], TORCH_FAMILY),
}
IDLE_RSS_LIMIT = 120 << 20


def imported_in_fresh_interpreter(code: str, watch: tuple[str, ...]) -> list[str]:
    """Run ``code`` in a new interpreter; which of ``watch`` it left in ``sys.modules``."""
    probe = (
        f"{code}\nimport json, sys\nprint(json.dumps([m for m in {watch!r} if m in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.parametrize("role", sorted(ENTRIES))
def test_entry_modules_import_no_torch(role: str) -> None:
    modules, banned = ENTRIES[role]
    code = "\n".join(f"import {m}" for m in modules)
    assert imported_in_fresh_interpreter(code, banned) == [], f"the {role} imports them"


def test_resolving_the_model_imports_no_torch() -> None:
    """What the launcher, tokenizers and detokenizer do at start-up with a converted model:
    resolve ``--model``, read its config and tokenizer, resolve ``--device auto``."""
    from services.model_loader import ModelLoadError, prepare_model

    try:
        prepare_model(None)  # a first run converts the GGUF file here, with torch
    except ModelLoadError as e:
        pytest.skip(str(e))
    code = (
        "from services.config.engine import WorkerConfig\n"
        "from services.model_loader import load_hf_config, load_tokenizer, prepare_model\n"
        "folder = prepare_model(None)\n"
        "load_hf_config(folder)\n"
        "load_tokenizer(folder).encode('hello')\n"
        "WorkerConfig().resolved_device()\n"
    )
    assert imported_in_fresh_interpreter(code, (*TORCH_FAMILY, "numpy")) == []


def test_cuda_check_agrees_with_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device auto`` resolves as ``torch.cuda.is_available()`` says, whichever way the
    answer is found: torch's version file, a short-lived interpreter, or torch in process."""
    expected = torch.cuda.is_available()
    gpu_build = torch.version.cuda is not None or torch.version.hip is not None
    assert device_mod._gpu_build() == gpu_build
    assert device_mod.torch_sees_cuda() == expected  # torch is imported here: asked directly
    monkeypatch.setattr(device_mod, "_gpu_build", lambda: True)
    assert device_mod._ask_torch.__wrapped__() == expected  # the short-lived interpreter


def test_idle_rss_of_the_processes_that_do_not_compute() -> None:
    """A real server on the default model: every process but the worker under 120 MB at
    idle, and none has torch's library mapped."""
    with RemoteServer() as server:
        server.wait_ready()
        time.sleep(2.0)  # idle: start-up's transient allocations are done
        roles = server.children()
        pids = {"launcher": server.popen.pid} | {r: roles[r] for r in ENTRIES if r != "launcher"}
        report = {}
        for role, pid in pids.items():
            proc = psutil.Process(pid)
            maps = {m.path for m in proc.memory_maps(grouped=True)}
            report[role] = (proc.memory_info().rss, [p for p in maps if "libtorch" in p])
    summary = {role: f"{rss / 2**20:.0f} MB" for role, (rss, _) in report.items()}
    for role, (rss, torch_libs) in report.items():
        assert not torch_libs, f"the {role} has torch loaded: {torch_libs}"
        assert rss < IDLE_RSS_LIMIT, f"the {role} holds {rss / 2**20:.0f} MB idle: {summary}"
