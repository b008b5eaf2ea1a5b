"""Logging in vLLM's format (``INFO 11-29 17:02:03 [file.py:42] message``), one setup per process."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_configured = False


def init_logger(name: str) -> logging.Logger:
    """A logger under the ``actorserve`` root, which logs to stderr at ACTORSERVE_LOGGING_LEVEL."""
    global _configured
    if not _configured:
        root = logging.getLogger("actorserve")
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("ACTORSERVE_LOGGING_LEVEL", "INFO").upper())
        root.propagate = False
        _configured = True
    return logging.getLogger(f"actorserve.{name}")
