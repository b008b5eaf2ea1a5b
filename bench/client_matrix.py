"""The real-client matrix (issue 35): the client libraries people point at an OpenAI- or
Anthropic-compatible server, each making the calls its users make, against a fresh
``actorserve serve`` on the default model.

    .venv/bin/python -m bench.client_matrix setup [DIR]   # a venv per library (PyPI, ~4 min)
    .venv/bin/python -m bench.client_matrix run [DIR] [--only LIB ...]

Each library lives in a virtual environment of its own under ``DIR`` (default
``$TMPDIR/client-venvs``: openai, anthropic, instructor, langchain-openai, openai-agents,
pydantic-ai, litellm, each at its newest with the openai it wants), never in the project's;
the cases are ``bench/client_matrix_cases.py``, run in each. The server runs with ``--enable-auto-tool-choice --tool-call-parser hermes``.
Writes ``bench/results/client_matrix.json`` (a row per case, with the library's version)
and prints the table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.procs import ServerProcess

HERE = Path(__file__).resolve().parent
LIBRARIES = {  # distribution -> the name the cases use
    "openai": "openai", "anthropic": "anthropic", "instructor": "instructor",
    "langchain-openai": "langchain-openai", "openai-agents": "openai-agents",
    "pydantic-ai-slim[openai]": "pydantic-ai", "litellm": "litellm",
}  # fmt: skip
MODEL = "SmolLM2-135M-Instruct"


def default_root() -> Path:
    return Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / "client-venvs"


def setup(root: Path) -> None:
    """A venv per library (each at its newest, with the openai it wants)."""
    for dist, name in LIBRARIES.items():
        venv = root / name
        print(f"[{name}] creating {venv}, installing {dist} from PyPI ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", dist], check=True)
    print(f"ready: {root}")


def version(root: Path, name: str) -> str:
    dist = next(d for d, n in LIBRARIES.items() if n == name).split("[")[0]
    code = "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
    out = subprocess.run([str(root / name / "bin" / "python"), "-c", code, dist],
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip() or "?"


def run(root: Path, names: list[str]) -> list[dict[str, Any]]:
    server = ServerProcess("--max-model-len", "1024", "--enable-auto-tool-choice",
                           "--tool-call-parser", "hermes")  # fmt: skip
    rows: list[dict[str, Any]] = []
    try:
        server.wait_ready()
        for name in names:
            cmd = [str(root / name / "bin" / "python"), str(HERE / "client_matrix_cases.py"),
                   server.url, MODEL, name]  # fmt: skip
            found = version(root, name)
            with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True) as proc:  # fmt: skip
                assert proc.stdout is not None
                for line in proc.stdout:
                    row = {**json.loads(line), "version": found}
                    rows.append(row)
                    mark = "ok  " if row["ok"] else "FAIL"
                    print(f"{mark} {name:>16} {found:>8}  {row['case']}  ({row['seconds']} s)"
                          + (f"\n     {row['error']}" if row["error"] else ""), flush=True)  # fmt: skip
    finally:
        server.close()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| library | version | case | result |", "|---|---|---|---|"]
    for r in rows:
        result = "passes" if r["ok"] else f"fails: {r['error']}"
        lines.append(f"| {r['library']} | {r['version']} | {r['case']} | {result} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=["run", "setup"], default="run")
    parser.add_argument("dir", nargs="?", type=Path, help="the libraries' venvs (a folder)")
    parser.add_argument("--only", nargs="*", default=[], help="these libraries only")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "client_matrix.json")
    args = parser.parse_args()
    root = args.dir or default_root()
    if args.command == "setup":
        setup(root)
        return 0
    names = [n for n in LIBRARIES.values() if not args.only or n in args.only]
    missing = [n for n in names if not (root / n / "bin" / "python").exists()]
    if missing:
        print(f"no venv for {', '.join(missing)} in {root}: run "
              f"`.venv/bin/python -m bench.client_matrix setup {root}`")  # fmt: skip
        return 2
    started = time.gmtime()
    rows = run(root, names)
    args.out.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M UTC", started),
                                    "rows": rows}, indent=2) + "\n")  # fmt: skip
    print(table(rows))
    print(f"wrote {args.out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
