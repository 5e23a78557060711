"""Whether the trainer's container still lives, as the sidecar (another container, another PID
namespace) can tell: a flock on `status/trainer.lock`.

- The entrypoint takes it shared before it writes `trainer.json` for its run, and holds it until
  it exits (the kernel drops it however the process ends: an OOM kill of the whole container, a
  SIGKILL); so do the RAM writer it starts and every process that registers with it
  (registry.py: training processes, torchrun agents), since they write to the volume too.
- The sidecar takes it exclusive without waiting. It gets it only when no process that wrote a
  `trainer.json` lives: a run whose record has `locked` set and no `exited_at` is then dead
  without having exited, and whatever the sidecar does meanwhile (ram_rescue.py: the newest
  snapshot written out) no new entrypoint can overlap, since it waits for the lock first.
- Never trusted when the record does not say `locked` (an entrypoint that could not take it,
  one of an older version), nor when another pod's entrypoint holds it (a shared volume): the
  sidecar then waits for `exited_at` as before. On NFS, flock is emulated with POSIX locks
  (lockd): taken across clients, or, mounted `nolock`/`local_lock=flock`, per client only, where
  another pod's entrypoint is not seen (keep JITCKPT_DIR on the pod's own emptyDir).
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from typing import Callable, Optional

from jitckpt_entrypoint.protocol import locks

NAME = "trainer.lock"
POLL = 0.1
"""Seconds between tries while the entrypoint waits for the sidecar's exclusive hold."""


def path(status_dir: str) -> str:
    return os.path.join(status_dir, NAME)


def hold(
    status_dir: str,
    patience: float,
    waiting: Callable[[], None],
    give_up: Callable[[], bool] = lambda: False,
) -> Optional[int]:
    """The shared lock, held until the process exits (the descriptor is not inherited by what
    it runs). Waits at most `patience` seconds, or until `give_up()`, for an exclusive holder
    (the sidecar writing a dead run's snapshot out), calling `waiting()` once if it must wait.
    None when it cannot be taken: the entrypoint's record must then not say `locked`."""
    fd = locks.open_lock(path(status_dir))
    if fd is None:
        return None
    said: list[bool] = []

    def stop() -> bool:
        if not said:
            said.append(True)
            waiting()
        return give_up()

    if locks.flock(fd, fcntl.LOCK_SH, time.monotonic() + patience, stop, POLL):
        return fd
    os.close(fd)
    return None


def take_if_gone(status_dir: str) -> Optional[int]:
    """The sidecar: the lock held exclusively (close the descriptor to let go) when nothing
    holds it: no entrypoint nor RAM writer lives on this volume. None when one does, or when
    there is no lock (no entrypoint that takes it ever ran here)."""
    # Read-only first: closing a file opened for writing is an inotify event (IN_CLOSE_WRITE)
    # that would wake the sidecar's own loop. NFS's emulated flock wants it writable (EBADF).
    for mode in (os.O_RDONLY, os.O_RDWR):
        try:
            fd = os.open(path(status_dir), mode | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EBADF, errno.ENOLCK):
                return None
        else:
            return fd
    return None
