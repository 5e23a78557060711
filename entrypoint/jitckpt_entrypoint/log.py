"""Logging set-up shared by both components: a component prefix, text or JSON lines; the
one-line termination message."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

FORMATS = ("text", "json")


class _JsonFormatter(logging.Formatter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self._component = component

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "component": self._component,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup(component: str, fmt: str = "text", *, verbose: bool = False) -> logging.Logger:
    """Configure the `jitckpt` logger tree to write to stderr and return the component logger."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter(component))
    else:
        handler.setFormatter(logging.Formatter(f"{component}: %(levelname)s %(message)s"))
    root = logging.getLogger("jitckpt")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False
    return logging.getLogger(f"jitckpt.{component}")


DEFAULT_TERMINATION_LOG = "/dev/termination-log"


def write_termination_log(path: str, line: str) -> None:
    """Write the summary where Kubernetes looks; the default path only when it already exists."""
    if not path:
        return
    flags = os.O_WRONLY | os.O_TRUNC | (0 if path == DEFAULT_TERMINATION_LOG else os.O_CREAT)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        return
    try:
        os.write(fd, (line + "\n").encode())
    except OSError:
        pass
    finally:
        os.close(fd)
