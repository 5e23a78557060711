"""What counts as committed: locally, staged for upload, and in S3. One rule, three places.

- Local (`checkpoints/checkpoint-<step>/`): the manifest of every node 0..nodes-1 of one save
  is present (complete_save: one save id, the same step, node count and world size, checkpoint
  kinds; manifests of other saves are left out) and the files listed for the node asked about
  (every node's when none is) are present with their listed sizes. Resume picks the newest
  such checkpoint; anything else is ignored and never loaded.
- Staged (`staging/checkpoint-<step>/`, `staging/final/`): this node's manifest alone, and every
  file it owns present with its size (the trainer links the manifest in last).
- S3 (`prefix/checkpoint-<step>/`): every node's manifest of one save (complete_save), every
  owned entry's object present with its size and a checksum we can verify. Each node's uploader
  withdraws its manifest of an earlier save and writes its new one after its files, and
  retention deletes manifests first, so a missing manifest, or one of another save, means "not
  (yet) committed".

Each place checks its files with the one `file_problems` below.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Iterable, Iterator
from typing import Callable, Optional

from jitckpt_entrypoint.protocol import durable
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


def complete_save(
    manifests: dict[int, m.Manifest], step: Optional[int] = None, kinds: tuple[str, ...] = m.KINDS
) -> Optional[dict[int, m.Manifest]]:
    """The manifests of the save that is complete in `manifests`, else None.

    A save is complete when every node 0..nodes-1 has a manifest of that save (its save id),
    and they agree on the step, the node count, the world size and a kind in `kinds` (a
    checkpoint's kinds; the final model passes kinds=(OUTPUT_KIND,)). Manifests of other saves
    (an earlier attempt at the same step, nodes a smaller job no longer has) are left out. At
    most one save is complete: each needs node 0's manifest.
    """
    first = manifests.get(0)
    if first is None:
        return None
    save = {n: man for n, man in manifests.items() if man.save_id == first.save_id}
    if not set(range(first.nodes)) <= set(save):
        return None
    save = {n: save[n] for n in range(first.nodes)}
    if all(
        man.nodes == first.nodes
        and man.world_size == first.world_size
        and man.step == first.step
        and (step is None or man.step == step)
        and man.kind in kinds
        for man in save.values()
    ):
        return save
    return None


def incomplete_reason(manifests: dict[int, m.Manifest]) -> str:
    """Why complete_save found no save in `manifests`, in words (for logs)."""
    if not manifests:
        return "no manifest"
    newest = max(manifests.values(), key=lambda man: (man.created_at, -man.node))
    missing = [n for n in range(newest.nodes) if n not in manifests]
    if missing:
        return f"manifest of node {', '.join(map(str, missing))} missing"
    other = [n for n in range(newest.nodes) if manifests[n].save_id != newest.save_id]
    if other:
        return (
            f"manifest of node {', '.join(map(str, other))} is of another save of the step "
            "(an earlier attempt)"
        )
    return "manifests disagree on the step, the node count, the world size or the kind"


def local_save(ckpt_dir: str) -> Optional[dict[int, m.Manifest]]:
    """The manifests of the complete save in local `ckpt_dir` (named for its step), else None;
    its files unchecked. A restored checkpoint committed without a sync counts only on the boot
    that restored it (durable.unsynced_elsewhere)."""
    step = step_of(os.path.basename(os.path.normpath(ckpt_dir)))
    if step is None or durable.unsynced_elsewhere(ckpt_dir):
        return None
    return complete_save(m.read_manifests(ckpt_dir), step)


def committed(ckpt_dir: str, node: Optional[int] = None) -> Optional[dict[int, m.Manifest]]:
    """The manifests when local `ckpt_dir` is committed (for `node`, or every node), else None."""
    manifests = local_save(ckpt_dir)
    if manifests is None:
        return None
    if node is not None and node not in manifests:
        return None
    to_check = manifests.values() if node is None else (manifests[node],)
    if not files_match(ckpt_dir, (e for manifest in to_check for e in manifest.files)):
        return None
    return manifests


def loadable(
    ckpt_dir: str, node: int, nodes: Optional[int] = None, world_size: Optional[int] = None
) -> Optional[dict[int, m.Manifest]]:
    """The manifests when local `ckpt_dir` is committed and holds what node `node` loads in a
    job of `nodes` nodes and `world_size` ranks (None: the save's own): at the save's size, its
    files as node_files lists them; at another size, every file (DCP reshards). Else None."""
    save = local_save(ckpt_dir)
    if save is None:
        return None
    union = local_union(save)
    first = save[0]
    same_size = (nodes in (None, first.nodes)) and (world_size in (None, first.world_size))
    needed = node_files(save, node, union) if same_size else union
    return save if files_match(ckpt_dir, needed.values()) else None


def whole_here(ckpt_dir: str, node: int) -> Optional[dict[int, m.Manifest]]:
    """The manifests when local `ckpt_dir` is committed and node `node`'s own files (its
    manifest's, present) are every file of the save its ranks load at the save's size
    (node_files) but other ranks' RNG states, else None: from this node alone. A snapshot in
    RAM (one node: every file; several: each node's local rank 0 writes the shared files,
    hook/trainer_checkpoint.py `whole_node`, and FSDP's node holds its own shards and the DCP
    files it reads, hook/dcp_reads.py `spread`), which no other node's files ever complete."""
    save = committed(ckpt_dir, node)
    if save is None:
        return None
    own = {e.path for e in save[node].files}
    needed = node_files(save, node, local_union(save))
    return save if all(p in own or RNG_FILE.fullmatch(p) for p in needed) else None


RNG_FILE = re.compile(r"rng_state_\d+\.pth")
"""The Trainer's RNG states, one per rank: each rank loads its own (`_load_rng_state`)."""


def kept(ckpt_dir: str, node: int, nodes: int, world_size: int) -> bool:
    """A committed checkpoint node `node` of a job of `nodes` nodes and `world_size` ranks keeps:
    its own part of a save, or one it can load whole (a save of another job size that the
    restore brought whole: a node it did not have holds no manifest of its own there)."""
    return (
        committed(ckpt_dir, node) is not None
        or loadable(ckpt_dir, node, nodes, world_size) is not None
    )


def local_union(save: dict[int, m.Manifest]) -> dict[str, m.FileEntry]:
    """Every file a manifest of `save` names (local entries carry no checksum), by path."""
    return {e.path: e for manifest in save.values() for e in manifest.files}


def node_files(
    save: dict[int, m.Manifest], node: int, union: dict[str, m.FileEntry]
) -> dict[str, m.FileEntry]:
    """Of `union` (the save's files), those node `node`'s ranks load at the save's own world
    size and node count: every file but the shard files of the DCP directories its manifest
    maps (`shard_dirs`) that another node holds and it does not read (`shard_reads`). All of
    `union` when its manifest maps none, or names no such node."""
    manifest = save.get(node)
    if manifest is None or not manifest.shard_dirs:
        return union
    dirs = set(manifest.shard_dirs)
    keep = {e.path for e in manifest.files} | set(manifest.shard_reads)
    return {p: e for p, e in union.items() if p in keep or not _shard_in(p, dirs)}


def _shard_in(path: str, dirs: set[str]) -> bool:
    parent, _, name = path.rpartition("/")
    return name.endswith(SHARD_SUFFIX) and parent in dirs


SHARD_SUFFIX = ".distcp"
"""DCP's data files; everything else of a checkpoint (its `.metadata` too) every node reads."""


def newness(manifest: m.Manifest) -> tuple[str, int]:
    """The order in which resume and restore prefer checkpoints: by run (lineage, the
    newest-born last), then step."""
    return (manifest.lineage, manifest.step)


def committed_steps(checkpoints_dir: str, node: Optional[int] = None) -> list[int]:
    """Steps of the committed checkpoints under `checkpoints_dir`, oldest first in the order
    resume and restore use: by run (lineage; the newest-born last), then step."""
    found: list[m.Manifest] = []
    for step in checkpoint_steps(checkpoints_dir):
        save = committed(os.path.join(checkpoints_dir, checkpoint_name(step)), node)
        if save is not None:
            found.append(save[0])
    return [manifest.step for manifest in sorted(found, key=newness)]


def newest_committed(checkpoints_dir: str, node: Optional[int] = None) -> Optional[int]:
    """The newest committed step, in committed_steps' order."""
    steps = committed_steps(checkpoints_dir, node)
    return steps[-1] if steps else None


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
    """The parsable manifests present, by node (of every save that left one)."""
    etags: dict[str, str] = dataclasses.field(default_factory=dict)
    """Relative path -> ETag, as the listing gave them (a download asks for exactly those)."""

    @property
    def committed(self) -> bool:
        return s3_problems(self) == []

    @functools.cached_property
    def save(self) -> Optional[dict[int, m.Manifest]]:
        """The manifests of the one complete save (checkpoint kinds), else None."""
        return complete_save(self.manifests, self.step)

    @property
    def save_id(self) -> Optional[str]:
        save = self.save
        return None if save is None else save[0].save_id

    @property
    def lineage(self) -> Optional[str]:
        save = self.save
        return None if save is None else save[0].lineage

    def files(self, save: Optional[dict[int, m.Manifest]] = None) -> dict[str, m.FileEntry]:
        """Every file named by a manifest of `save` (the complete one by default): the union,
        each as its owner's entry."""
        save = self.save if save is None else save
        owned = _owned(save or {})
        union: dict[str, m.FileEntry] = {}
        for manifest in (save or {}).values():
            for entry in manifest.files:
                found = owned.get((entry.owner, entry.path))
                if found is not None:
                    union[entry.path] = found
        return union


def _owned(save: dict[int, m.Manifest]) -> dict[tuple[int, str], m.FileEntry]:
    """(owner, path) -> the owner's entry, for every entry a manifest of `save` owns."""
    return {(n, e.path): e for n, man in save.items() for e in man.owned}


def s3_problems(ckpt: RemoteCheckpoint, kinds: tuple[str, ...] = m.KINDS) -> list[str]:
    """Why `ckpt` is not committed in S3 (empty when it is); the final model passes
    kinds=(OUTPUT_KIND,) and its manifest's step. Linear in the number of entries."""
    save = ckpt.save if kinds == m.KINDS else complete_save(ckpt.manifests, ckpt.step, kinds)
    if save is None:
        return [incomplete_reason(ckpt.manifests)]
    owned = _owned(save)
    found = []
    for manifest in save.values():
        for entry in manifest.files:
            entry_owned = owned.get((entry.owner, entry.path))
            if entry_owned is None or entry_owned.size != entry.size:
                found.append(f"{entry.path}: not listed by its owner node {entry.owner}")
    return found + _object_problems(ckpt, owned.values())


def s3_part_problems(ckpt: RemoteCheckpoint, node: int, save_id: Optional[str] = None) -> list[str]:
    """Why S3 does not hold node `node`'s part of `ckpt` (of save `save_id`, when given): its
    manifest and every file it uploads, with a checksum we can verify (empty when it does).
    The files it holds but another node uploads are that node's part."""
    manifest = ckpt.manifests.get(node)
    if manifest is None:
        return [f"manifest of node {node} missing"]
    if save_id is not None and manifest.save_id != save_id:
        return [f"manifest of node {node} is of another save"]
    return _object_problems(ckpt, manifest.owned)


def _object_problems(ckpt: RemoteCheckpoint, owned: Iterable[m.FileEntry]) -> list[str]:
    found = []
    for entry in owned:
        wrong = list(file_problems((entry,), ckpt.objects.get, "object"))
        if not wrong and (entry.checksum is None or not m.checksum_supported(entry.checksum)):
            wrong = [f"{entry.path}: no checksum we can verify"]
        found += wrong
    return found
