"""Fixtures the unit tests share."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def hook_log() -> Any:
    """What the hook logs (its logger writes to stderr and does not propagate)."""
    import logging

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Collect(logging.INFO)
    logger = logging.getLogger("jitckpt.hook")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)
