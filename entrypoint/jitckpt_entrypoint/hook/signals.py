"""The flag-only SIGTERM handler of a training process.

Installed when training starts (not at interpreter start: before training a SIGTERM should
simply end the process) and restored when it ends. The handler only records the time; the
work happens at the next optimizer step boundary. Forked children (DataLoader workers) inherit
the Python handler: for them it behaves like the handler we replaced.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType
from typing import Any, Optional


class SigtermFlag:
    def __init__(self, label: str = "jitckpt-hook") -> None:
        self.received_at: Optional[float] = None
        self._label = label
        self._previous: Any = None
        self._owner: Optional[int] = None

    @property
    def is_set(self) -> bool:
        return self.received_at is not None

    @property
    def installed(self) -> bool:
        return self._owner == os.getpid() and signal.getsignal(signal.SIGTERM) == self._handle

    def install(self) -> bool:
        """Install the handler (main thread only); False when it cannot be installed here."""
        if self.installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._owner = os.getpid()
        return True

    def restore(self) -> None:
        """Put back the handler we replaced."""
        if self.installed:
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            signal.signal(signal.SIGTERM, previous)
        self._owner = None

    def _handle(self, signo: int, frame: Optional[FrameType]) -> None:
        if os.getpid() != self._owner:
            self._as_before(signo, frame)
            return
        if self.received_at is None:
            self.received_at = time.time()
            # A plain write: the logging module's locks are not safe in a signal handler.
            msg = f"{self._label}: SIGTERM received; stopping at the next optimizer step boundary\n"
            os.write(2, msg.encode())

    def _as_before(self, signo: int, frame: Optional[FrameType]) -> None:
        previous = self._previous
        if callable(previous):
            previous(signo, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signo, signal.SIG_DFL)
            os.kill(os.getpid(), signo)
