"""Every command in README.md runs as written on this machine (issue 34).

The README's conventions, which this test reads:

- Commands live in fenced blocks tagged ``sh`` (``bash`` and untagged blocks count too;
  listings are ``text``). A logical line (``\\`` continuations and newlines inside quotes
  joined) is one command; ``A & B &`` on one line are two. Commands run from the
  repository's root, through ``.venv/bin/`` (``make install`` puts nothing on PATH).
- A server command (``make serve``, ``.venv/bin/actorserve serve|router|pd-proxy``) that ends
  in ``&`` runs together with the next one; a ``--headless`` one is another node of the server
  just before it. Other server commands in a block are alternatives, run one at a time.
- ``# needs: WHAT`` at the end of a line marks a command this machine cannot run: a server
  command so marked is skipped with WHAT as the reason. Every other one runs.

Each server command (group) is run as written, except for its ports: every port it names
(``--port``, ``--master-port``, ``--data-parallel-rpc-port``, ``"kv_port"``, and the URLs that
use them) moves to a free one, and ``--port`` is added where it relies on the default. Once
each HTTP one answers ``/health`` with 200, a completion goes to the last (the router or proxy
in front), the block's ``curl`` lines and the ``python`` block right after it that use its port
run too, then each ``actorserve`` process gets SIGTERM (the front first; a headless node stops
when node 0 goes away), must exit 0 and leave no process of its session behind.

Every other command is checked without running it: a ``make`` target exists (``make -n``), an
``actorserve`` command line parses with the CLI's own parser, a ``python -m`` module, a
``bash`` script and a ``--prompts-file`` / ``--chat-template`` file exist. Inline code spans
that start with ``.venv/bin/``, ``make`` or ``bash`` get the same check, and a bare
``python -m`` is refused (``.venv/bin/python -m``; ``python3 -m`` is the GPU machine's).

The default run starts ``make serve`` (with the Use section's curl and Python client) and the
first tensor-parallel example; the other server commands are marked slow (``make test-slow``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
ACTORSERVE = ".venv/bin/actorserve"
STAMP = ".venv/.installed"
SERVER_SUBCOMMANDS = {"serve": 8000, "router": 8080, "pd-proxy": 8080}  # -> default port
PORT_FLAGS = ("--port", "--master-port", "--data-parallel-rpc-port", "-dpp")
FILE_FLAGS = ("--prompts-file", "--chat-template")
SHELL_LANGS = {"", "sh", "bash", "shell", "console"}
KNOWN_LANGS = SHELL_LANGS | {"text", "python", "json", "yaml"}
START_TIMEOUT_S = 360.0  # several servers at once on two busy, shared cores
STOP_TIMEOUT_S = 90.0
CLIENT_TIMEOUT_S = 120.0


# ---------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class Block:
    lang: str
    line: int  # README line of the block's first line of content
    text: str  # de-indented content


@dataclass
class Command:
    text: str  # the shell text, without its comment and trailing '&'
    line: int
    comment: str = ""
    background: bool = False

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def needs(self) -> str | None:
        m = re.match(r"\s*needs:\s*(.+)", self.comment)
        return m.group(1).strip() if m else None


def fenced_blocks(markdown: str) -> list[Block]:
    blocks: list[Block] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```([\w+-]*)\s*$", lines[i])
        if m is None:
            i += 1
            continue
        indent, body = m.group(1), []
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            body.append(lines[j].removeprefix(indent))
            j += 1
        blocks.append(Block(m.group(2).lower(), i + 2, "\n".join(body)))
        i = j + 1
    return blocks


def split_commands(text: str, first_line: int) -> list[Command]:
    """Shell text -> commands: quotes and ``\\`` continuations respected, ``#`` comments
    split off, ``&`` (not ``&&``) ends a background command."""
    commands: list[Command] = []
    cur: list[str] = []
    comment, quote, line, start = "", None, first_line, first_line

    def flush(background: bool) -> None:
        nonlocal comment
        body = "".join(cur).strip()
        if body:
            commands.append(Command(body, start, comment.strip(), background))
        cur.clear()
        comment = ""

    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if not "".join(cur).strip() and not c.isspace():
            start = line
        if quote is not None:
            cur.append(c)
            if c == quote:
                quote = None
            elif c == "\\" and quote == '"' and i + 1 < n:
                cur.append(text[i + 1])
                i += 1
            if c == "\n":
                line += 1
        elif c == "\\" and i + 1 < n:
            if text[i + 1] == "\n":  # a continuation line
                cur.append(" ")
                line += 1
            else:
                cur += [c, text[i + 1]]
            i += 1
        elif c in "'\"":
            quote = c
            cur.append(c)
        elif c == "#" and (not cur or cur[-1].isspace()):
            end = text.find("\n", i)
            end = n if end < 0 else end
            comment = text[i + 1 : end]
            i = end
            continue
        elif c == "&" and i + 1 < n and text[i + 1] == "&":
            cur.append("&&")
            i += 1
        elif c == "&":
            flush(background=True)
        elif c == "\n":
            flush(background=False)
            line += 1
        else:
            cur.append(c)
        i += 1
    if quote is not None:
        raise ValueError(f"README line {start}: unclosed quote")
    flush(background=False)
    return commands


def flag_value(args: list[str], *names: str) -> str | None:
    for k, a in enumerate(args):
        for name in names:
            if a == name and k + 1 < len(args):
                return args[k + 1]
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
    return None


def actorserve_args(argv: list[str]) -> list[str] | None:
    """An actorserve command's arguments (``make serve SERVE_ARGS=...`` -> serve + them)."""
    if argv and argv[0] == ACTORSERVE:
        return argv[1:]
    if argv and argv[0] == "make" and "serve" in argv[1:]:
        given = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("SERVE_ARGS=")]
        return ["serve", *shlex.split(given[0] if given else "")]
    return None


def server_kind(cmd: Command) -> str | None:
    args = actorserve_args(cmd.argv)
    return args[0] if args and args[0] in SERVER_SUBCOMMANDS else None


def http_port(cmd: Command) -> int | None:
    """The port a server command answers HTTP on (None: a headless node)."""
    kind = server_kind(cmd)
    args = actorserve_args(cmd.argv) or []
    if kind is None or "--headless" in args:
        return None
    given = flag_value(args, "--port")
    return int(given) if given else SERVER_SUBCOMMANDS[kind]


def readme_ports(text: str) -> set[int]:
    """The ports a command (or client) names: its port flags and JSON ``kv_port``s."""
    found = {int(m) for m in re.findall(r'"kv_port":\s*(\d+)', text)}
    with contextlib.suppress(ValueError):
        args = shlex.split(text)
        for flag in PORT_FLAGS:
            value = flag_value(args, flag)
            if value is not None and value.isdigit():
                found.add(int(value))
    return found


@dataclass
class Group:
    """Server commands that run together, and the clients that use them."""

    commands: list[Command]
    clients: list[Command] = field(default_factory=list)
    python_clients: list[Block] = field(default_factory=list)

    @property
    def line(self) -> int:
        return self.commands[0].line

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(c.text for c in self.commands)

    @property
    def id(self) -> str:
        words = " ".join(c.text.replace(ACTORSERVE + " ", "") for c in self.commands)
        return f"L{self.line}-" + re.sub(r"[^\w.,=-]+", "_", words)[:60]

    def http_ports(self) -> list[int]:
        return [p for c in self.commands if (p := http_port(c)) is not None]


@dataclass
class Readme:
    blocks: list[Block]
    commands: list[Command]  # every shell command, in order
    groups: list[Group]
    inline: list[tuple[int, str]]  # (line, text) of inline commands


def _mentions(text: str, port: int) -> bool:
    return re.search(rf"(localhost|127\.0\.0\.1|\]):{port}(?!\d)", text) is not None


def parse_readme(markdown: str) -> Readme:
    blocks = fenced_blocks(markdown)
    all_commands: list[Command] = []
    groups: dict[tuple[str, ...], Group] = {}
    for b, block in enumerate(blocks):
        if block.lang not in SHELL_LANGS:
            continue
        commands = split_commands(block.text, block.line)
        all_commands += commands
        block_groups: list[Group] = []
        pending: list[Command] = []
        for cmd in commands:
            if server_kind(cmd) is None:
                continue
            args = actorserve_args(cmd.argv) or []
            if "--headless" in args and not pending and block_groups:
                block_groups[-1].commands.append(cmd)  # another node of the same server
                continue
            pending.append(cmd)
            if not cmd.background:
                block_groups.append(Group(pending))
                pending = []
        if pending:
            block_groups.append(Group(pending))
        for cmd in commands:  # clients: the block's other commands that use a server's port
            if server_kind(cmd) is None:
                for g in block_groups:
                    if any(_mentions(cmd.text, p) for p in g.http_ports()):
                        g.clients.append(cmd)
                        break
        after = blocks[b + 1] if b + 1 < len(blocks) else None
        if after is not None and after.lang == "python":
            for g in block_groups:
                if any(_mentions(after.text, p) for p in g.http_ports()):
                    g.python_clients.append(after)
                    break
        for g in block_groups:  # the same command twice (make serve): run once, all clients
            if g.key in groups:
                groups[g.key].clients += g.clients
                groups[g.key].python_clients += g.python_clients
            else:
                groups[g.key] = g
    # inline code spans outside the fenced blocks that are commands
    outside = re.sub(
        r"^(\s*)```[\w+-]*\s*$.*?^\s*```\s*$",
        lambda m: "\n" * m.group(0).count("\n"),
        markdown,
        flags=re.M | re.S,
    )
    inline = []
    for m in re.finditer(r"`([^`]+)`", outside):
        text = " ".join(m.group(1).split())
        if re.match(r"(\.venv/bin/|make( |$)|python3? -m |bash )", text):
            inline.append((outside.count("\n", 0, m.start()) + 1, text))
    return Readme(blocks, all_commands, list(groups.values()), inline)


README_TEXT = README.read_text(encoding="utf-8")
PARSED = parse_readme(README_TEXT)


# ---------------------------------------------------------------------------- static checks


def _cli_parse_problem(args: list[str]) -> str | None:
    from launch.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            build_parser().parse_args(args)
    except SystemExit as e:
        if e.code not in (0, None):
            last = (err.getvalue().strip().splitlines() or ["?"])[-1]
            return f"actorserve {shlex.join(args)}: {last}"
    return None


def static_problems(argv: list[str]) -> list[str]:
    """Why a README command could not run as written (empty: it names things that exist)."""
    head, problems = argv[0], []
    if head == "make":
        targets = [a for a in argv[1:] if not a.startswith("-") and "=" not in a]
        run = subprocess.run(
            ["make", "-n", "-o", STAMP, *targets], cwd=REPO, capture_output=True, text=True
        )
        if run.returncode != 0:
            problems.append(f"make {' '.join(targets)}: {run.stderr.strip()}")
    elif head == ACTORSERVE:
        if not (REPO / ACTORSERVE).is_file():
            problems.append(f"{ACTORSERVE} does not exist (make install)")
    elif head == ".venv/bin/python":
        if argv[1:2] == ["-m"] and importlib.util.find_spec(argv[2]) is None:
            problems.append(f"no module {argv[2]}")
    elif head == "bash":
        if not (REPO / argv[1]).is_file():
            problems.append(f"no file {argv[1]}")
    elif head.startswith(".venv/bin/"):  # another installed tool (the ray CLI)
        if not (REPO / head).is_file():
            problems.append(f"{head} does not exist (make install)")
    elif head != "curl":
        problems.append(
            f"unknown command {head!r}: README commands start with make, .venv/bin/..., bash "
            "or curl and run from the repository's root (a listing goes in a ```text block)"
        )
    args = actorserve_args(argv)
    if args:  # (a bare .venv/bin/actorserve names the command)
        if (problem := _cli_parse_problem(args)) is not None:
            problems.append(problem)
        for flag in FILE_FLAGS:
            value = flag_value(args, flag)
            if value is not None and not (REPO / value).is_file():
                problems.append(f"{flag} {value}: no such file")
    return problems


def test_readme_starts_with_make_serve_and_make_test() -> None:
    first = [c.argv for c in PARSED.commands[:2]]
    assert first == [["make", "serve"], ["make", "test"]], first


def test_readme_blocks_are_tagged_and_parse() -> None:
    for block in PARSED.blocks:
        assert block.lang in KNOWN_LANGS, f"README line {block.line}: ```{block.lang}"
        if block.lang == "python":
            compile(block.text, f"README.md:{block.line}", "exec")
    assert PARSED.groups, "no server command found in README.md"
    assert not [c for c in PARSED.commands if c.argv[0] == "actorserve"], "bare actorserve"


def test_readme_commands_name_what_exists() -> None:
    problems = [
        f"README line {c.line}: {p}" for c in PARSED.commands for p in static_problems(c.argv)
    ]
    for line, text in PARSED.inline:
        argv = shlex.split(text)
        if argv[0] in ("python", "python3") and "-m" in argv:
            if argv[0] == "python":  # python3 -m: the GPU machine's own Python
                problems.append(f"README line {line}: `{text}`: say .venv/bin/python")
            continue
        problems += [f"README line {line}: `{text}`: {p}" for p in static_problems(argv)]
    assert not problems, "\n".join(problems)


def test_readme_parser() -> None:
    cmds = split_commands(
        'a --x \'{"k": 1,\n  "j": 2}\' &  b \\\n  --y 3 & # c\n# only\nd && e  # needs: two GPUs\n',
        10,
    )
    assert [(c.text, c.line, c.background) for c in cmds] == [
        ('a --x \'{"k": 1,\n  "j": 2}\'', 10, True),
        ("b    --y 3", 11, True),
        ("d && e", 14, False),
    ]
    assert cmds[2].needs == "two GPUs"
    serve, router = f"{ACTORSERVE} serve", f"{ACTORSERVE} router"
    md = f"```sh\n{serve} --port 1 &\n{router} --port 2\n{serve} --headless\nmake serve\n```\n"
    groups = parse_readme(md).groups
    assert [len(g.commands) for g in groups] == [3, 1]


# ---------------------------------------------------------------------------- running


def _port_block(taken: set[int], width: int = 8) -> int:
    """A free port whose next ``width - 1`` are free too (master and RPC ports use those)."""
    for _ in range(500):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        span = range(base, base + width)
        if base + width > 65535 or taken & set(span):
            continue
        try:
            for p in span:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        taken.update(span)
        return base
    raise RuntimeError("no free block of ports")


def _env() -> dict[str, str]:
    """This environment, without .venv/bin on PATH: README commands name it."""
    venv = str(REPO / ".venv")
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if not p.startswith(venv)]
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(path)
    return env


def _substitute(text: str, ports: dict[int, int]) -> str:
    for old, new in ports.items():
        text = re.sub(rf"(?<!\d){old}(?!\d)", str(new), text)
    return text


def _with_port(cmd: Command, text: str, port: int, stamp_stale: bool) -> str:
    """``text`` with ``--port`` where the command relies on its default (and, for make, the
    set-up stamp left alone when stale: a test never installs packages)."""
    argv = shlex.split(text)
    args = actorserve_args(argv) or []
    missing = http_port(cmd) is not None and flag_value(args, "--port") is None
    if argv[0] == "make":
        if missing:
            given = [a for a in argv if a.startswith("SERVE_ARGS=")]
            if given:
                argv[argv.index(given[0])] = f"{given[0]} --port {port}"
            else:
                argv.append(f"SERVE_ARGS=--port {port}")
        if stamp_stale:
            argv[1:1] = ["-o", STAMP]
        return shlex.join(argv)
    return f"{text} --port {port}" if missing else text


@dataclass
class Started:
    cmd: Command
    text: str
    popen: subprocess.Popen[bytes]
    log: Path
    port: int | None

    def tail(self, n: int = 40) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        lines = [ln for ln in lines if "nanobind" not in ln and not ln.startswith(" - ")]
        return f"--- {self.text}\n" + "\n".join(lines[-n:])

    def launcher(self) -> psutil.Process | None:
        """The ``actorserve`` process (bash execs it; make runs it as a child)."""
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.popen.pid)
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    if any(a.endswith("bin/actorserve") for a in p.cmdline()[:2]):
                        return p
        return None

    def session(self) -> list[psutil.Process]:
        """Live processes of this command's session (its process group)."""
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getpgid(p.pid) == self.popen.pid and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
        return found

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)


def _wait_ready(started: list[Started]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    waiting = [s for s in started if s.port is not None]
    while waiting:
        for s in started:
            if s.popen.poll() is not None:
                logs = "\n".join(x.tail() for x in started)
                pytest.fail(f"exited with {s.popen.returncode} while starting: {s.text}\n{logs}")
        for s in list(waiting):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{s.port}/health", timeout=5).status_code == 200:
                    waiting.remove(s)
        if time.monotonic() > deadline:
            logs = "\n".join(x.tail() for x in started)
            pytest.fail(f"not ready after {START_TIMEOUT_S:.0f} s:\n{logs}")
        time.sleep(0.5)


def _one_completion(url: str, pooling: bool = False) -> None:
    """A completion, or on a ``--runner pooling`` server (no generation) an embedding."""
    models = httpx.get(f"{url}/v1/models", timeout=30)
    assert models.status_code == 200, models.text
    if pooling:
        body = {"model": models.json()["data"][0]["id"], "input": "The capital of France is"}
        r = httpx.post(f"{url}/v1/embeddings", json=body, timeout=CLIENT_TIMEOUT_S)
        assert r.status_code == 200, r.text
        assert len(r.json()["data"][0]["embedding"]) > 0
        return
    body = {
        "model": models.json()["data"][0]["id"],
        "prompt": "The capital of France is",
        "max_tokens": 4,
        "temperature": 0,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S)
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out["choices"][0]["text"], str)
    assert out["usage"]["completion_tokens"] >= 1, out


def _run_client(argv: list[str], what: str) -> None:
    run = subprocess.run(
        argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S
    )
    assert run.returncode == 0, f"{what}: exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    assert run.stdout.strip(), f"{what}: no output\n{run.stderr}"
    with contextlib.suppress(ValueError):
        out = json.loads(run.stdout)
        assert not (isinstance(out, dict) and "error" in out), f"{what}: {run.stdout}"


def _stop(started: list[Started]) -> None:
    """SIGTERM each launcher, the front first; headless nodes stop when node 0 goes away."""
    front = [s for s in reversed(started) if s.port is not None]
    headless = [s for s in started if s.port is None]
    for s in front:
        launcher = s.launcher()
        assert launcher is not None, f"no actorserve process for {s.text}\n{s.tail()}"
        launcher.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.popen.wait(STOP_TIMEOUT_S)
    for s in headless:
        try:
            s.popen.wait(30)
        except subprocess.TimeoutExpired:
            if (launcher := s.launcher()) is not None:
                launcher.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.popen.wait(STOP_TIMEOUT_S)
    codes = {s.text: s.popen.poll() for s in started}
    logs = "\n".join(s.tail() for s in started)
    assert all(rc == 0 for rc in codes.values()), f"exit codes after SIGTERM: {codes}\n{logs}"
    deadline = time.monotonic() + 15
    while (left := [p for s in started for p in s.session()]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left after SIGTERM: {[p.cmdline() for p in left]}"


def run_group(group: Group) -> None:
    skip = [f"README line {c.line}: needs {c.needs}" for c in group.commands if c.needs]
    if skip:
        pytest.skip("; ".join(skip))
    taken: set[int] = set()
    ports: dict[int, int] = {}
    for text in [c.text for c in group.commands + group.clients]:
        for p in readme_ports(text):
            ports.setdefault(p, _port_block(taken))
    for p in group.http_ports():
        ports.setdefault(p, _port_block(taken))
    stamp_stale = subprocess.run(["make", "-q", STAMP], cwd=REPO).returncode != 0
    started: list[Started] = []
    began = time.monotonic()
    logdir = Path(tempfile.mkdtemp(prefix="actorserve-readme-"))
    try:
        for k, cmd in enumerate(group.commands):
            port = http_port(cmd)
            text = _substitute(cmd.text, ports)
            if port is not None:
                text = _with_port(cmd, text, ports[port], stamp_stale)
            log = logdir / f"{k}.log"
            with open(log, "wb") as out:
                popen = subprocess.Popen(
                    ["bash", "-c", text],
                    cwd=REPO,
                    env=_env(),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            started.append(Started(cmd, text, popen, log, None if port is None else ports[port]))
        _wait_ready(started)
        ready_s = time.monotonic() - began
        front = [s for s in started if s.port is not None][-1]
        _one_completion(f"http://127.0.0.1:{front.port}", "--runner pooling" in front.text)
        for client in group.clients:
            _run_client(["bash", "-c", _substitute(client.text, ports)], client.text)
        for block in group.python_clients:
            with tempfile.NamedTemporaryFile("w", suffix=".py", dir=logdir, delete=False) as f:
                f.write(_substitute(block.text, ports))
            _run_client([str(REPO / ".venv/bin/python"), f.name], f"python at line {block.line}")
        stopping = time.monotonic()
        _stop(started)
        print(
            f"{group.id}: ready in {ready_s:.1f} s, clients done {stopping - began:.1f} s, "
            f"stopped in {time.monotonic() - stopping:.1f} s"
        )
    finally:
        for s in started:
            s.kill()


def _default_run(groups: list[Group]) -> set[int]:
    """The groups ``make test`` runs: the first (make serve) and the first with -tp."""
    chosen = {0}
    for k, g in enumerate(groups):
        if any("-tp" in (actorserve_args(c.argv) or []) for c in g.commands):
            chosen.add(k)
            break
    return chosen


@pytest.mark.parametrize(
    "group",
    [
        pytest.param(g, id=g.id, marks=() if k in _default_run(PARSED.groups) else pytest.mark.slow)
        for k, g in enumerate(PARSED.groups)
    ],
)
def test_readme_server_command_runs(group: Group) -> None:
    assert (REPO / ACTORSERVE).is_file(), "make install first"
    assert sys.platform.startswith("linux")
    run_group(group)
