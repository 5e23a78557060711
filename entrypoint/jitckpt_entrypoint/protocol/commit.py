"""Committing and uncommitting: manifests last on the way in, first on the way out.

Once every rank's files of a checkpoint are on disk, each node's local rank 0 calls
`commit_node` with what every node holds (the hook gathers it; the tests' harness builds it):
the directory is made durable (durable.sync_tree: every file and directory fsynced, whichever
path wrote them), every node's manifest is written into the checkpoint directory, this node's
last (a node's volume holds all manifests, so either node may tell whether the checkpoint is
committed); this node's owned files and then its manifest are hard-linked into staging/ for
the sidecar; a save event is recorded. `commit_download` commits a checkpoint the sidecar's
restore downloaded (a cache of S3: marked with the boot id instead of fsynced). `remove_checkpoint`
undoes a commit before it deletes any file, so a half-deleted checkpoint is never committed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from typing import Callable, Optional

from jitckpt_entrypoint.protocol import atomic, durable, locks, status
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.layout import Layout


def commit_node(
    layout: Layout,
    ckpt_dir: str,
    holdings: dict[int, dict[str, int]],
    *,
    node: int,
    nodes: int,
    world_size: int,
    step: int,
    kind: str,
    started_at: float,
    run_id: str,
    stage_for_upload: bool,
    save_id: str,
    lineage: str,
    clock: Callable[[], float] = time.time,
    synced: bool = False,
    reads: Optional[dict[int, tuple[tuple[str, ...], tuple[str, ...]]]] = None,
    record: bool = True,
    writers: tuple[int, ...] = (),
) -> status.SaveEvent:
    """Commit node `node`'s copy of `ckpt_dir`; `holdings`: per node, relative path -> size of
    every file it holds (one entry per node); `save_id`: this save's (the same on every node);
    `lineage`: the run's (manifest.new_lineage). Returns the save event it recorded. `clock` gives
    the wall time (a fixed one makes the recorded save time exact in tests). `synced`: every
    node already made its files durable (durable.sync_tree) before any node commits, as the
    hook does (on a shared volume a node writes the others' manifests too). `reads`: per node,
    the DCP directories mapped and the other nodes' shard files it reads (manifest.shard_dirs,
    shard_reads); a node without an entry reads every file. `record`: write the save event for
    the sidecar (a snapshot in RAM is not one of its checkpoints). `writers`: the ranks that
    wrote a survivors' save (manifest.writers)."""
    entries = m.assign_owners(holdings)
    if not synced:
        durable.sync_tree(ckpt_dir)  # the data before any manifest, on every save path
    save_seconds = clock() - started_at
    manifests = {
        n: m.new_manifest(
            step,
            kind,
            node=n,
            nodes=nodes,
            world_size=world_size,
            files=files,
            save_seconds=save_seconds,
            save_id=save_id,
            lineage=lineage,
            writers=writers,
            **_reads_of((reads or {}).get(n)),
        )
        for n, files in entries.items()
    }
    for n in sorted(manifests, key=lambda n: n == node):  # our own manifest last
        m.write_manifest(ckpt_dir, manifests[n])
    own = manifests[node]
    if stage_for_upload:
        stage(layout, ckpt_dir, own)
    event = status.SaveEvent(
        kind, step, started_at, clock(), own.total_bytes, run_id=run_id, node=node
    )
    if record:
        status.write_save_event(layout.status, event)
    return event


def commit_download(tmp: str, final: str, manifests: Iterable[m.Manifest]) -> None:
    """Commit a checkpoint downloaded whole into `tmp` as `final`, with every node's manifest
    (`manifests`). A cache of S3, whose durability is S3's: marked with this boot's id
    (durable.mark_unsynced) before the manifests, which are written without fsync, so another
    boot or node counts it uncommitted until the long-running sidecar synced it
    (durable.settle). What `final` holds (an uncommitted leftover, an older save of the step) is
    removed first, manifests first; then one rename."""
    durable.mark_unsynced(tmp)
    for manifest in manifests:  # the commit: manifests after every file
        m.write_manifest(tmp, manifest, durable=False)
    if os.path.lexists(final):
        remove_checkpoint(final)
    os.rename(tmp, final)


def _reads_of(
    reads: Optional[tuple[tuple[str, ...], tuple[str, ...]]],
) -> dict[str, tuple[str, ...]]:
    return {} if reads is None else {"shard_dirs": reads[0], "shard_reads": reads[1]}


STAGING_LOCK = ".jitckpt-lock"
"""A file under staging/ whose exclusive flock the trainer holds while it stages a step, and
the sidecar while it removes an uploaded save (staging_lock)."""
STAGE_LOCK_WAIT = 5.0
"""Seconds the trainer waits for the sidecar's removal in progress (milliseconds in practice)
before it stages without the lock, as without a sidecar."""


def stage(layout: Layout, ckpt_dir: str, own: m.Manifest) -> str:
    """Hard-link this node's owned files, then its manifest, into staging/ (no extra bytes),
    under the staging lock: the sidecar, removing an earlier save of the step it uploaded,
    never removes this one instead (it checks whose save the directory holds under the lock)."""
    dest = layout.staged_dir(own.step)
    with staging_lock(layout.staging, STAGE_LOCK_WAIT):
        if os.path.exists(dest):
            remove_checkpoint(dest)
        for entry in own.owned:
            target = os.path.join(dest, entry.path)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            link_or_copy(os.path.join(ckpt_dir, entry.path), target)
        os.makedirs(dest, exist_ok=True)
        link_or_copy(
            os.path.join(ckpt_dir, m.manifest_name(own.node)),
            os.path.join(dest, m.manifest_name(own.node)),
        )
        durable.sync_tree(dest)  # the links (a PVC outlives a node crash)
    return dest


@contextlib.contextmanager
def staging_lock(staging: str, wait: float) -> Iterator[Optional[bool]]:
    """Hold the exclusive flock of `staging`/STAGING_LOCK (the kernel drops it when its holder
    dies). Yields True when held; False when another process held it for `wait` seconds; None
    where there is no lock to take (no such file can be made, or no locks on the filesystem):
    then the caller goes on unlocked, as before the lock existed."""
    fd = locks.open_lock(os.path.join(staging, STAGING_LOCK))
    if fd is None:
        yield None
        return
    held = None
    try:
        held = locks.flock(fd, fcntl.LOCK_EX, time.monotonic() + wait)
        yield held
    finally:
        # Unlocked before the close: a child forked meanwhile (a DataLoader worker) shares the
        # open file, and would keep the lock for as long as it lives.
        if held:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def link_or_copy(src: str, dst: str) -> bool:
    """Hard-link `src` as `dst` (no extra bytes); copy it across filesystems. True if linked."""
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        shutil.copy2(src, dst)
        return False
    return True


def remove_checkpoint(ckpt_dir: str) -> None:
    """Delete a checkpoint directory, manifests first, so a half-deleted one is never committed.

    Another process may delete it at the same time (HF's rotation on process 0): what is
    already gone is not an error.
    """
    withdraw(ckpt_dir)
    shutil.rmtree(ckpt_dir, ignore_errors=True)


def withdraw(ckpt_dir: str) -> bool:
    """Remove the manifests of `ckpt_dir` (durably), so it is no longer committed; True when
    there were any."""
    removed = False
    for name in _listdir(ckpt_dir):
        if m.is_manifest_name(name):
            # Another node may remove the same directory of a shared (PVC) volume at once.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(ckpt_dir, name))
            removed = True
    if removed:
        with contextlib.suppress(FileNotFoundError):
            atomic.fsync_dir(ckpt_dir)
    return removed


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
