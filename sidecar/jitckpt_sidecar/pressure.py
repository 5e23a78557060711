"""Disk pressure on the shared volume: measure it, and relieve it by deleting local checkpoints
that are already committed in S3.

Used bytes are counted like `du` (and the kubelet's emptyDir accounting): allocated blocks of
every file and directory under JITCKPT_DIR, each hard-linked inode once (staged links share
their inodes with checkpoints/). Capacity is the emptyDir sizeLimit when given
(JITCKPT_STORAGE_CAPACITY), else the size of the filesystem.

Relief deletes `checkpoints/checkpoint-<step>` directories, oldest first, while the ratio is at
or above the threshold. Only committed local checkpoints qualify (one being written is never
touched), never the newest committed one (the trainer resumes from it), and only when S3
already holds it committed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import threading
from typing import Callable, Optional

from jitckpt_entrypoint import manifest as m


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
            if st.st_nlink > 1:
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
        layout: m.Layout,
        storage: Storage,
        *,
        threshold: float,
        in_s3: Callable[[int], bool],
        logger: logging.Logger,
        on_pruned: Callable[[int], None] = lambda _: None,
    ) -> None:
        self.layout, self.storage, self.threshold = layout, storage, threshold
        self.in_s3, self.log, self.on_pruned = in_s3, logger, on_pruned
        self._stuck_logged = False

    def relieve(self) -> list[int]:
        """Delete what the rules allow until the ratio is below the threshold; the steps."""
        sample = self.storage.sample()
        if sample.ratio < self.threshold:
            self._stuck_logged = False
            return []
        committed = m.committed_steps(self.layout.checkpoints)
        pruned: list[int] = []
        for step in committed[:-1]:  # oldest first; never the newest
            if not self.in_s3(step):
                continue
            before = sample
            m.remove_checkpoint(self.layout.checkpoint_dir(step))
            pruned.append(step)
            self.on_pruned(step)
            sample = self.storage.sample()
            self.log.info(
                "disk pressure %.2f >= %.2f: deleted local %s (committed in S3), "
                "%.1f MB freed, now %.2f",
                before.ratio,
                self.threshold,
                m.checkpoint_name(step),
                max(0, before.used - sample.used) / 1e6,
                sample.ratio,
            )
            if sample.ratio < self.threshold:
                self._stuck_logged = False
                return pruned
        if not self._stuck_logged:
            self._stuck_logged = True
            self.log.warning(
                "disk pressure %.2f >= %.2f (%.1f of %.1f MB) and no local checkpoint can be "
                "deleted (the newest and those not yet committed in S3 stay); raise the emptyDir "
                "sizeLimit or lower save_total_limit",
                sample.ratio,
                self.threshold,
                sample.used / 1e6,
                sample.capacity / 1e6,
            )
        return pruned
