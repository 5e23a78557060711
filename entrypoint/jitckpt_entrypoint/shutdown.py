"""SIGTERM reaches every training process, whatever launches it; PID 1 waits for their save.

The supervisor forwards SIGTERM to its child (the training command). This watch also sends it,
once, to every process registered in the run's registry (registry.py): the training processes
under launchers that die of SIGTERM without passing it on (accelerate's simple launcher, so
`trl sft`; `sh -c` without `exec`) or ignore it. Processes that register after SIGTERM (they
were still loading) get it as soon as they do.

After the child has exited, supervision goes on while registered training processes still run
(they are saving and committing their JIT checkpoint), until KILL_MARGIN before the end of the
grace period (time to write the termination message). And once every training process is gone
with a JIT checkpoint committed, a launcher that ignores SIGTERM gets LINGER_SECONDS to exit
before the entrypoint stops waiting for it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Callable, Optional

from jitckpt_entrypoint.config import Config
from jitckpt_entrypoint.protocol import registry, status
from jitckpt_entrypoint.supervisor import ChildExit, signal_name

POLL_SECONDS = 0.1
"""After SIGTERM: how often the registry is read (new registrants, who is still saving)."""
LINGER_SECONDS = 5.0
"""How long a child that ignores SIGTERM may outlive the committed JIT checkpoint."""
KILL_MARGIN = 1.0
"""Stop waiting this long before Kubernetes' SIGKILL, to write the termination message."""


class Shutdown:
    """The entrypoint's `supervisor.Watch`."""

    def __init__(
        self,
        cfg: Config,
        status_dir: str,
        run_id: str,
        logger: logging.Logger,
        *,
        on_sigterm: Callable[[float], None] = lambda _: None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        linger: float = LINGER_SECONDS,
    ) -> None:
        self.cfg, self.status_dir, self.run_id, self.log = cfg, status_dir, run_id, logger
        self.on_sigterm = on_sigterm
        self.clock, self.monotonic, self.linger = clock, monotonic, linger
        self.child_pid: Optional[int] = None
        self.sigterm_at: Optional[float] = None
        """Unix time of the first SIGTERM."""
        self._deadline = 0.0
        self._signalled: set[tuple[int, int]] = set()
        self._idle_since: Optional[float] = None
        self._said_waiting = False

    # -- supervisor.Watch --

    def started(self, pid: int) -> None:
        self.child_pid = pid

    def signalled(self, signo: int) -> None:
        if signo != signal.SIGTERM:
            self.log.info("forwarding %s to the training command", signal_name(signo))
            return
        if self.sigterm_at is not None:
            sent = self._signal_trainers()
            self.log.info(
                "SIGTERM again: forwarded to the training command%s",
                f" and sent to new training processes {_pids(sent)}" if sent else "",
            )
            return
        self.sigterm_at = self.clock()
        self._deadline = self.monotonic() + max(1.0, self.cfg.grace_seconds - KILL_MARGIN)
        self.on_sigterm(self.sigterm_at)
        self._signal_trainers()
        self.log.info("%s", self.describe())

    def poll_interval(self) -> Optional[float]:
        return None if self.sigterm_at is None else POLL_SECONDS

    def done(self, child: Optional[ChildExit]) -> bool:
        if self.sigterm_at is None:
            if child is not None:
                orphans = self._alive(registry.TRAINER)
                if orphans:  # a launcher that crashed under its workers: they end with us
                    self.log.warning(
                        "the training command ended (%s) while training processes %s still "
                        "run; they end with this container",
                        child.describe(),
                        _pids(orphans),
                    )
            return child is not None
        self._signal_trainers()  # late registrants: they were still loading at SIGTERM
        training = self._alive(registry.TRAINER)
        if child is not None:
            return self._child_gone(child, training)
        # The child still runs. Without a committed JIT checkpoint that is its business (torchrun
        # is still shutting its workers down): wait, as before, until it exits or the pod's
        # SIGKILL. With one, and every training process gone, only a launcher that ignores
        # SIGTERM is left: it gets LINGER_SECONDS.
        now = self.monotonic()
        if training or status.read_jit(self.status_dir, self.run_id) is None:
            self._idle_since = None
            return False
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since < self.linger:
            return False
        self.log.warning(
            "the training command (pid %s) still runs %.0f s after every training process "
            "committed its JIT checkpoint and exited (it ignores SIGTERM); not waiting for it",
            self.child_pid,
            now - self._idle_since,
        )
        return True

    # -- helpers --

    def _child_gone(self, child: ChildExit, training: list[registry.Entry]) -> bool:
        if not training:
            return True
        if self.monotonic() >= self._deadline:
            self.log.warning(
                "the grace period (JITCKPT_GRACE_SECONDS=%d) is ending with training processes "
                "%s still running; exiting before Kubernetes SIGKILLs the pod",
                self.cfg.grace_seconds,
                _pids(training),
            )
            return True
        if not self._said_waiting:
            self._said_waiting = True
            left = self._deadline - self.monotonic()
            self.log.info(
                "the training command ended (%s); waiting for training processes %s to save and "
                "commit their JIT checkpoint (at most %.0f s more)",
                child.describe(),
                _pids(training),
                left,
            )
        return False

    def _entries(self) -> list[registry.Entry]:
        return registry.entries(self.status_dir, self.run_id)

    def _alive(self, role: str) -> list[registry.Entry]:
        return [e for e in self._entries() if e.role == role and e.alive()]

    def _signal_trainers(self) -> list[registry.Entry]:
        """SIGTERM, once, to every live training process but the child (it had it forwarded)."""
        sent = []
        for entry in self._alive(registry.TRAINER):
            key = (entry.pid, entry.start_time)
            if key in self._signalled:
                continue
            self._signalled.add(key)
            if entry.pid == self.child_pid:
                continue
            try:
                os.kill(entry.pid, signal.SIGTERM)
            except OSError as exc:  # gone since the check, or not ours to signal
                self.log.debug("cannot SIGTERM training process %d: %s", entry.pid, exc)
                continue
            sent.append(entry)
        return sent

    def describe(self) -> str:
        """The SIGTERM line: who got the signal and what ends the shutdown, as it runs now."""
        entries = [e for e in self._entries() if e.alive()]
        trainers = [e for e in entries if e.role == registry.TRAINER]
        agents = [e for e in entries if e.role == registry.TORCHRUN]
        child = f"the training command (pid {self.child_pid})"
        if not self.cfg.jit:  # training processes register for the JIT checkpoint only
            line = f"SIGTERM: forwarded to {child}; JITCKPT_JIT=0: no JIT checkpoint"
        elif not trainers:
            line = (
                f"SIGTERM: forwarded to {child}; no process is training under jitckpt (not "
                "yet, or not since training ended), so there is no JIT checkpoint to save"
            )
        elif [e.pid for e in trainers] == [self.child_pid]:
            line = (
                f"SIGTERM: forwarded to {child}, which is the training process; it saves a JIT "
                "checkpoint at the next optimizer step boundary"
            )
        else:
            line = (
                f"SIGTERM: forwarded to {child} and sent to its training processes "
                f"{_pids(trainers)}; they save a JIT checkpoint at the next optimizer step boundary"
            )
        for agent in agents:
            line += (
                f"; torchrun (pid {agent.pid}) SIGKILLs its workers {agent.shutdown_timeout} s "
                "after SIGTERM"
            )
        return (
            f"{line}; Kubernetes SIGKILLs the pod {self.cfg.grace_seconds} s after SIGTERM "
            "(JITCKPT_GRACE_SECONDS)"
        )


def _pids(entries: list[registry.Entry]) -> str:
    return ", ".join(str(e.pid) for e in entries)
