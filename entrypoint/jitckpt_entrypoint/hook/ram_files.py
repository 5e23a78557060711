"""Files of the snapshots in RAM (JITCKPT_MEMORY_DIR): written through the page cache, and
over the files of a retired snapshot.

The page cache is a tmpfs's storage: O_DIRECT (which tmpfs takes since Linux 6.6) would only add
a copy through direct_write's aligned buffers, so a file in a `register`ed root is written
straight from host memory (`in_ram`).

A file written afresh into a tmpfs takes every page from the kernel, which zeroes it, and
deleting the old snapshot gives them all back: for each snapshot the training process paid for
its bytes twice more than the copy itself. A snapshot made older by a newer commit is `retire`d
instead: its manifests go first (it is never committed again), its large files that direct_write
wrote (which will take them again) move to `<root>/.spare/<path in the snapshot>`, the rest
goes. When the next snapshot writes the file of the same path (direct_write's `DirectFile`), it
`take`s the spare (a rename over the new path) and writes over its pages: every byte of it,
gaps as zeros, then truncated to its size. A spare
is a whole file of an older, uncommitted snapshot: nothing reads it, and a crash mid-write
leaves an uncommitted snapshot, removed as any other.

At most two snapshots' bytes are held, as without spares: a file a library writes afresh (the
fallbacks of safetensors_save and torch_save) `drop`s its spare first, what a snapshot did not
take goes at its commit (memory_tier.py), a plain loop's snapshots (DCP's own writer, which
takes none) keep no spares, and none stay once snapshots are off.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Optional

from jitckpt_entrypoint.protocol.commit import remove_checkpoint, withdraw

SPARE = ".spare"
LARGE = 1 << 20
"""Files of at least this many bytes are kept as spares (the rest are not worth a rename)."""

_roots: set[str] = set()
_written: set[str] = set()
"""Paths within a snapshot that direct_write wrote in this process (the ones it would take a
spare for): only those are kept as spares."""


def register(root: str) -> None:
    """Files written into `root/<snapshot>/` from now on are files in RAM."""
    _roots.add(os.path.abspath(root))


def in_ram(path: str) -> bool:
    """`path` is a file of a snapshot in a registered root."""
    return _snapshot_file(path) is not None


def retire(root: str, snapshot: str) -> None:
    """Each node's local rank 0: `snapshot` (a directory in `root`) is no longer committed, its
    large files become the spares (replacing older ones of the same path), and it is gone."""
    withdraw(snapshot)
    spare_root = os.path.join(root, SPARE)
    for parent, _, names in os.walk(snapshot):
        for name in names:
            path = os.path.join(parent, name)
            rel = os.path.relpath(path, snapshot)
            with contextlib.suppress(OSError):  # not kept: removed with the directory
                if rel in _written and os.lstat(path).st_size >= LARGE:
                    spare = os.path.join(spare_root, rel)
                    os.makedirs(os.path.dirname(spare), exist_ok=True)
                    os.replace(path, spare)
    remove_checkpoint(snapshot)


def remove(root: str) -> None:
    """Every spare in `root` goes (a new run, a resume: the next snapshots write afresh)."""
    shutil.rmtree(os.path.join(root, SPARE), ignore_errors=True)


def drop(path: str) -> None:
    """The spare of `path` goes: the file is written afresh (by a library's own save), and two
    snapshots' bytes are the most held."""
    found = _snapshot_file(path)
    if found is not None:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(found[0], SPARE, found[1]))


def take(path: str) -> bool:
    """The spare of `path` (a file in RAM, `in_ram`) renamed to `path`; False when there is
    none."""
    found = _snapshot_file(path)
    if found is None:
        return False
    root, rel = found
    _written.add(rel)
    try:
        os.replace(os.path.join(root, SPARE, rel), path)
    except OSError:
        return False
    return True


def _snapshot_file(path: str) -> Optional[tuple[str, str]]:
    """(root, path within its snapshot) of a file in a snapshot of a registered root."""
    full = os.path.abspath(path)
    for root in _roots:
        parts = os.path.relpath(full, root).split(os.sep, 1)
        if len(parts) == 2 and parts[0] not in (os.pardir, SPARE):
            return root, parts[1]
    return None
