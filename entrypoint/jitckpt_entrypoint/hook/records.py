"""The status records one training process writes for its node's sidecar and the entrypoint.

Each node's local rank 0 writes them (protocol/status.py): node.json (which node, what the
trainer keeps), the first step and progress (recovery time, work at risk), a save's start (the
sidecar's save-peak sampler), the output_dir of the final model, why training stopped before
it began, the JIT checkpoint. They are advisory: a record that cannot be written (a full disk)
is one line in the log, never an error in training; the checkpoints are what count.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Optional

from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.layout import checkpoint_name


class Records:
    def __init__(self, session: Session) -> None:
        self.session = session
        self._lock = threading.Lock()
        self._save_total_limit = session.cfg.save_total_limit
        self._best_step: Optional[int] = None
        self._announced: Optional[status.NodeStatus] = None
        self._first_step_recorded = False
        """The first optimizer step of this process is in status/first-step.json."""
        self._progress_at = -status.PROGRESS_SECONDS
        """When status/progress.json was last written (monotonic)."""

    @property
    def _writes(self) -> bool:
        return self.session.topo.is_leader and bool(self.session.run_id)

    def retention(
        self, *, save_total_limit: Optional[int] = None, best_step: Optional[int] = None
    ) -> None:
        """What the trainer keeps, for node.json (see `announce`)."""
        with self._lock:
            if save_total_limit is not None:
                self._save_total_limit = save_total_limit
            if best_step is not None:
                self._best_step = best_step

    def announce(self) -> None:
        """Tell this node's sidecar which node it is and what the trainer keeps (node.json):
        it deletes the other nodes' parts of what HF's rotation (process 0 only) deletes here.
        Raises OSError (see `advisory`)."""
        session = self.session
        if not session.topo.is_leader:
            return
        with self._lock:  # the training thread and the background writer: the newest wins
            node = status.NodeStatus(
                session.run_id,
                session.topo.node,
                session.topo.nodes,
                self._save_total_limit,
                self._best_step,
            )
            if node != self._announced:
                status.NODE.write(session.layout.status, node)
                self._announced = node

    def step_finished(self, step: int, began_at: int, in_ram: bool = False) -> None:
        """After an optimizer step: the first of this process for the sidecar's recovery time
        (training began at `began_at`, from a snapshot `in_ram`), then progress.json at most
        once every
        PROGRESS_SECONDS for the work at risk."""
        session = self.session
        if not self._writes:
            return
        now = time.time()
        try:
            if not self._first_step_recorded:
                self._first_step_recorded = True
                first = status.FirstStep(session.run_id, began_at, now, in_ram)
                status.FIRST_STEP.write(session.layout.status, first)
            tick = time.monotonic()  # a wall clock set back must not stop the records
            if tick - self._progress_at >= status.PROGRESS_SECONDS:
                self._progress_at = tick
                status.PROGRESS.write(
                    session.layout.status, status.Progress(session.run_id, step, now)
                )
        except Exception as exc:  # noqa: BLE001 - only metrics depend on them
            session.log.debug("status records not written for step %d: %s", step, exc)

    def save_started(self, step: int, started_at: float) -> None:
        """The sidecar samples the volume from here until the commit."""
        session = self.session
        if session.topo.is_leader:
            start = status.SaveStart(session.run_id, step, started_at)
            self.advisory(status.SAVING.write, session.layout.status, start)

    def output(self, output_dir: str, step: int) -> None:
        """The output_dir whose content becomes the final model after exit 0 (world rank 0)."""
        session = self.session
        if not session.run_id:
            return
        record = status.OutputRecord(session.run_id, os.path.abspath(output_dir), step, time.time())
        try:
            status.OUTPUT.write(session.layout.status, record)
        except OSError as exc:  # the model is still saved; only its upload is lost
            session.log.warning("cannot record output_dir for the final model: %s", exc)

    def refusal(self, message: str) -> None:
        """Training stops before it begins: the one line for the entrypoint's termination
        message."""
        session = self.session
        if not self._writes:
            return
        try:
            status.REFUSAL.write(session.layout.status, status.Refusal(session.run_id, message))
        except OSError as exc:  # the traceback still says it
            session.log.warning("cannot record why training stopped: %s", exc)

    def jit(
        self,
        step: int,
        save_seconds: float,
        *,
        peer_lost_at: Optional[float] = None,
        any_rank: bool = False,
    ) -> None:
        """A JIT checkpoint of this run is committed (the entrypoint's report, the sidecar);
        recorded by the node's local rank 0, or (`any_rank`) by the survivor that saved it
        after a peer was lost at `peer_lost_at` (survivors.py)."""
        session = self.session
        if not (session.topo.is_leader or any_rank):
            return
        record = status.JitRecord(
            run_id=session.run_id,
            step=step,
            checkpoint=checkpoint_name(step),
            committed_at=time.time(),
            sigterm_at=session.flag.received_at,
            save_seconds=save_seconds,
            peer_lost_at=peer_lost_at,
        )
        self.advisory(status.write_jit, session.layout.status, record)
        after = record.trigger_to_commit
        if peer_lost_at is not None:
            lost = record.committed_at - peer_lost_at
            when = f" by the survivors {lost:.2f} s after a peer was lost"
        else:
            when = "" if after is None else f" {after:.2f} s after SIGTERM"
        session.log.info("JIT checkpoint %s committed%s", record.checkpoint, when)

    def advisory(self, write: Callable[..., object], *args: Any) -> None:
        """Write a status file: a failure (a full disk) is one warning, never an error in
        training (the checkpoint itself is what counts)."""
        try:
            write(*args)
        except OSError as exc:
            self.session.log.warning("cannot write a status file: %s", exc)
