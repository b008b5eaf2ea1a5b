"""Entry point of every child process: ``python -m launch.child ROLE [RANK [DP_RANK]]``.

The ServeConfig arrives as JSON on stdin (no pickle). Each role's code lives
in its own service folder; this module only decodes the configuration, sets
up the guards against outliving the launcher, and calls the role's run
function. A user-facing configuration error prints one ``error:`` line and
exits 2; the launcher then shuts the server down and reports it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import msgspec

from launch.process import watch_parent
from services.config import ConfigError, ServeConfig
from services.logging_utils import init_logger

CONTROL_ENV = "ACTORSERVE_CONTROL"
logger = init_logger(__name__)


def _threads_for_helper_process() -> None:
    """Tokenizer, detokenizer, scheduler and api_server stay lean: the worker gets the cores."""
    # Through the environment, not torch.set_num_threads: most helpers never
    # import torch, and importing it only to set threads costs seconds of CPU
    # per process at start-up.
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def main() -> int:
    role = sys.argv[1]
    rank = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    dp_rank = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    watch_parent()
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=ServeConfig)
    control = os.environ[CONTROL_ENV]
    if role != "api_server":
        # Stopped by the launcher once the api_server has drained: a clean exit.
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the launcher; it decides
    try:
        if role == "worker":
            from services.gpu_worker.worker import run_worker

            run_worker(config, control, rank, dp_rank)
            # Skip the interpreter's teardown: triton's bindings report their module objects
            # as "leaked" at finalization (nanobind), 40 lines of noise after every clean exit.
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
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
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
