"""Whether torch sees a CUDA device, answered without importing torch into this process.

``--device auto`` is resolved in the launcher, which never computes: importing torch there
would keep ~180 MB resident for the server's whole life. A torch built without CUDA or ROCm
says so in ``torch/version.py``, read as text; a CUDA build is asked in a short-lived
interpreter. A process that has already imported torch (a worker) asks it directly.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

_ASK = "import torch; print(int(torch.cuda.is_available()))"


def torch_sees_cuda() -> bool:
    """``torch.cuda.is_available()``, the same answer, without importing torch here."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.cuda.is_available())
    return _ask_torch()


@functools.cache
def _ask_torch() -> bool:
    if not _gpu_build():
        return False
    try:
        out = subprocess.run(
            [sys.executable, "-c", _ASK], capture_output=True, text=True, timeout=600, check=True
        )
        return out.stdout.strip().splitlines()[-1] == "1"
    except (OSError, subprocess.SubprocessError, IndexError):
        import torch  # the short-lived interpreter failed: ask here, as before

        return bool(torch.cuda.is_available())


def _gpu_build() -> bool:
    """False when the installed torch is built for neither CUDA nor ROCm (its
    ``torch.version.cuda`` and ``.hip`` are None); True when it may be, or cannot be told."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return True  # no torch to read: the import below reports it as before
    try:
        path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, StopIteration):
        return True
    values: dict[str, object] = {}
    for node in tree.body:  # ``cuda: Optional[str] = None``, ``hip = '6.2...'``
        target: ast.expr | None = None
        value: ast.expr | None = None
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            values[target.id] = value.value
    if "cuda" not in values or "hip" not in values:
        return True
    return values["cuda"] is not None or values["hip"] is not None
