"""S3 retention: keep the newest JITCKPT_S3_KEEP committed checkpoints, delete older ones.

Deletion goes manifests first (`Remote.delete`), so a half-deleted checkpoint is never
committed and never restored. The newest committed checkpoint is never deleted (keep >= 1).
Uncommitted leftovers older than the oldest kept checkpoint (an upload whose pod died) go too:
they can never become the newest, and retention would delete them once complete anyway.
"""

from __future__ import annotations

import logging
from typing import Callable

from jitckpt_entrypoint.protocol.layout import checkpoint_name
from jitckpt_sidecar.remote import Remote


class Retention:
    def __init__(
        self,
        remote: Remote,
        keep: int,
        logger: logging.Logger,
        on_deleted: Callable[[int], None] = lambda _: None,
    ) -> None:
        self.remote, self.keep, self.log, self.on_deleted = remote, keep, logger, on_deleted

    def doomed(self) -> list[int]:
        """Steps retention deletes now, oldest first."""
        if self.keep <= 0:
            return []
        steps = self.remote.steps()
        committed = [s for s in steps if self.remote.committed(s) is not None]
        if len(committed) <= self.keep:
            return []
        kept = committed[-self.keep :]
        return [s for s in steps if s < kept[0]]

    def apply(self) -> list[int]:
        """Delete what `doomed` names; returns the steps deleted."""
        deleted = []
        for step in self.doomed():
            objects = self.remote.delete(step)
            deleted.append(step)
            self.on_deleted(step)
            self.log.info(
                "retention: deleted %s from %s (%d objects; JITCKPT_S3_KEEP=%d)",
                checkpoint_name(step),
                self.remote.uri,
                objects,
                self.keep,
            )
        return deleted
