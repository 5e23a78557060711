"""Signals handed to a thread, where taking a lock is safe.

A Python signal handler runs in the main thread between two bytecodes, possibly while that
thread holds a lock: an Event's (in `Event.clear()` or before `Event.wait()` blocks), or a
logging handler's. A handler that takes the same lock waits on itself for ever: a SIGTERM that
landed inside the main loop's `Event.clear()` left the sidecar hung without a line (seen in CI).
Here the interpreter's C-level handler writes the signal's number to a pipe
(`signal.set_wakeup_fd`: at once, even while the main thread is blocked in a system call), the
Python handler does nothing, and a daemon thread reads the pipe and calls back; the callback may
set events, log and start threads.

Installed first thing: a container's PID 1 without a handler drops SIGTERM, so one that came
while the sidecar connects to S3 would be lost. Signals that come before the callback is set
are handed to it when it is.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Optional

Callback = Callable[[signal.Signals], None]


class Relay:
    def __init__(self, signals: Iterable[signal.Signals], logger: logging.Logger) -> None:
        """Take over `signals` (main thread only)."""
        self._signals = frozenset(signals)
        self._log = logger
        self._lock = threading.Lock()
        self._calling = threading.Lock()  # `to()` replays while the thread may call: one at a time
        self._callback: Optional[Callback] = None
        self._early: list[signal.Signals] = []
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)  # as set_wakeup_fd requires: a full pipe drops a byte
        threading.Thread(
            target=self._run, args=(read_end,), name="jitckpt-signals", daemon=True
        ).start()
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        for signo in self._signals:
            signal.signal(signo, _nothing)

    def to(self, callback: Callback) -> None:
        """From now on call `callback(signal)`, first for the signals that came before."""
        with self._lock:
            self._callback, early, self._early = callback, self._early, []
        for signum in early:
            self._call(callback, signum)

    def _run(self, read_end: int) -> None:
        while True:
            for signo in os.read(read_end, 64):
                if signo not in self._signals:
                    continue  # another handler's (none today): its Python handler runs anyway
                signum = signal.Signals(signo)
                with self._lock:
                    callback = self._callback
                    if callback is None:
                        self._early.append(signum)
                if callback is not None:
                    self._call(callback, signum)

    def _call(self, callback: Callback, signum: signal.Signals) -> None:
        with self._calling:
            try:
                callback(signum)
            except Exception:  # noqa: BLE001 - the next signal must still be handled
                self._log.exception("handling %s failed", signum.name)


def _nothing(_signo: int, _frame: object) -> None:
    """The Python handler: the work is the relay thread's (set_wakeup_fd wrote the number)."""
