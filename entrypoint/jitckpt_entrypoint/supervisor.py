"""PID 1: run one child in its own session, forward signals to it, reap every zombie.

Linear like tini: block the signals we care about, spawn the child with a clean signal mask,
then loop on sigwaitinfo(). SIGCHLD reaps every exited process (orphaned grandchildren are
re-parented to us as PID 1 or as a child subreaper); every other signal is forwarded to the
child. We never escalate: Kubernetes SIGKILLs the pod at the end of the grace period.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from typing import Optional

FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
_PR_SET_CHILD_SUBREAPER = 36

log = logging.getLogger("jitckpt.entrypoint")


@dataclasses.dataclass(frozen=True)
class ChildExit:
    """How the child ended: an exit code, or the signal that killed it."""

    code: Optional[int] = None
    signal: Optional[int] = None

    @property
    def status(self) -> int:
        """The shell convention: the exit code, or 128 + the signal number."""
        if self.code is not None:
            return self.code
        return 128 + (self.signal or 0)

    @classmethod
    def from_wait_status(cls, wait_status: int) -> ChildExit:
        if os.WIFSIGNALED(wait_status):
            return cls(signal=os.WTERMSIG(wait_status))
        return cls(code=os.waitstatus_to_exitcode(wait_status))

    def describe(self) -> str:
        if self.signal is not None:
            return f"killed by {signal_name(self.signal)}"
        return f"exited with code {self.code}"


def signal_name(signo: int) -> str:
    try:
        return signal.Signals(signo).name
    except ValueError:
        return f"signal {signo}"


def become_subreaper() -> bool:
    """Adopt orphaned descendants (as PID 1 does) when we are not PID 1. Linux only."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def supervise(
    executable: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    on_signal: Optional[Callable[[int], None]] = None,
) -> ChildExit:
    """Run `argv` (found at `executable`) to completion while acting as its init."""
    waited = {*FORWARDED, signal.SIGCHLD}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    try:
        pid = os.posix_spawn(
            executable,
            list(argv),
            dict(env),
            setsid=True,  # its own session: a terminal's or our group's signals do not hit it twice
            setsigmask=old_mask,
            # Python ignores SIGPIPE and SIGXFSZ; the child must start with the defaults.
            setsigdef=(*FORWARDED, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD),
        )
        result: Optional[ChildExit] = None
        while result is None:
            info = signal.sigwaitinfo(waited)
            if info.si_signo == signal.SIGCHLD:
                result = reap(pid)
                continue
            if on_signal is not None:
                on_signal(info.si_signo)
            try:
                os.kill(pid, info.si_signo)
            except ProcessLookupError:
                log.warning(
                    "not forwarding %s: the child has already exited", signal_name(info.si_signo)
                )
        reap(pid)  # anything that exited together with the child
        return result
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def reap(child: int) -> Optional[ChildExit]:
    """Collect every exited process; return how `child` ended if it was among them."""
    result = None
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return result
        if pid == 0:
            return result
        if pid == child:
            result = ChildExit.from_wait_status(wait_status)
