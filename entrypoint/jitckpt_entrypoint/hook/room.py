"""Room for a save: host memory for async snapshots, disk space for checkpoints.

An async save keeps a copy of the model and optimizer state in host memory, on every local rank.
In a pod the limit that matters is the container's cgroup (the OOM killer acts on it; an OOM
kill also loses the JIT save), not the node's free memory. Page cache counts in a cgroup's usage
but is reclaimable, so it is taken out (the kubelet's working set does the same: usage minus
inactive file pages). `short_node` adds up the snapshots of each node's local ranks, which share
that container. CUDA snapshots are page-locked at their exact size (snapshot.pinned:
cudaHostRegister, as DCP does for its cached copies), so there is no power-of-two rounding of
torch's pinned allocator (up to twice the memory) to count; FSDP's saves are staged by DCP's
blocking stager into plain host memory of the shards' size.

A checkpoint that does not fit on its volume is reported in one line (`no_space`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Optional

HEADROOM = 0.75
"""An async snapshot fits when it needs at most this share of the available memory."""


@dataclasses.dataclass(frozen=True)
class Budget:
    available: int
    """Bytes this process may still allocate: the smaller of the node's and the cgroup's."""
    limit: Optional[int]
    """The cgroup's memory limit, None when there is none."""

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.available * HEADROOM

    def describe(self) -> str:
        limit = "" if self.limit is None else f" (cgroup limit {gb(self.limit)})"
        return f"{gb(self.available)} available{limit}"


def short_node(ranks: list[tuple[int, int, Budget]]) -> Optional[str]:
    """Why the snapshots of some node's ranks do not fit, or None; `ranks`: (node, bytes of
    its snapshot, its budget) of every rank. A node's ranks share its memory and container:
    their snapshots add up, against the smallest budget any of them read."""
    nodes: dict[int, tuple[int, Budget]] = {}
    for node, nbytes, seen in ranks:
        total, least = nodes.get(node, (0, seen))
        nodes[node] = (total + nbytes, least if least.available <= seen.available else seen)
    for node, (total, least) in sorted(nodes.items()):
        if not least.fits(total):
            return (
                f"the async snapshots of node {node}'s ranks need {gb(total)} of host memory, "
                f"more than {HEADROOM:.0%} of the {least.describe()}"
            )
    return None


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the file system of `path`."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def tree_bytes(path: str) -> int:
    """Bytes of the files under `path` (what is gone meanwhile counts 0)."""
    total = 0
    for parent, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(parent, name)).st_size
    return total


def volume_of(path: str) -> str:
    """The mount point `path` lives on."""
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def no_space(name: str, path: str, needed: int, removed: bool) -> str:
    """The one line for a checkpoint that did not fit: the volume, bytes needed, bytes free
    (`removed`: once its partial files are removed)."""
    need = f"needs about {gb(needed)}, " if needed else ""
    free = gb(free_bytes(path)) + (
        " free once its partial files are removed" if removed else " free"
    )
    return (
        f"{name} not saved: no space left on {volume_of(path)} ({need}{free}); free space on "
        "the volume or raise its size (emptyDir sizeLimit), or lower save_total_limit"
    )


def budget(root: str = "") -> Budget:
    """Read /proc/meminfo and the cgroup (v2, else v1); `root` prefixes the paths (tests)."""
    available = _meminfo_available(root + "/proc/meminfo")
    limit, used = _cgroup(root)
    if limit is not None and used is not None:
        available = min(available, max(0, limit - used))
    return Budget(available, limit)


def _meminfo_available(path: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _cgroup(root: str) -> tuple[Optional[int], Optional[int]]:
    """(limit, working set) of this process's memory cgroup; (None, None) when unlimited."""
    v2 = root + "/sys/fs/cgroup"
    limit = _read_int(f"{v2}/memory.max")
    if limit is not None:
        used = _read_int(f"{v2}/memory.current")
        return limit, _minus_cache(used, f"{v2}/memory.stat", "inactive_file")
    v1 = root + "/sys/fs/cgroup/memory"
    limit = _read_int(f"{v1}/memory.limit_in_bytes")
    if limit is None or limit >= 1 << 60:  # v1 says "no limit" with a huge number
        return None, None
    used = _read_int(f"{v1}/memory.usage_in_bytes")
    return limit, _minus_cache(used, f"{v1}/memory.stat", "total_inactive_file")


def _minus_cache(used: Optional[int], stat_path: str, key: str) -> Optional[int]:
    if used is None:
        return None
    try:
        with open(stat_path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return max(0, used - int(value))
    except (OSError, ValueError):
        pass
    return used


def _read_int(path: str) -> Optional[int]:
    """The integer in `path`; None when it is missing or says "max"."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def gb(nbytes: int) -> str:
    if nbytes < 1e9:
        return f"{nbytes / 1e6:.1f} MB"
    return f"{nbytes / 1e9:.2f} GB"
