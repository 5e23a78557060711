"""Checkpoints staged for upload: `JITCKPT_DIR/staging/checkpoint-<step>/`; and `final/`.

After each local commit the trainer hard-links this node's owned files into the staged
directory, then its own manifest, last (protocol.commit.stage); when a staged directory is
ready for upload is the protocol's rule (protocol.validity.staged). The sidecar removes the
directory (manifest first) once the checkpoint is committed in S3, which frees the bytes when
the Trainer's rotation already deleted the original. The final model (`staging/final/`, one
manifest of kind output, staged by the entrypoint after training) is read by `read_final`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import validity
from jitckpt_entrypoint.protocol.commit import remove_checkpoint, staging_lock
from jitckpt_entrypoint.protocol.layout import Layout, checkpoint_steps


@dataclasses.dataclass(frozen=True)
class Staged:
    """A ready staged checkpoint of this node."""

    path: str
    manifest: m.Manifest
    """This node's manifest (the only one staged)."""

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def name(self) -> str:
        """Its directory's name: checkpoint-<step>, or final."""
        return os.path.basename(os.path.normpath(self.path))

    @property
    def save(self) -> tuple[str, float]:
        """Which save of its step this is: its save id (and its time: manifests written before
        save ids have none)."""
        return self.manifest.save_id, self.manifest.created_at

    @property
    def committed_at(self) -> float:
        return self.manifest.created_at

    @property
    def owned_bytes(self) -> int:
        return sum(e.size for e in self.manifest.owned)

    def file(self, entry: m.FileEntry) -> str:
        return os.path.join(self.path, entry.path)


def read(path: str) -> Optional[Staged]:
    """The staged checkpoint at `path` when it is ready, else None."""
    manifest = validity.staged(path)
    return None if manifest is None else Staged(path, manifest)


def read_final(layout: Layout) -> Optional[Staged]:
    """The staged final model when it is ready, else None."""
    manifest = validity.staged(layout.final, final=True)
    return None if manifest is None else Staged(layout.final, manifest)


def scan(layout: Layout) -> dict[int, Staged]:
    """Every ready staged checkpoint, by step."""
    found = {}
    for step in checkpoint_steps(layout.staging):
        staged = read(layout.staged_dir(step))
        if staged is not None:
            found[step] = staged
    return found


def current(staged: Staged) -> bool:
    """Whether `staged`'s directory still holds that save, ready (not re-staged by another save
    of the step, not removed)."""
    final = staged.manifest.kind == m.OUTPUT_KIND
    now = validity.staged(staged.path, final=final)
    return now is not None and (now.save_id, now.created_at) == staged.save


REMOVE_LOCK_WAIT = 30.0
"""Seconds `remove` waits for the trainer's staging in progress before it leaves the directory
for the next upload of the step to remove."""


def remove(staged: Staged) -> bool:
    """Drop the staged links, manifest first (a half-removed directory is never ready), only
    while the directory holds that save: the trainer may have staged the step again (that save
    is still to be uploaded). The check and the removal hold the staging lock, which the
    trainer holds while it stages (commit.stage): a save staged between the two is never the
    one removed. Without the lock in time (the trainer stuck in its staging), nothing is removed:
    the bytes stay until the step's next upload or the pod's end, a lost save would be worse.
    Where the filesystem has no locks, as before the lock existed. False only when the lock
    was not had in time."""
    with staging_lock(os.path.dirname(os.path.normpath(staged.path)), REMOVE_LOCK_WAIT) as held:
        if held is False:
            return False
        if current(staged):
            remove_checkpoint(staged.path)
        return True
