"""Checkpoints staged for upload: `JITCKPT_DIR/staging/checkpoint-<step>/`; and `final/`.

After each local commit the trainer hard-links this node's owned files into the staged
directory, then its own manifest, last. A staged checkpoint is ready once that manifest is
present and every owned file it lists is present with its size; the sidecar removes the
directory (manifest first) once the checkpoint is committed in S3, which frees the bytes when
the Trainer's rotation already deleted the original. The final model (`staging/final/`, one
manifest of kind output, staged by the entrypoint after training) is read by `read_final`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from jitckpt_entrypoint import manifest as m


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
    def committed_at(self) -> float:
        return self.manifest.created_at

    @property
    def owned_bytes(self) -> int:
        return sum(e.size for e in self.manifest.owned)

    def file(self, entry: m.FileEntry) -> str:
        return os.path.join(self.path, entry.path)


def read(path: str) -> Optional[Staged]:
    """The staged checkpoint at `path` when it is ready, else None."""
    step = m.step_of(os.path.basename(os.path.normpath(path)))
    if step is None:
        return None
    return _ready(path, m.KINDS, step)


def read_final(layout: m.Layout) -> Optional[Staged]:
    """The staged final model when it is ready, else None."""
    return _ready(layout.final, (m.OUTPUT_KIND,), None)


def _ready(path: str, kinds: tuple[str, ...], step: Optional[int]) -> Optional[Staged]:
    manifests = m.read_manifests(path)
    if len(manifests) != 1:
        return None
    (manifest,) = manifests.values()
    if manifest.kind not in kinds or (step is not None and manifest.step != step):
        return None
    for entry in manifest.owned:
        try:
            if os.stat(os.path.join(path, entry.path)).st_size != entry.size:
                return None
        except OSError:
            return None
    return Staged(path, manifest)


def scan(layout: m.Layout) -> dict[int, Staged]:
    """Every ready staged checkpoint, by step."""
    found = {}
    for step in m.checkpoint_steps(layout.staging):
        staged = read(os.path.join(layout.staging, m.checkpoint_name(step)))
        if staged is not None:
            found[step] = staged
    return found


def remove(staged: Staged) -> None:
    """Drop the staged links, manifest first (a half-removed directory is never ready)."""
    m.remove_checkpoint(staged.path)
