"""Lock files both containers take with flock (the kernel drops a flock when its holder dies):
staging's (commit.staging_lock) and the trainer's (trainer_lock.py)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from typing import Callable, Optional


def open_lock(path: str) -> Optional[int]:
    """The lock file, for writing where allowed (NFS's emulated flock needs it), made writable
    by the other container's user (the trainer and the sidecar may run as different users)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:
        try:
            return os.open(path, os.O_RDONLY)
        except OSError:
            return None
    except OSError:
        return None
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o666)  # the creator's umask took bits off; not its owner: already set
    return fd


def flock(
    fd: int,
    operation: int,
    deadline: float,
    give_up: Callable[[], bool] = lambda: False,
    poll: float = 0.005,
) -> Optional[bool]:
    """flock `operation` (LOCK_EX or LOCK_SH) on `fd`, tried until `deadline` (monotonic) or
    `give_up()` (asked each time it is found held): True when held, False when it was not,
    None when the filesystem has no locks."""
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() >= deadline or give_up():
                return False
            time.sleep(poll)
        except OSError:  # no locks on this filesystem
            return None
        else:
            return True
