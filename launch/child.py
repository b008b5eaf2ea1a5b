"""Entry point of every child process: ``python -m launch.child ROLE [RANK [DP_RANK]]``.

The ServeConfig arrives as JSON on stdin (no pickle). Each role's code lives
in its own service folder; this module only decodes the configuration, sets
up the guards against outliving the launcher, and calls the role's run
function. A user-facing error (``ConfigError``, or ``ModelLoadError`` from the model
loader) prints one ``error:`` line, no traceback, and exits ``USER_ERROR_EXIT`` (2, the
CLI's status for the same errors); the launcher then shuts the server down, and
``actorserve serve`` exits 2 with that line as its whole report.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import traceback
from typing import NoReturn

import msgspec

from launch.process import STOP_SIGNAL, watch_parent
from services.config import ConfigError, ServeConfig
from services.logging_utils import init_logger

CONTROL_ENV = "ACTORSERVE_CONTROL"
USER_ERROR_EXIT = 2  # a child's exit status after it printed its one-line error
logger = init_logger(__name__)


def is_user_error(e: BaseException) -> bool:
    """A mistake the user fixes (flags, model, memory): ``ConfigError`` or the model
    loader's ``ModelLoadError``, reported as one line. The loader is not imported for this:
    a process that never imported it cannot have raised its error."""
    loader = sys.modules.get("services.model_loader.errors")
    return isinstance(e, ConfigError) or (
        loader is not None and isinstance(e, loader.ModelLoadError)
    )


def _threads_for_helper_process() -> None:
    """Tokenizer, detokenizer, scheduler and api_server stay lean: the worker gets the cores."""
    # Through the environment, not torch.set_num_threads: most helpers never
    # import torch, and importing it only to set threads costs seconds of CPU
    # per process at start-up.
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def _install_signal_handlers(role: str) -> None:
    """``STOP_SIGNAL`` is the launcher stopping this child (the api_server has drained, or
    the engine restarts): exit 0 at once. A worker with a KV connector replaces it to end
    the connector's work first.

    SIGTERM and SIGINT reach a child with its whole process group (Ctrl-C, ``timeout``,
    systemd's ``KillMode=control-group``): the launcher gets them too, drains, then stops
    its children in turn, so a child that exited on its own here would cut the streams the
    drain lets finish and look like a crash. The api_server is the exception: its signal
    handlers (``run_app``) start that drain, and a second signal is ignored there."""
    signal.signal(STOP_SIGNAL, lambda *_: os._exit(0))
    if role != "api_server":
        launcher = os.getppid()
        signal.signal(signal.SIGTERM, lambda *_: _on_sigterm(launcher))
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _on_sigterm(launcher: int) -> None:
    """The launcher decides while it lives; an orphan (its launcher gone before the death
    signal or the death pipe ended it) exits."""
    if os.getppid() != launcher:
        os._exit(0)
    logger.debug("SIGTERM: left to the launcher (pid %d), which stops this process", launcher)


def main() -> int:
    role = sys.argv[1]
    rank = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    dp_rank = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    watch_parent()
    _install_signal_handlers(role)
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=ServeConfig)
    control = os.environ[CONTROL_ENV]
    try:
        if role == "worker":
            from services.gpu_worker.worker import run_worker

            run_worker(config, control, rank, dp_rank)
            return 0
        _threads_for_helper_process()
        if role == "scheduler":
            from services.scheduler.service import run_scheduler

            run_scheduler(config, control, dp_rank)
        elif role == "tokenizer":
            from services.tokenizer.service import run_tokenizer_process

            run_tokenizer_process(config, control)
        elif role == "detokenizer":
            from services.detokenizer.service import run_detokenizer_process

            run_detokenizer_process(config, control)
        elif role == "api_server":
            from services.api_server.process import run_api_server_process

            run_api_server_process(config, control)
        else:
            print(f"error: unknown role {role!r}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        return 0
    except Exception as e:
        if not is_user_error(e):
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    return 0


def _exit_without_teardown(code: int | str | None) -> NoReturn:
    """Exit skipping the interpreter's teardown, after flushing the logs: a child's work is
    done when ``main`` ends (the launcher cleans up after it), and the teardown only adds
    noise: the triton that torch imports reports its bindings' objects as "leaked"
    (nanobind), dozens of lines after every exit."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # sys.exit("message"), as the interpreter would
        code = 1
    logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code or 0)


def _run() -> NoReturn:
    try:
        code: int | str | None = main()
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    _exit_without_teardown(code)


if __name__ == "__main__":
    _run()
