"""The shared volume's usage, and the local checkpoints this node may delete to bound it.

Used bytes are counted like `du` (and the kubelet's emptyDir accounting): allocated blocks of
every file and directory under JITCKPT_DIR, each hard-linked inode once (staged links share
their inodes with checkpoints/). Capacity is the emptyDir sizeLimit when given
(JITCKPT_STORAGE_CAPACITY), else the size of the filesystem.

The pruner deletes `checkpoints/checkpoint-<step>` directories, oldest first, for two reasons:

- retention: this node keeps at most save_total_limit checkpoints (status/node.json). HF
  rotates checkpoints only on process 0, so without this every other node of a multi-node job
  keeps its part of every checkpoint (1/N of model and optimizer with FSDP or ZeRO);
- pressure: while used/capacity is at or above the threshold.

Either way only a checkpoint committed locally with this node's files qualifies (one being
written is never touched), never the newest one (the trainer resumes from it) nor HF's best
one, and only once S3 holds this node's part of it (its manifest and the files it uploads) or
JITCKPT_S3_KEEP retention has superseded it there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import threading
from typing import Callable, Optional

from jitckpt_entrypoint.protocol import status, validity
from jitckpt_entrypoint.protocol.commit import remove_checkpoint
from jitckpt_entrypoint.protocol.layout import Layout, checkpoint_name


@dataclasses.dataclass(frozen=True)
class Sample:
    used: int
    capacity: int

    @property
    def ratio(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0


def used_bytes(root: str) -> int:
    """Allocated bytes under `root` (files and directories), hard-linked inodes counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    todo = [root]
    while todo:
        path = todo.pop()
        try:
            entries = list(os.scandir(path))
        except OSError:  # removed while we walk (rotation, pruning): not ours to count
            continue
        try:
            st = os.lstat(path)
            total += st.st_blocks * 512
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                todo.append(entry.path)
                continue
            # Every inode, not only those linked twice when we see them: the trainer may stage
            # (hard-link) a file between our visits of its two paths.
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
            total += st.st_blocks * 512
    return total


def filesystem_size(root: str) -> int:
    st = os.statvfs(root)
    return st.f_blocks * st.f_frsize


class Storage:
    """Samples used/capacity on demand and remembers the peak."""

    def __init__(self, root: str, capacity: Optional[int]) -> None:
        self.root = root
        self.configured = capacity
        self._peak = 0
        self._lock = threading.Lock()

    def capacity(self) -> int:
        return self.configured if self.configured is not None else filesystem_size(self.root)

    def sample(self) -> Sample:
        sample = Sample(used_bytes(self.root), self.capacity())
        with self._lock:
            self._peak = max(self._peak, sample.used)
        return sample

    @property
    def peak(self) -> int:
        with self._lock:
            return self._peak


class Pruner:
    def __init__(
        self,
        layout: Layout,
        storage: Storage,
        *,
        threshold: float,
        in_s3: Callable[[int, Optional[int]], bool],
        logger: logging.Logger,
        node: Callable[[], Optional[status.NodeStatus]] = lambda: None,
        on_pruned: Callable[[int], None] = lambda _: None,
        waiting: Callable[[], int] = lambda: 0,
        size_limit: Callable[[], Optional[str]] = lambda: None,
    ) -> None:
        """`in_s3(step, node)`: whether S3 holds that node's part of checkpoint-<step> (the
        whole checkpoint when node is None); `node()`: status/node.json, None before a trainer
        wrote it (then only checkpoints held in full count); `waiting()`: staged checkpoints not
        yet in S3; `size_limit()`: the sizeLimit the sizing estimate names, when known."""
        self.layout, self.storage, self.threshold = layout, storage, threshold
        self.in_s3, self.node, self.log, self.on_pruned = in_s3, node, logger, on_pruned
        self.waiting, self.size_limit = waiting, size_limit
        self._stuck_logged = False
        self._not_in_s3: set[int] = set()
        self._asked = 0
        """forget()'s count: a no remembered is from after the latest."""
        self._deleting = threading.Lock()
        self._stopped = False

    def stop(self) -> None:
        """No deletion once this returns (one under way ends first, with its line): the
        sidecar is exiting, and its last line is its summary."""
        with self._deleting:
            self._stopped = True

    @property
    def stopped(self) -> bool:
        return self._stopped

    def forget(self) -> None:
        """Ask S3 again about checkpoints it did not hold (after an upload, at each rescan)."""
        self._asked += 1  # an answer being awaited now may be from before the upload
        self._not_in_s3.clear()

    def prune(self) -> list[int]:
        """Apply retention, then relieve pressure; the steps deleted, oldest first."""
        node = self.node()
        mine = None if node is None else node.node
        committed = validity.committed_steps(self.layout.checkpoints, mine)
        keep = set(committed[-1:])
        if node is not None and node.best_step is not None:
            keep.add(node.best_step)
        pruned = self._rotate(committed, keep, node)
        left = [s for s in committed if s not in pruned]
        return pruned + self._relieve(left, keep, node)

    def _deletable(self, step: int, node: Optional[int]) -> bool:
        if step in self._not_in_s3:
            return False
        asked = self._asked
        if self.in_s3(step, node):
            return True
        if asked == self._asked:
            self._not_in_s3.add(step)
        return False

    def _delete(self, step: int) -> tuple[int, Sample]:
        """Delete checkpoint-<step>; the bytes freed (the trainer may write meanwhile) and the
        sample after."""
        before = self.storage.sample().used
        remove_checkpoint(self.layout.checkpoint_dir(step))
        self.on_pruned(step)
        after = self.storage.sample()
        return max(0, before - after.used), after

    def _rotate(
        self, committed: list[int], keep: set[int], node: Optional[status.NodeStatus]
    ) -> list[int]:
        if node is None or node.save_total_limit is None or node.save_total_limit <= 0:
            return []  # HF's rule too: unset or 0 keeps every checkpoint
        limit = node.save_total_limit
        keep = keep | set(committed[-limit:])
        pruned = []
        for step in committed:
            if step in keep or not self._deletable(step, node.node):
                continue
            with self._deleting:
                if self._stopped:
                    break
                freed, _ = self._delete(step)
                pruned.append(step)
                self.log.info(
                    "retention: deleted local %s (save_total_limit=%d on node %d, %s), "
                    "%.1f MB freed",
                    checkpoint_name(step),
                    limit,
                    node.node,
                    _why(node),
                    freed / 1e6,
                )
        return pruned

    def _relieve(
        self, committed: list[int], keep: set[int], node: Optional[status.NodeStatus]
    ) -> list[int]:
        sample = self.storage.sample()
        if sample.ratio < self.threshold:
            self._stuck_logged = False
            return []
        pruned: list[int] = []
        for step in committed:  # oldest first
            if step in keep or not self._deletable(step, None if node is None else node.node):
                continue
            with self._deleting:
                if self._stopped:
                    return pruned
                ratio = sample.ratio
                freed, sample = self._delete(step)
                pruned.append(step)
                self.log.info(
                    "disk pressure %.2f >= %.2f: deleted local %s (%s), %.1f MB freed, now %.2f",
                    ratio,
                    self.threshold,
                    checkpoint_name(step),
                    _why(node),
                    freed / 1e6,
                    sample.ratio,
                )
            if sample.ratio < self.threshold:
                self._stuck_logged = False
                return pruned
        if not self._stuck_logged and not self.stopped:
            self._stuck_logged = True
            self.log.warning(
                "disk pressure %.2f >= %.2f (%.1f of %.1f MB) and no local checkpoint can be "
                "deleted: %s",
                sample.ratio,
                self.threshold,
                sample.used / 1e6,
                sample.capacity / 1e6,
                self._advice([s for s in committed if s not in pruned], keep),
            )
        return pruned

    def _advice(self, left: list[int], keep: set[int]) -> str:
        """What holds the bytes on this node, and what can free them here."""
        held = [f"{checkpoint_name(s)} is the newest" for s in left[-1:]]
        held += [f"{checkpoint_name(s)} is HF's best" for s in left[:-1] if s in keep]
        not_in_s3 = [checkpoint_name(s) for s in left if s not in keep]
        waiting = self.waiting()
        if not_in_s3:
            held.append(f"{', '.join(not_in_s3)} not in S3 yet")
        if waiting:
            held.append(f"{waiting} staged checkpoint(s) waiting for upload")
        fixes = []
        if not_in_s3 or waiting:
            fixes.append(
                "uploaded checkpoints go (check the upload errors and jitckpt_upload_lag_seconds;"
                " a trainer without JITCKPT_STORAGE_URI stages nothing)"
            )
        size = self.size_limit()
        fixes.append(
            "raise the emptyDir sizeLimit and JITCKPT_STORAGE_CAPACITY"
            + (f" to at least {size} (the storage sizing estimate)" if size else "")
        )
        return f"{'; '.join(held) or 'no committed checkpoint here'}; {'; '.join(fixes)}"


def _why(node: Optional[status.NodeStatus]) -> str:
    return "its part is in S3" if node is not None and node.nodes > 1 else "committed in S3"
