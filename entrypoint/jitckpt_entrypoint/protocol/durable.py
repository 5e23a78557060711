"""The durability rule: a checkpoint's bytes are on stable storage before a manifest says so.

One rule for every save path (the Trainer's own save, async saves, JIT saves, final saves,
FSDP's and DeepSpeed's files, the plain-loop API), applied by the commit and not by each path,
as DCP's FileSystemWriter does it: before any manifest is written, every file under the
checkpoint directory is fsynced (several at a time: fsync releases the GIL and a disk takes
flushes side by side), then every directory under it, deepest first, then the directory that
holds it, so the entry `checkpoint-<step>` itself survives a crash. Without this a node crash
(a PVC outlives it) can leave a committed checkpoint whose data never left the page cache:
files of the right size holding zeros. Manifests themselves are written atomically (temp file,
fsync, rename, fsync of the directory: atomic.write_bytes).

fsync of a file whose pages are already on disk (the async and JIT writers use O_DIRECT) costs
a system call, not a write.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from jitckpt_entrypoint.protocol.atomic import fsync_dir

THREADS = 8
"""Files fsynced side by side."""


def sync_tree(root: str) -> int:
    """fsync every file under `root`, every directory under it (deepest first), `root`, and
    the directory that holds `root`. Returns the bytes of the files."""
    files, dirs = [], []
    for dirpath, _, filenames in os.walk(root):
        dirs.append(dirpath)
        files += [os.path.join(dirpath, name) for name in filenames]
    if len(files) > 1:
        with ThreadPoolExecutor(max_workers=min(THREADS, len(files))) as pool:
            total = sum(pool.map(_fsync_file, files))
    else:
        total = sum(map(_fsync_file, files))
    for dirpath in reversed(dirs):
        fsync_dir(dirpath)
    fsync_dir(os.path.dirname(os.path.abspath(root)))
    return total


def _fsync_file(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)
