"""The layers hold: import-linter's contracts (pyproject.toml) pass on the tree, and fail
on a copy of it given one upward import; raw ZeroMQ sockets only where ipc.py lists them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from services.ipc import RAW_SOCKETS

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
PACKAGES = ("services", "launch", "actorserve_kernels")


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(cwd / "pyproject.toml")],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy_tree(dest: Path) -> None:
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package,
            dest / package,
            ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"),
        )


def test_layer_contracts_hold() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_layers(tmp_path: Path) -> None:
    """The KV cache (below the scheduler) importing the scheduler fails the check, and the
    report names the import."""
    _copy_tree(tmp_path)
    block_pool = tmp_path / "services" / "kv_cache" / "block_pool.py"
    block_pool.write_text(
        block_pool.read_text() + "\nfrom services.scheduler import scheduler as _upward  # noqa\n"
    )
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout
    assert "services.kv_cache.block_pool -> services.scheduler.scheduler" in result.stdout


def test_a_cycle_between_packages_breaks_the_check(tmp_path: Path) -> None:
    """Two sibling packages importing each other fail the acyclic contract even where the
    layers allow one direction (the bottom layer's siblings may import each other)."""
    _copy_tree(tmp_path)
    clock = tmp_path / "services" / "clock.py"
    clock.write_text(clock.read_text() + "\nfrom services import registry as _loop  # noqa\n")
    registry = tmp_path / "services" / "registry.py"
    registry.write_text(registry.read_text() + "\nfrom services import clock as _loop  # noqa\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "No cycle between the packages of services/ BROKEN" in result.stdout


_RAW_SOCKET = re.compile(r"\.socket\(\s*zmq\.|zmq\.(asyncio\.)?Context\b")


def test_raw_zmq_sockets_only_where_ipc_lists_them() -> None:
    users = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel != "services/ipc.py" and _RAW_SOCKET.search(path.read_text()):
                users.add(rel)
    assert users == set(RAW_SOCKETS), (
        "open ZeroMQ sockets through services/ipc.py's wrappers, or list the file in "
        f"RAW_SOCKETS with the reason: unlisted {sorted(users - set(RAW_SOCKETS))}, "
        f"listed but not using raw sockets {sorted(set(RAW_SOCKETS) - users)}"
    )


def test_long_files_say_why_they_stay_whole() -> None:
    """A production file past ~500 lines is asking to be split; one that stays whole says
    why in its docstring (the issue-30 rule; STYLE.md: a file per idea)."""
    import ast

    unexplained = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            if text.count("\n") > 500:
                doc = ast.get_docstring(ast.parse(text)) or ""
                if "stays whole" not in doc:
                    unexplained.append(path.relative_to(ROOT).as_posix())
    assert not unexplained, (
        f"split these, or say in the docstring why each stays whole: {unexplained}"
    )
