"""What crosses a socket or comes from a request is never unpickled nor evaluated: a scan of
the source tree. (A running server's listening sockets are checked in test_hostile_input.)"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TREES = ("services", "launch", "actorserve_kernels", "bench")

# module -> its functions that turn bytes into objects by running code (pickle's opcodes,
# marshal's code objects), or torch.distributed helpers that pickle under the hood.
_UNSAFE_CALLS = {
    "pickle": {"load", "loads", "Unpickler"},
    "cPickle": {"load", "loads"},
    "marshal": {"load", "loads"},
    "shelve": {"open"},
    "dill": {"load", "loads"},
    "cloudpickle": {"load", "loads"},
    "yaml": {"load", "unsafe_load", "full_load"},
}
_UNSAFE_ATTRS = {
    "recv_pyobj",  # pyzmq's pickle receive
    "recv_serialized",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "recv_object_list",
}
_UNSAFE_BUILTINS = {"eval", "exec", "compile", "__import__"}


def _aliases(tree: ast.AST) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """``import pickle as pk`` -> {"pk": "pickle"}; ``from torch import load as tl`` ->
    {"tl": ("torch", "load")}."""
    modules: dict[str, str] = {}
    names: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                modules[a.asname or a.name.split(".")[0]] = a.name.split(".")[-1]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                names[a.asname or a.name] = (node.module.split(".")[-1], a.name)
    return modules, names


def _unsafe(module: str | None, name: str, node: ast.Call) -> str | None:
    """What is wrong with calling ``module.name(...)`` as ``node``, if anything."""
    keywords = {k.arg: k.value for k in node.keywords}

    def is_true(key: str) -> bool:
        value = keywords.get(key)
        return isinstance(value, ast.Constant) and value.value is True

    if module in _UNSAFE_CALLS and name in _UNSAFE_CALLS[module]:
        return f"{module}.{name}()"
    if name in _UNSAFE_ATTRS:
        return f".{name}()"
    if module == "torch" and name == "load" and not is_true("weights_only"):
        return "torch.load() without weights_only=True"
    if module in ("numpy", "np") and name == "load" and is_true("allow_pickle"):
        return "numpy.load(allow_pickle=True)"
    return None


def _findings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    modules, names = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func, where = node.func, f"{path.relative_to(REPO)}:{node.lineno}"
        what = None
        if isinstance(func, ast.Name):
            if func.id in _UNSAFE_BUILTINS:
                what = f"{func.id}()"
            elif func.id in names:
                what = _unsafe(*names[func.id], node)
        elif isinstance(func, ast.Attribute):
            owner = func.value.id if isinstance(func.value, ast.Name) else None
            what = _unsafe(modules.get(owner, owner) if owner else None, func.attr, node)
        if what:
            found.append(f"{where}: {what}")
    return found


def test_no_unpickling_or_eval_anywhere_in_the_tree():
    files = [p for tree in TREES for p in sorted((REPO / tree).rglob("*.py"))]
    assert len(files) > 50  # the scan saw the tree
    found = [f for p in files for f in _findings(p)]
    assert not found, "code that runs bytes or text as code:\n" + "\n".join(found)


def test_the_scan_finds_what_it_looks_for(tmp_path, monkeypatch):
    """The scanner itself: each kind of unsafe call is reported (so a clean tree means
    something)."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle, marshal, torch\nimport pickle as pk\nimport numpy as np\n"
        "from pickle import loads\nfrom torch import load as tl\n"
        "pickle.loads(b'')\nmarshal.loads(b'')\neval('1')\nexec('x = 1')\n"
        "sock.recv_pyobj()\ntorch.load('f')\ntorch.load('f', weights_only=True)\n"
        "dist.broadcast_object_list([])\npickle.dumps(1)\n"
        "pk.load(f)\nloads(b'')\ntl('f')\nnp.load('f', allow_pickle=True)\nnp.load('f')\n"
    )
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    found = _findings(bad)
    assert [f.split(": ", 1)[1] for f in found] == [
        "pickle.loads()",
        "marshal.loads()",
        "eval()",
        "exec()",
        ".recv_pyobj()",
        "torch.load() without weights_only=True",
        ".broadcast_object_list()",
        "pickle.load()",
        "pickle.loads()",
        "torch.load() without weights_only=True",
        "numpy.load(allow_pickle=True)",
    ]


def test_every_count_limit_must_be_positive():
    """Each count flag of RequestLimits refuses 0 (derived from the fields, none forgotten)."""
    import argparse
    import dataclasses

    import pytest

    from services.config import ConfigError, RequestLimits

    counts = [
        f.name
        for f in dataclasses.fields(RequestLimits)
        if f.type == "int" and f.name != "max_logprobs"
    ]
    assert "max_sequences_per_request" in counts and len(counts) == 5
    for name in counts:
        with pytest.raises(ConfigError, match="must be at least 1"):
            RequestLimits.from_cli(argparse.Namespace(**{name: 0}))
    with pytest.raises(ConfigError, match="positive number"):
        RequestLimits.from_cli(argparse.Namespace(stream_send_timeout=float("nan")))
