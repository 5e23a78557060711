"""A save asked for from outside training: status/save-ask.json, answered in save-answer.json.

The sidecar writes an ask when the cluster gives notice before SIGTERM (a node cordoned or
tainted for deletion, a pod's DisruptionTarget condition): a save now has its bytes in S3
before SIGTERM comes, and the JIT save then adds only the steps since. Each node's sidecar
writes into its own volume, so each node's local rank 0 looks (a stat at most once a second:
nothing per step) and an ask rides in the next step agreement like a time-based save's token
(control.py): every rank saves the same step. The answer names that step; an ask is answered
once (its id), and a save that began meanwhile (a `save_steps` save, the JIT save on SIGTERM)
answers it too. An ask from before this process started is not this trainer's: the one before
it saved for it, or crashed, and this one resumes from the newest save (nothing new to save).

The agreement runs when JIT or a time-based save is on (the defaults): with JITCKPT_JIT=0 and
no interval, asks are not read. Never raises into training: an ask that cannot be read is none.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.protocol import status

CHECK_SECONDS = 1.0
"""How often a node's local rank 0 looks for an ask (notices come tens of seconds ahead)."""


class SaveAsks:
    def __init__(self, session: Session) -> None:
        self.session = session
        self._reads = session.topo.is_leader
        self._born = _process_start()
        self._next_check = 0.0
        self._seen: Optional[tuple[int, int]] = None
        """(mtime_ns, size) of the ask file last read."""
        self._answered: Optional[str] = None
        """The id of the last ask answered (read from the answer file when first needed)."""
        self.pending: Optional[status.SaveAsk] = None
        """An ask read and not yet answered."""

    def asked(self, now: float) -> bool:
        """On every rank after each optimizer step (monotonic `now`): whether an ask is waiting
        for its save. Only a node's local rank 0 reads asks."""
        if self.pending is None and self._reads and now >= self._next_check:
            self._next_check = now + CHECK_SECONDS
            try:
                self.pending = self._new_ask()
            except Exception as exc:  # noqa: BLE001 - an ask it cannot read is none, never an error
                self._reads = False
                self.session.log.warning("cannot read a save asked for (%r): asks not read", exc)
            if self.pending is not None:
                self.session.log.info(
                    "a save is asked for now (%s): at the next agreed step", self.pending.reason
                )
        return self.pending is not None

    def _new_ask(self) -> Optional[status.SaveAsk]:
        """The ask in the file when it changed since the last look and is not answered yet."""
        directory = self.session.layout.status
        try:
            st = os.stat(status.SAVE_ASK.path(directory))
        except OSError:
            return None
        seen = (st.st_mtime_ns, st.st_size)
        if seen == self._seen:
            return None
        self._seen = seen
        ask = status.SAVE_ASK.read(directory)
        if self._answered is None:
            answer = status.SAVE_ANSWER.read(directory)
            self._answered = "" if answer is None else answer.id
        if ask is None or not ask.id or ask.id == self._answered or ask.asked_at < self._born:
            return None
        return ask

    def agreed(self, step: Optional[int]) -> None:
        """Every rank saves `step` now (a periodic or a JIT save): answer the ask waiting."""
        ask, self.pending = self.pending, None
        if ask is None:
            return
        self._answered = ask.id
        answer = status.SaveAnswer(ask.id, -1 if step is None else step, time.time())
        try:
            status.SAVE_ANSWER.write(self.session.layout.status, answer)
        except Exception as exc:  # noqa: BLE001 - the sidecar's timing only, never an error
            self.session.log.warning("cannot answer the save asked for: %r", exc)


def _process_start() -> float:
    """When this process started (wall clock; now where /proc does not say)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()
