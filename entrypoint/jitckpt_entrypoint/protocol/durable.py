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

One exception, and only for what the sidecar's restore downloads: a restored checkpoint is a
cache of S3, and its durability is S3's. It is committed as soon as its files are written,
without waiting for writeback, with a marker (`UNSYNCED`) that holds the boot id of the kernel
whose page cache has its bytes. On that boot the page cache is what every reader sees. Any
other boot (the node crashed and came back), or another node reading a shared volume, counts
it as uncommitted (validity.local_save) until `settle` has synced it and removed the marker.
Everything written by training keeps the rule above.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from jitckpt_entrypoint.protocol.atomic import fsync_dir, write_bytes

THREADS = 8
"""Files fsynced side by side."""
UNSYNCED = "jitckpt-unsynced"
"""In a restored checkpoint committed before its bytes reached the disk: the boot id of the
kernel whose page cache holds them."""
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    """This kernel's boot id ("" where there is none: every marker then counts as foreign)."""
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def mark_unsynced(ckpt_dir: str) -> None:
    """Before the manifests of a restored checkpoint committed without a sync: this boot's id
    (written before the manifests, so no committed-looking directory lacks it)."""
    write_bytes(os.path.join(ckpt_dir, UNSYNCED), (boot_id() + "\n").encode(), durable=False)


def unsynced_elsewhere(ckpt_dir: str) -> bool:
    """Whether `ckpt_dir` is a restored checkpoint not yet synced whose bytes were in another
    boot's (or another node's) page cache: it may hold zeros where data never reached the disk.
    An unreadable marker (torn by a crash) counts as another boot's."""
    try:
        with open(os.path.join(ckpt_dir, UNSYNCED), encoding="ascii") as f:
            marked = f.read().strip()
    except FileNotFoundError:
        return False
    except (OSError, UnicodeDecodeError):
        return True
    here = boot_id()
    return not here or marked != here


def settle(ckpt_dir: str) -> bool:
    """Sync a restored checkpoint of this boot and remove its marker (durably); True when it
    had one. Another boot's marker stays: that checkpoint is not to be trusted."""
    marker = os.path.join(ckpt_dir, UNSYNCED)
    if not os.path.exists(marker) or unsynced_elsewhere(ckpt_dir):
        return False
    sync_tree(ckpt_dir)
    os.unlink(marker)
    fsync_dir(ckpt_dir)
    return True


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
