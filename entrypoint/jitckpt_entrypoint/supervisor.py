"""PID 1: run one child in its own session, forward signals to it, reap every zombie.

Linear like tini: block the signals we care about, spawn the child with a clean signal mask,
then loop on sigwaitinfo(). SIGCHLD reaps every exited process (orphaned grandchildren are
re-parented to us as PID 1 or as a child subreaper); every other signal is forwarded to the
child. We never escalate: Kubernetes SIGKILLs the pod at the end of the grace period.

A `Watch` sees every signal after the child got it, is polled while it asks to be, and decides
when supervision ends: the child's exit does not end it while the watch still waits for other
processes (training processes saving after SIGTERM under a launcher that died of it), and it
may end it before the child exits (a launcher that ignores SIGTERM and lingers).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
from collections.abc import Mapping, Sequence
from typing import Optional, Protocol

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


class Watch(Protocol):
    def started(self, pid: int) -> None:
        """The child runs as `pid`."""

    def signalled(self, signo: int) -> None:
        """`signo` arrived (and was forwarded to the child while it ran)."""

    def poll_interval(self) -> Optional[float]:
        """Seconds until `done` must be asked again without a signal; None: only on signals."""

    def done(self, child: Optional[ChildExit]) -> bool:
        """Whether supervision ends now; `child` is how the child ended, None while it runs."""


def supervise(
    executable: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    watch: Optional[Watch] = None,
) -> Optional[ChildExit]:
    """Run `argv` (found at `executable`) while acting as its init, until the child has exited
    and `watch` is done; None when the watch ended supervision with the child still running."""
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
        if watch is not None:
            watch.started(pid)
        result: Optional[ChildExit] = None
        while not _done(watch, result):
            interval = None if watch is None else watch.poll_interval()
            info: Optional[signal.struct_siginfo]
            if interval is None:
                info = signal.sigwaitinfo(waited)
            else:
                info = signal.sigtimedwait(waited, max(0.0, interval))
            if info is None:
                continue
            if info.si_signo == signal.SIGCHLD:
                result = reap(pid) or result
                continue
            if result is None:
                try:
                    os.kill(pid, info.si_signo)
                except ProcessLookupError:
                    log.warning(
                        "not forwarding %s: the child has already exited",
                        signal_name(info.si_signo),
                    )
            if watch is not None:
                watch.signalled(info.si_signo)
        reap(pid)  # anything that exited together with the child
        return result
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _done(watch: Optional[Watch], result: Optional[ChildExit]) -> bool:
    return result is not None if watch is None else watch.done(result)


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
