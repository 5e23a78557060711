"""S3 retention: keep the newest JITCKPT_S3_KEEP committed checkpoints, delete older ones.

Retention counts the checkpoints of one run (the lineage of what this sidecar uploads) and
never deletes another run's committed checkpoints: a run started over on the prefix
(JITCKPT_RESUME=0) leaves the earlier run's checkpoints where they are (the restore prefers the
newer run; delete them by hand). Nor the checkpoint a restore pinned within the last
PIN_HOLD seconds: other nodes may be restoring it right now.

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
from jitckpt_sidecar.uploader import saved_at


class Retention:
    def __init__(
        self,
        remote: Remote,
        keep: int,
        logger: logging.Logger,
        on_deleted: Callable[[int], None] = lambda _: None,
    ) -> None:
        self.remote, self.keep, self.log, self.on_deleted = remote, keep, logger, on_deleted

    def doomed(self, lineage: str) -> list[int]:
        """Steps retention deletes now for run `lineage`, oldest first: its committed
        checkpoints but the `keep` saved last (by save time, not step: an abandoned attempt's
        higher step is not the newest), and uncommitted leftovers below the oldest kept step."""
        if self.keep <= 0:
            return []
        steps = self.remote.steps()
        ckpts = {s: self.remote.committed(s) for s in steps}
        mine = {s: c for s, c in ckpts.items() if c is not None and c.lineage == lineage}
        if len(mine) <= self.keep:
            return []
        kept = set(sorted(mine, key=lambda s: saved_at(mine[s]))[-self.keep :])
        pinned = self.remote.pinned()
        return [
            s
            for s in steps
            if s not in kept
            and (s in mine or (ckpts[s] is None and s < min(kept)))
            and (pinned is None or pinned.step != s)
        ]

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
