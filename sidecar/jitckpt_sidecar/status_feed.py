"""Follow the trainer side's status files: save events and JIT records feed the checkpoint
metrics; trainer.json tells the drain whether the trainer has exited."""

from __future__ import annotations

import os
from typing import Optional

from jitckpt_entrypoint.protocol import status
from jitckpt_sidecar.metrics import CheckpointMetrics


class StatusFeed:
    def __init__(self, status_dir: str, metrics: CheckpointMetrics) -> None:
        self.dir = status_dir
        self.metrics = metrics
        self._seen: dict[str, float] = {}
        """save-event file name -> committed_at already counted."""
        self._jit_seen: Optional[tuple[str, float]] = None

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

    def trainer(self) -> Optional[status.TrainerStatus]:
        """trainer.json (started, SIGTERM received at, exited at), None before the first run."""
        return status.read_trainer(self.dir)
