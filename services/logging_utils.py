"""Logging in vLLM's format (``INFO 11-29 17:02:03 [file.py:42] message``), one setup per process.

Modules log through ``logging.getLogger(__name__)`` (or ``init_logger``); the
first ``init_logger`` call in a process attaches one stderr handler to the
project's top-level packages, at the level ACTORSERVE_LOGGING_LEVEL (INFO).
Every line of a record carries the prefix: a message or traceback of several
lines is written as that many prefixed lines (vLLM's ``NewLineFormatter``).

``configure_process_logging`` (the router, the PD proxy) writes everything else the
process logs in the same format too: uvicorn's lines (``use_for_uvicorn``, once
uvicorn has set up its loggers) and other libraries' warnings.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_DATEFMT = "%m-%d %H:%M:%S"
_PACKAGES = ("services", "launch", "actorserve_kernels", "bench")
_configured = False


class PrefixedFormatter(logging.Formatter):
    """The format above, with each further line of a record prefixed as its first one."""

    def __init__(self) -> None:
        super().__init__(_FORMAT, datefmt=_DATEFMT)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if "\n" not in text:
            return text
        head = self.formatMessage(record)  # the prefix, then the message
        prefix = head[: len(head) - len(record.message)]
        first, *rest = text.split("\n")
        return "\n".join([first, *(prefix + line for line in rest)])


def _stderr_handler() -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(PrefixedFormatter())
    return handler


def init_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        handler = _stderr_handler()
        level = os.environ.get("ACTORSERVE_LOGGING_LEVEL", "INFO").upper()
        for package in _PACKAGES:
            top = logging.getLogger(package)
            top.addHandler(handler)
            top.setLevel(level)
        _configured = True
    return logging.getLogger(name)


class _OthersHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The root logger's handler: what the project's packages log has its own handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        top = record.name.partition(".")[0]
        return top not in _PACKAGES and super().filter(record)


def configure_process_logging() -> None:
    """Every line of this process in the format above: the project's packages (at
    ACTORSERVE_LOGGING_LEVEL), and through the root logger every other library's
    warnings and errors (httpx's per-request lines stay off). Idempotent."""
    init_logger(__name__)
    root = logging.getLogger()
    if not any(isinstance(h, _OthersHandler) for h in root.handlers):
        handler = _OthersHandler(sys.stderr)
        handler.setFormatter(PrefixedFormatter())
        root.addHandler(handler)
    logging.getLogger("httpx").setLevel(logging.WARNING)


def use_for_uvicorn(access_log: bool = False) -> None:
    """uvicorn's lines in this format: call it once uvicorn has set up its loggers (in the
    app's lifespan: ``uvicorn.Config`` sets them up, replacing earlier handlers). Its
    lines go to the root logger's handler (``configure_process_logging``), at the level
    uvicorn was given. ``access_log`` False: uvicorn's own access lines are dropped
    (``services/http/middleware.py:AccessLogMiddleware`` writes one per request)."""
    for name in ("uvicorn", "uvicorn.error", "uvicorn.asgi"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    access = logging.getLogger("uvicorn.access")
    access.handlers.clear()
    access.propagate = access_log
