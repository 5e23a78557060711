"""Follow the trainer side's status files: save events and JIT records feed the checkpoint
metrics; first-step.json ends a recovery (its time, source and bytes); trainer.json tells the
drain whether the trainer has exited.

A recovery is timed from the pod's start (this sidecar's start: its restore comes first) for
the first trainer (the init container's start when `jitckpt-sidecar restore` ran as one), and
from the trainer container's own start for later ones (restarted in the pod: the volume has the
checkpoint). A restarted sidecar (`status/sidecar-started` exists) times only the trainer
restarts after its own start. A run that began at step 0 is labelled `none`, one that resumed
from a snapshot in RAM `ram` (`peer` when this pod's start restored it from the peer replica)."""

from __future__ import annotations

import logging
import os
from typing import Optional

from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.layout import checkpoint_name
from jitckpt_sidecar.metrics import CheckpointMetrics, RecoveryMetrics

_SOURCES = {
    "s3": "restored from S3",
    "local": "from the volume",
    "ram": "a snapshot in RAM",
    "peer": "a snapshot in RAM from the peer replica",
    "none": "fresh start",
}


class StatusFeed:
    def __init__(
        self,
        status_dir: str,
        metrics: CheckpointMetrics,
        recovery: Optional[RecoveryMetrics] = None,
        logger: Optional[logging.Logger] = None,
    ) -> None:
        self.dir = status_dir
        self.metrics = metrics
        self.recovery, self.log = recovery, logger
        self._seen: dict[str, float] = {}
        """save-event file name -> committed_at already counted."""
        self._jit_seen: Optional[tuple[str, float]] = None
        self._pod: Optional[tuple[float, str, int]] = None
        """(this sidecar's start, its restore's source, bytes) until a pod start is timed."""
        self._started_at = 0.0
        self._first_seen: Optional[str] = None
        self.from_peer: Optional[tuple[int, int]] = None
        """(step, bytes) of the snapshot the peer replica restored at this pod's start."""

    def restored(
        self, pod_start: float, source: str, nbytes: int, *, own_start: float, first: bool
    ) -> None:
        """The start-up restore is done: recoveries can be timed from here on. `first`: this
        is the pod's first sidecar (not a restarted one), whose restore (or the init
        container's, begun at `pod_start`) came before the first trainer."""
        self._started_at = pod_start if first else own_start
        self._pod = (pod_start, source, nbytes) if first else None

    def poll(self) -> None:
        """Count save events and the JIT record not seen before (each exactly once)."""
        names = status.save_event_names(self.dir)
        for name in names:
            event = status.read_save_event(os.path.join(self.dir, name))
            if event is None or self._seen.get(name) == event.committed_at:
                continue
            self._seen[name] = event.committed_at
            self.metrics.saved(event)
        for gone in set(self._seen) - set(names):  # the writer keeps the newest 100
            del self._seen[gone]
        record = status.read_jit(self.dir)
        if record is not None and (record.run_id, record.committed_at) != self._jit_seen:
            self._jit_seen = (record.run_id, record.committed_at)
            self.metrics.jit(record)

        if self.recovery is not None and self._started_at:
            self._time_recovery(self.recovery)

    def _time_recovery(self, recovery: RecoveryMetrics) -> None:
        first = status.FIRST_STEP.read(self.dir)
        if first is None or first.run_id == self._first_seen:
            return
        self._first_seen = first.run_id
        if first.finished_at < self._started_at:
            return  # before this sidecar started: not its to time
        trainer = status.TRAINER.read(self.dir)
        trainer_start = (
            trainer.started_at if trainer is not None and trainer.run_id == first.run_id else None
        )
        if self._pod is not None:
            start, source, nbytes = self._pod
            self._pod, what = None, "the pod's start"
        elif trainer_start is not None and trainer_start >= self._started_at:
            start, source, nbytes, what = trainer_start, "local", 0, "the trainer's restart"
        else:
            return  # a trainer that started before this (restarted) sidecar: not its to time
        if first.began_at_step == 0:
            source, nbytes = "none", 0  # it did not resume (JITCKPT_RESUME=0, nothing saved)
        elif first.in_ram:
            source, nbytes = "ram", 0
            if what == "the pod's start" and self.from_peer is not None:
                peer_step, peer_bytes = self.from_peer
                if peer_step == first.began_at_step:
                    source, nbytes = "peer", peer_bytes
        seconds = first.finished_at - start
        recovery.recovered(seconds, source, nbytes)
        if self.log is not None:
            self.log.info(
                "recovered: %s to the first training step (from %s) in %.1f s (%s%s)",
                what,
                "the start" if first.began_at_step == 0 else checkpoint_name(first.began_at_step),
                seconds,
                _SOURCES.get(source, source),
                f", {nbytes / 1e6:.1f} MB {'copied' if source == 'peer' else 'downloaded'}"
                if nbytes
                else "",
            )

    def trainer(self) -> Optional[status.TrainerStatus]:
        """trainer.json (started, SIGTERM received at, exited at), None before the first run."""
        return status.TRAINER.read(self.dir)
