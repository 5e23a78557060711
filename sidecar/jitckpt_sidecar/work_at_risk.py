"""Work at risk: what a failure without notice (node loss, OOM kill) would lose now, in steps
and seconds, against the newest checkpoint committed in S3 and the newest on the volume.

The ledger learns which steps are durable where from the events that feed the other checkpoint
metrics (save events, the start-up restore, uploads); the trainer's side is read at scrape time
from its status files, all of one run:

- `progress.json`: the newest step the trainer finished (rewritten at most once a second);
- `trainer.json` of the same run: it is the running trainer (a progress record of an earlier
  run is never set against a newer run's checkpoints), and when it exited (the clock stops
  there: nothing trains after it, and the work is lost or saved by then);
- `first-step.json` of the same run: the step it began at (resumed from; 0 for a fresh start)
  and when its training began.

The base of a durability is the newest of its durable steps in the run's lineage (saved in this
run, or at or before the step it began at); with none, the step it began at. Seconds count from
the base's save start when a save event of it was seen (this run's or, after a restart in
place, an earlier run's: the time down and restarting is at risk too), else from this run's
first step (a checkpoint restored from S3: the time before was not this pod's training).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

from jitckpt_entrypoint.protocol import status
from jitckpt_sidecar.metric_names import DURABILITIES

S3, VOLUME = DURABILITIES
KEEP = 2 * status.KEEP_SAVE_EVENTS
"""Durable steps remembered per durability (the newest): a base is always among the newest."""


@dataclasses.dataclass(frozen=True)
class Risk:
    steps: int
    seconds: float


class WorkAtRisk:
    """Fed from the main loop (saves, the restore) and the upload worker (uploads); measured
    from the HTTP server's thread: one lock."""

    def __init__(self, status_dir: str, clock: Callable[[], float] = time.time) -> None:
        self.dir, self.clock = status_dir, clock
        self._lock = threading.Lock()
        self._durable: dict[str, set[int]] = {d: set() for d in DURABILITIES}
        self._saves: dict[int, tuple[str, float]] = {}
        """step -> (run id, save start) of the save events seen."""

    def saved(self, event: status.SaveEvent) -> None:
        """checkpoint-<step> is committed on the volume by the trainer (its save event). A
        new save of a step (a run that started over, a job that resumed from an older step)
        is not in S3 until uploaded in its turn: the step number's earlier upload is not it."""
        with self._lock:
            save = (event.run_id, event.started_at)
            if self._saves.get(event.step) != save:
                self._durable[S3].discard(event.step)
            self._saves[event.step] = save
            _keep_newest(self._saves)
            self._add(VOLUME, event.step)

    def on_volume(self, step: int) -> None:
        """checkpoint-<step> is committed on the volume (restored before training)."""
        with self._lock:
            self._add(VOLUME, step)

    def in_s3(self, step: int) -> None:
        """checkpoint-<step> is committed in S3 (uploaded by this sidecar, or restored)."""
        with self._lock:
            self._add(S3, step)

    def _add(self, durability: str, step: int) -> None:
        steps = self._durable[durability]
        steps.add(step)
        if len(steps) > KEEP:
            steps.discard(min(steps))

    def measure(self) -> dict[str, Risk]:
        """Per durability, the work at risk now; empty while no trainer of the progress
        record's run is known (before its first progress, after a newer one started)."""
        progress = status.PROGRESS.read(self.dir)
        if progress is None:
            return {}
        run = progress.run_id
        trainer = status.TRAINER.read(self.dir)
        first = status.FIRST_STEP.read(self.dir)
        if trainer is None or trainer.run_id != run or first is None or first.run_id != run:
            return {}
        now = trainer.exited_at if trainer.exited_at is not None else self.clock()
        began, run_start = first.began_at_step, first.finished_at
        with self._lock:
            own = {step: at for step, (by, at) in self._saves.items() if by == run}
            known = {
                step: at for step, (_, at) in self._saves.items() if step in own or step <= began
            }
            durable = {
                d: [s for s in steps if s in own or s <= began]
                for d, steps in self._durable.items()
            }
        # A save can be newer than progress.json (rewritten once a second): it was reached too.
        newest = max(progress.step, max(own, default=progress.step))
        out = {}
        for durability, steps in durable.items():
            base = max(steps, default=began)
            since = known.get(base, run_start)
            out[durability] = Risk(max(0, newest - base), max(0.0, now - since))
        return out


def _keep_newest(saves: dict[int, tuple[str, float]]) -> None:
    while len(saves) > KEEP:
        del saves[min(saves)]
