"""What counts as committed: locally, staged for upload, and in S3. One rule, three places.

- Local (`checkpoints/checkpoint-<step>/`): the manifest of every node 0..nodes-1 is present
  (one consistent set: same step and node count, checkpoint kinds) and the files listed for the
  node asked about (every node's when none is) are present with their listed sizes. Resume picks
  the highest such step; anything else is ignored and never loaded.
- Staged (`staging/checkpoint-<step>/`, `staging/final/`): this node's manifest alone, and every
  file it owns present with its size (the trainer links the manifest in last).
- S3 (`prefix/checkpoint-<step>/`): every node's manifest (one consistent set), every owned
  entry's object present with its size and a checksum we can verify. Each node's uploader writes
  its manifest after its files, and retention deletes manifests first, so a missing manifest
  means "not (yet) committed".

Each place checks its files with the one `file_problems` below.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator
from typing import Callable, Optional

from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.layout import checkpoint_name, checkpoint_steps, step_of


def file_problems(
    entries: Iterable[m.FileEntry], size_of: Callable[[str], Optional[int]], noun: str = "file"
) -> Iterator[str]:
    """One line per entry whose file is missing (`size_of` gives None) or has another size."""
    for entry in entries:
        size = size_of(entry.path)
        if size != entry.size:
            yield f"{entry.path}: {noun} " + (
                "missing" if size is None else f"has {size} bytes, not {entry.size}"
            )


def files_match(directory: str, entries: Iterable[m.FileEntry]) -> bool:
    """Whether every entry's file is in `directory` with its listed size."""
    return next(file_problems(entries, _local_size(directory)), None) is None


def _local_size(directory: str) -> Callable[[str], Optional[int]]:
    def size_of(relpath: str) -> Optional[int]:
        try:
            return os.stat(os.path.join(directory, relpath)).st_size
        except OSError:
            return None

    return size_of


def complete_set(
    manifests: dict[int, m.Manifest], step: Optional[int] = None, kinds: tuple[str, ...] = m.KINDS
) -> bool:
    """Whether `manifests` holds one consistent manifest for every node of the job.

    A checkpoint's manifests have checkpoint kinds; the final model's pass kinds=(OUTPUT_KIND,).
    """
    if not manifests:
        return False
    first = next(iter(manifests.values()))
    if set(manifests) != set(range(first.nodes)):
        return False
    return all(
        man.nodes == first.nodes
        and man.step == first.step
        and (step is None or man.step == step)
        and man.kind in kinds
        for man in manifests.values()
    )


def committed(ckpt_dir: str, node: Optional[int] = None) -> Optional[dict[int, m.Manifest]]:
    """The manifests when local `ckpt_dir` is committed (for `node`, or every node), else None."""
    step = step_of(os.path.basename(os.path.normpath(ckpt_dir)))
    if step is None:
        return None
    manifests = m.read_manifests(ckpt_dir)
    if not complete_set(manifests, step):
        return None
    if node is not None and node not in manifests:
        return None
    to_check = manifests.values() if node is None else (manifests[node],)
    if not files_match(ckpt_dir, (e for manifest in to_check for e in manifest.files)):
        return None
    return manifests


def committed_steps(checkpoints_dir: str, node: Optional[int] = None) -> list[int]:
    """Steps of the committed checkpoints under `checkpoints_dir`, ascending."""
    return [
        s
        for s in checkpoint_steps(checkpoints_dir)
        if committed(os.path.join(checkpoints_dir, checkpoint_name(s)), node) is not None
    ]


def newest_committed(checkpoints_dir: str, node: Optional[int] = None) -> Optional[int]:
    """The highest committed step; checks from the newest down (cheap when the newest is valid)."""
    for step in reversed(checkpoint_steps(checkpoints_dir)):
        if committed(os.path.join(checkpoints_dir, checkpoint_name(step)), node) is not None:
            return step
    return None


def staged(path: str, *, final: bool = False) -> Optional[m.Manifest]:
    """This node's manifest when the staged directory `path` is ready for upload, else None:
    a checkpoint (its directory named for its step), or with `final` the final model (kind
    output)."""
    manifests = m.read_manifests(path)
    if len(manifests) != 1:
        return None
    (manifest,) = manifests.values()
    if final:
        expected = manifest.kind == m.OUTPUT_KIND
    else:
        step = step_of(os.path.basename(os.path.normpath(path)))
        expected = manifest.kind in m.KINDS and manifest.step == step
    return manifest if expected and files_match(path, manifest.owned) else None


@dataclasses.dataclass(frozen=True)
class RemoteCheckpoint:
    """A directory under the S3 prefix as one listing saw it."""

    step: int
    objects: dict[str, int]
    """Relative path -> size of every object in the directory (manifests included)."""
    manifests: dict[int, m.Manifest]
    """The parsable manifests present, by node."""

    @property
    def committed(self) -> bool:
        return s3_problems(self) == []

    def owner_entry(self, path: str, owner: int) -> Optional[m.FileEntry]:
        manifest = self.manifests.get(owner)
        if manifest is None:
            return None
        return next((e for e in manifest.owned if e.path == path), None)

    def files(self) -> dict[str, m.FileEntry]:
        """Every file named by any manifest (the union), as its owner's entry."""
        union: dict[str, m.FileEntry] = {}
        for manifest in self.manifests.values():
            for entry in manifest.files:
                owned = self.owner_entry(entry.path, entry.owner)
                if owned is not None:
                    union[entry.path] = owned
        return union


def s3_problems(ckpt: RemoteCheckpoint, kinds: tuple[str, ...] = m.KINDS) -> list[str]:
    """Why `ckpt` is not committed in S3 (empty when it is); the final model passes
    kinds=(OUTPUT_KIND,) and its manifest's step."""
    manifests = ckpt.manifests
    if not manifests:
        return ["no manifest"]
    nodes = next(iter(manifests.values())).nodes
    missing = sorted(set(range(nodes)) - set(manifests))
    if missing:
        return [f"manifest of node {', '.join(map(str, missing))} missing"]
    if not complete_set(manifests, ckpt.step, kinds):
        return ["manifests disagree on the step, the node count or the kind"]
    found = []
    for manifest in manifests.values():
        for entry in manifest.files:
            owned = ckpt.owner_entry(entry.path, entry.owner)
            if owned is None or owned.size != entry.size:
                found.append(f"{entry.path}: not listed by its owner node {entry.owner}")
            else:
                found += _object_problems(ckpt, (owned,))
    return found


def s3_part_problems(ckpt: RemoteCheckpoint, node: int) -> list[str]:
    """Why S3 does not hold node `node`'s part of `ckpt`: its manifest and every file it
    uploads, with a checksum we can verify (empty when it does). The files it holds but another
    node uploads are that node's part."""
    manifest = ckpt.manifests.get(node)
    if manifest is None:
        return [f"manifest of node {node} missing"]
    return _object_problems(ckpt, manifest.owned)


def _object_problems(ckpt: RemoteCheckpoint, owned: Iterable[m.FileEntry]) -> list[str]:
    found = []
    for entry in owned:
        wrong = list(file_problems((entry,), ckpt.objects.get, "object"))
        if not wrong and (entry.checksum is None or not m.checksum_supported(entry.checksum)):
            wrong = [f"{entry.path}: no checksum we can verify"]
        found += wrong
    return found
