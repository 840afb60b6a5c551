"""The form of the engine's log lines where a program asks to see them
(`rollout-engine --log-level`, the HTTP server's own lines): time, level,
logger, message, on stderr."""
from __future__ import annotations

import logging
import sys

LEVELS = ("debug", "info", "warning", "error")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATEFMT = "%H:%M:%S"


def show_logs(level: str) -> None:
    """The engine's log lines ("rollout_engine") from `level` on, to stderr,
    in FORMAT (by default Python shows only warnings and errors, bare)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, DATEFMT))
    log = logging.getLogger("rollout_engine")
    log.handlers[:] = [handler]
    log.setLevel(level.upper())
    log.propagate = False
