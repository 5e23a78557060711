"""Committed checkpoints waiting for upload, handed out newest first (LIFO).

The newest checkpoint is the one a restart would resume from, so it always goes next: a
checkpoint committed while others wait jumps ahead of them. A failure of the store (S3 down,
throttling, refused credentials) pauses the whole backlog: when the pause ends the newest goes
first, however many checkpoints piled up meanwhile. A failure of one checkpoint (its staged
files changed or vanished) backs off that checkpoint only. One preempted (by a newer
checkpoint) comes back at once.

A step can be staged again by another save (a restart resumed below it and saved it anew): the
queue knows each checkpoint by its save (`Staged.save`), not by its step. The newer save takes
the older one's place in the queue; one of them in flight is `replaced`, and its upload stops
(service.py) rather than send the new save's bytes under the old save's manifest.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from jitckpt_sidecar.staging import Staged


class Backlog:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._waiting: dict[int, Staged] = {}
        self._not_before: dict[int, float] = {}
        self._in_flight: Optional[Staged] = None
        self._done: dict[int, tuple[str, float]] = {}
        """step -> the save uploaded (or skipped) by this process."""
        self._paused_until = 0.0
        self._closed = False

    def offer(self, staged: Staged) -> bool:
        """Queue `staged` unless this save of its step is queued, in flight or already done;
        another save of the step waiting is dropped for it. True when added."""
        with self._cond:
            step = staged.step
            if self._done.get(step) == staged.save:
                return False
            waiting = self._waiting.get(step)
            if waiting is not None and waiting.save == staged.save:
                return False
            flying = self._in_flight
            if flying is not None and flying.step == step and flying.save == staged.save:
                return False
            self._waiting[step] = staged
            self._not_before.pop(step, None)
            self._cond.notify_all()
            return True

    def replaced(self, staged: Staged) -> bool:
        """Whether another save of `staged`'s step was offered since (it waits to go next)."""
        with self._cond:
            waiting = self._waiting.get(staged.step)
            return waiting is not None and waiting.save != staged.save

    def take(self, timeout: float) -> Optional[Staged]:
        """The newest waiting checkpoint whose backoff has passed (now in flight), or None."""
        deadline = self._clock() + timeout
        with self._cond:
            while not self._closed:
                now = self._clock()
                ready = [s for s in self._waiting if self._not_before.get(s, 0.0) <= now]
                if ready and self._in_flight is None and now >= self._paused_until:
                    step = max(ready)
                    self._in_flight = self._waiting.pop(step)
                    self._not_before.pop(step, None)
                    return self._in_flight
                if now >= deadline:
                    return None
                waits = [t - now for t in (*self._not_before.values(), self._paused_until)]
                self._cond.wait(timeout=min([deadline - now, *(w for w in waits if w > 0)]))
            return None

    def close(self) -> None:
        """Hand out nothing more; a waiting `take` returns None at once."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def done(self, staged: Staged) -> None:
        """`staged` is committed in S3 (or skipped on purpose): never queue it again."""
        with self._cond:
            self._done[staged.step] = staged.save
            self._release(staged)

    def drop(self, staged: Staged) -> None:
        """`staged` is no longer what its step's staged directory holds: forget it (the save
        that replaced it is offered by the next scan)."""
        with self._cond:
            self._release(staged)
            waiting = self._waiting.get(staged.step)
            if waiting is not None and waiting.save == staged.save:
                self._waiting.pop(staged.step)
                self._not_before.pop(staged.step, None)

    def retry(self, staged: Staged, delay: float) -> None:
        """`staged` failed: queue it again after `delay` seconds (unless another save of its
        step came)."""
        with self._cond:
            self._release(staged)
            if staged.step not in self._waiting:
                self._waiting[staged.step] = staged
                self._not_before[staged.step] = self._clock() + delay
            self._cond.notify_all()

    def pause(self, delay: float) -> None:
        """The store failed: hand out nothing for `delay` seconds (then the newest first)."""
        with self._cond:
            self._paused_until = max(self._paused_until, self._clock() + delay)
            self._cond.notify_all()

    def hurry(self, delay: float) -> None:
        """Cut every pause and backoff to at most `delay` seconds from now (the drain)."""
        with self._cond:
            latest = self._clock() + delay
            self._paused_until = min(self._paused_until, latest)
            for step, when in self._not_before.items():
                self._not_before[step] = min(when, latest)
            self._cond.notify_all()

    def _release(self, staged: Staged) -> None:
        if self._in_flight is not None and self._in_flight.save == staged.save:
            self._in_flight = None
        self._cond.notify_all()

    def forget(self, step: int) -> None:
        """Drop a waiting checkpoint whose staged directory disappeared."""
        with self._cond:
            self._waiting.pop(step, None)
            self._not_before.pop(step, None)

    @property
    def in_flight(self) -> Optional[Staged]:
        with self._cond:
            return self._in_flight

    def waiting(self) -> list[Staged]:
        """Waiting checkpoints, newest first."""
        with self._cond:
            return [self._waiting[s] for s in sorted(self._waiting, reverse=True)]

    def pending(self) -> list[Staged]:
        """Every committed checkpoint not yet in S3: waiting ones and the one in flight."""
        with self._cond:
            items = list(self._waiting.values())
            if self._in_flight is not None:
                items.append(self._in_flight)
        return sorted(items, key=lambda s: s.step, reverse=True)

    def __len__(self) -> int:
        return len(self.pending())

    def idle(self) -> bool:
        with self._cond:
            return not self._waiting and self._in_flight is None

    def lag(self, now: float) -> float:
        """Age of the newest committed checkpoint not yet in S3 (0 when none)."""
        pending = self.pending()
        return max(0.0, now - pending[0].committed_at) if pending else 0.0

    def oldest_age(self, now: float) -> float:
        """Age of the oldest committed checkpoint not yet in S3 (0 when none)."""
        pending = self.pending()
        return max(0.0, now - min(s.committed_at for s in pending)) if pending else 0.0
