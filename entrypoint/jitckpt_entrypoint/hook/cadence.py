"""When a time-based periodic save is due: JITCKPT_SAVE_INTERVAL and JITCKPT_SAVE_OVERHEAD.

Risk comes in time, while `save_steps` counts steps: a job whose steps slow down puts more work
at risk between saves. With an interval, a periodic save is due once that long has passed since
the last periodic save began (any: `save_steps`' own reset the clock too). Rank 0's clock
decides: its "due" rides in the next step agreement (control.py), so every rank gets the same
answer at the same step, and the adapter has that step saved.

With an overhead budget (CheckFreq's idea: pick the interval from what a save costs), each
periodic save is measured on this rank: its cost to training is the time it held the training
thread (measured by the manager: the save call and the waits for its host copy; a synchronous
save, all of it) plus how much longer the later steps that overlap its write took than the
median of the steps that overlapped no save (an async write's interference), at most the save's
wall time. The step the save call is in, and any with an evaluation, are not compared. The
interval is cost / budget, at least the time a save takes to be written (one save at a time)
and MIN_INTERVAL (every save is uploaded: a small model's nearly free saves must not go every
second), and at most JITCKPT_SAVE_INTERVAL, which wins over the floor; re-tuned after every save
from a moving average, logged when it changes by more than a tenth. The first save comes after
FIRST_SAVE_SECONDS (or the interval, when shorter): something has to be measured.

No I/O, no collectives; every method runs on the training thread except `save_finished`
(the background writer's commit), which only records a time for the save it names.
"""

from __future__ import annotations

import collections
import logging
import statistics
from typing import Optional

log = logging.getLogger("jitckpt.hook")

FIRST_SAVE_SECONDS = 60.0
"""The budget's first save (no cost is known yet), unless JITCKPT_SAVE_INTERVAL is shorter."""
MIN_INTERVAL = 30.0
"""Seconds: the budget never picks a shorter interval (JITCKPT_SAVE_INTERVAL may)."""
STEP_SAMPLES = 64
"""Recent steps that overlapped no save: their median is the uninterrupted step time."""
SMOOTHING = 0.5
"""Weight of the newest save in the moving averages (the first save's one-off costs fade)."""
LOGGED_CHANGE = 0.1
"""A re-tuned interval is logged when it differs from the last logged one by this much."""


class Cadence:
    def __init__(
        self, interval: Optional[float], overhead: Optional[float], *, rank0: bool = True
    ) -> None:
        self.cap = interval
        """JITCKPT_SAVE_INTERVAL (seconds) or None."""
        self.overhead = overhead
        """JITCKPT_SAVE_OVERHEAD (a fraction) or None."""
        self.interval: Optional[float] = interval
        """The interval in force (the budget's choice, else the cap); None: no time-based saves."""
        if overhead is not None:
            self.interval = min(FIRST_SAVE_SECONDS, interval or FIRST_SAVE_SECONDS)
        self._rank0 = rank0
        self._last: Optional[float] = None
        """When the last periodic save began (or was agreed on), or training started."""
        self._asked = False
        """Rank 0 asked for a save; no second ask until the agreement answers."""
        self._previous: Optional[float] = None
        """When the last step ended."""
        self._clean: collections.deque[float] = collections.deque(maxlen=STEP_SAMPLES)
        self._window: Optional[float] = None
        """When the periodic save being measured began."""
        self._excess = 0.0
        self._skip = False
        """The next step to end holds a save call or an evaluation: not compared."""
        self._measuring = 0
        """The number of the save being measured (`save_began`, `save_finished`)."""
        self._blocked: Optional[float] = None
        """The time the measured save held the training thread (None: all of it)."""
        self._done: Optional[float] = None
        """When that save was committed or abandoned (set by the committing thread)."""
        self.cost: Optional[float] = None
        """Moving average of a save's cost to training, seconds."""
        self.write: Optional[float] = None
        """Moving average of a save's wall time, begin to commit, seconds."""
        self._logged: Optional[float] = None
        self.choices: list[tuple[float, float, float]] = []
        """(cost, write seconds, interval) of every re-tune, in order (benchmarks read it)."""

    @property
    def active(self) -> bool:
        return self.interval is not None

    def describe(self) -> str:
        """The settings in one phrase, for the log line at the start of training."""
        if self.overhead is None:
            return f"every {self.cap:g} s (JITCKPT_SAVE_INTERVAL)"
        cap = "" if self.cap is None else f", at most {self.cap:g} s (JITCKPT_SAVE_INTERVAL)"
        return (
            f"the interval picked from each save's cost for a {self.overhead * 100:g}% budget "
            f"(JITCKPT_SAVE_OVERHEAD){cap}; the first after {self.interval:g} s"
        )

    def started(self) -> None:
        """Training (a `train()` call) starts: the interval counts from its first step's end
        (a resume may first skip through the data for longer than the interval)."""
        self._last, self._previous, self._asked = None, None, False
        self._window, self._done, self._skip = None, None, False

    def due(self, now: float) -> bool:
        """Rank 0, once per step: True once when a save is due (until `agreed`)."""
        if self.interval is None or self._asked or self._window is not None:
            return False
        if self._last is None:
            self._last = now
        if now - self._last < self.interval:
            return False
        self._asked = True
        return True

    def agreed(self, now: float) -> None:
        """Every rank agreed that this step is saved: the interval counts again from now."""
        self._asked, self._last = False, now

    def save_began(self, now: float) -> int:
        """A periodic save of this step begins (whichever rule asked for it); returns the
        number `save_finished` takes (0: this save is not measured, another one is)."""
        self._last = now
        if self._window is not None and self._done is not None:
            self._close()  # the last one was drained by this one, within this step
        if self._window is not None:
            return 0
        self._window, self._excess, self._done, self._skip = now, 0.0, None, True
        self._measuring += 1
        return self._measuring

    def save_finished(self, measured: int, now: float, blocked: Optional[float] = None) -> None:
        """Save `measured` is committed or abandoned (any thread); `blocked`: the seconds it
        held the training thread (None: a synchronous save, all of its time)."""
        if measured and measured == self._measuring and self._window is not None:
            self._blocked = blocked
            self._done = now

    def not_compared(self) -> None:
        """The step now running also evaluates (or the like): its time says nothing of a save."""
        self._skip = True

    def step_ended(self, now: float) -> None:
        """After every optimizer step, on the training thread."""
        previous, self._previous = self._previous, now
        skip, self._skip = self._skip, False
        if self._window is None:
            if previous is not None and not skip:
                self._clean.append(now - previous)
            return
        done = self._done
        if previous is not None and (done is None or previous < done) and not skip:
            took = now - previous  # a step that overlapped the save's write
            base = statistics.median(self._clean) if self._clean else took
            self._excess += max(0.0, took - base)
        if done is not None:
            self._close()

    def _close(self) -> None:
        """The measured save is done: its cost, at most its wall time."""
        began, done, self._window, self._done = self._window, self._done, None, None
        if began is None or done is None:
            return
        wall = max(0.0, done - began)
        blocked = wall if self._blocked is None else self._blocked
        self._measured(min(blocked + self._excess, wall), wall)

    def _measured(self, cost: float, write: float) -> None:
        def average(old: Optional[float], new: float) -> float:
            return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new

        self.cost, self.write = average(self.cost, cost), average(self.write, write)
        if self.overhead is None:
            return
        interval = max(self.cost / self.overhead, self.write, MIN_INTERVAL)
        if self.cap is not None:
            interval = min(interval, self.cap)
        self.interval = interval
        self.choices.append((cost, write, interval))
        logged = self._logged
        if self._rank0 and (logged is None or abs(interval - logged) > LOGGED_CHANGE * logged):
            self._logged = interval
            log.info(
                "save interval %.1f s: a save costs training %.3f s (written in %.1f s); "
                "budget %g%%%s",
                interval,
                self.cost,
                self.write,
                self.overhead * 100,
                "" if self.cap is None else f", at most {self.cap:g} s",
            )
