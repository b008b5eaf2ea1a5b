"""Logging in vLLM's format (``INFO 11-29 17:02:03 [file.py:42] message``), one setup per process.

Modules log through ``logging.getLogger(__name__)`` (or ``init_logger``); the
first ``init_logger`` call in a process attaches one stderr handler to the
project's top-level packages, at the level ACTORSERVE_LOGGING_LEVEL (INFO).
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_PACKAGES = ("services", "launch", "actorserve_kernels", "bench")
_configured = False


def init_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        level = os.environ.get("ACTORSERVE_LOGGING_LEVEL", "INFO").upper()
        for package in _PACKAGES:
            top = logging.getLogger(package)
            top.addHandler(handler)
            top.setLevel(level)
        _configured = True
    return logging.getLogger(name)
