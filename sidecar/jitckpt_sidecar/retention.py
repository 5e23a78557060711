"""S3 retention: keep the newest JITCKPT_S3_KEEP committed checkpoints, delete older ones.

Newest is the one order every part of jitckpt uses (validity.newness: the newest-born lineage,
then the highest step). Retention counts the checkpoints of one lineage (that of what this
sidecar uploads) and keeps its highest steps: a run that resumed below a save of its lineage
began a new lineage (the rollback rule), so within a lineage a higher step is always a later
save. It never deletes another lineage's checkpoints, which are either newer in that order
(a branch or a run started over after this one) or an earlier run or branch that the restore
passes over (delete those by hand, or let the lifecycle rules of the bucket). Nor the
checkpoint a restore pinned within the last PIN_HOLD seconds: other nodes may be restoring it.

Deletion goes manifests first (`Remote.delete`), so a half-deleted checkpoint is never
committed and never restored. The newest committed checkpoint is never deleted (keep >= 1).
Uncommitted leftovers below the oldest kept step go too, when they can never become newer in
that order: every manifest in them is of this lineage, or they have none and nothing in them
was written in the last PIN_HOLD seconds (an upload that may still be going on writes its
files before any manifest, and its lineage is not known until then).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from jitckpt_entrypoint.protocol.layout import checkpoint_name
from jitckpt_sidecar.remote import PIN_HOLD, Remote


class Retention:
    def __init__(
        self,
        remote: Remote,
        keep: int,
        logger: logging.Logger,
        on_deleted: Callable[[int], None] = lambda _: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.remote, self.keep, self.log, self.on_deleted = remote, keep, logger, on_deleted
        self.clock = clock

    def doomed(self, lineage: str) -> list[int]:
        """Steps retention deletes now for lineage `lineage`, oldest first: its committed
        checkpoints but the `keep` highest, and the uncommitted leftovers below the oldest
        kept step that can never become newer (the module docstring)."""
        if self.keep <= 0:
            return []
        steps = self.remote.steps()
        ckpts = {s: self.remote.committed(s) for s in steps}
        mine = {s: c for s, c in ckpts.items() if c is not None and c.lineage == lineage}
        if len(mine) <= self.keep:
            return []
        kept = sorted(mine)[-self.keep :]
        pinned = self.remote.pinned()
        return [
            s
            for s in steps
            if s not in kept
            and (s in mine or (ckpts[s] is None and s < kept[0] and self._leftover(s, lineage)))
            and (pinned is None or pinned.step != s)
        ]

    def _leftover(self, step: int, lineage: str) -> bool:
        """Whether uncommitted checkpoint-<step> is a leftover of `lineage` that can never
        become newer: its manifests all of that lineage, or none and no object written in the
        last PIN_HOLD seconds."""
        ckpt = self.remote.load(step)
        if ckpt.manifests:
            return all(man.lineage == lineage for man in ckpt.manifests.values())
        written = self.remote.last_written(checkpoint_name(step))
        return written is None or self.clock() - written >= PIN_HOLD

    def apply(self, lineage: str) -> list[int]:
        """Delete what `doomed` names; returns the steps deleted. A committed one is looked at
        again first (not from the cache): another node may have saved the step anew since."""
        deleted = []
        for step in self.doomed(lineage):
            cached = self.remote.committed(step)
            if cached is not None:
                now = self.remote.committed(step, refresh=True)
                if now is None or now.save_id != cached.save_id:
                    continue
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
