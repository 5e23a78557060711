"""Signals handed to a thread, where taking a lock is safe.

A Python signal handler runs in the main thread between two bytecodes, possibly while that
thread holds a lock: an Event's (in `Event.clear()` or before `Event.wait()` blocks), or a
logging handler's. A handler that takes the same lock waits on itself for ever: a SIGTERM that
landed inside the main loop's `Event.clear()` left the sidecar hung without a line (seen in CI).
The handler here only writes the signal's number to a pipe (a system call, no lock); a daemon
thread reads it and calls back, and the callback may set events, log and start threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Optional


def relay(
    signals: Iterable[signal.Signals],
    callback: Callable[[signal.Signals], None],
    logger: logging.Logger,
) -> None:
    """Call `callback(signal)` from a thread for each of `signals` received (main thread only)."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # a full pipe drops the byte, never blocks the handler

    def handler(signo: int, _frame: Optional[FrameType]) -> None:
        with contextlib.suppress(OSError):
            os.write(write_end, bytes([signo]))

    def run() -> None:
        while True:
            for signo in os.read(read_end, 64):
                try:
                    callback(signal.Signals(signo))
                except Exception:  # the next signal must still be handled
                    logger.exception("handling %s failed", signal.Signals(signo).name)

    threading.Thread(target=run, name="jitckpt-signals", daemon=True).start()
    for signo in signals:
        signal.signal(signo, handler)
