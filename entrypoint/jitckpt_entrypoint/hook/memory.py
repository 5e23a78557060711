"""How much more host memory this process may use: the node's, and its container's cgroup limit.

An async save keeps a copy of the model and optimizer state in host memory. In a pod the limit
that matters is the container's cgroup (the OOM killer acts on it), not the node's free memory.
Page cache counts in a cgroup's usage but is reclaimable, so it is taken out (the kubelet's
working set does the same: usage minus inactive file pages).
"""

from __future__ import annotations

import dataclasses
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
        limit = "" if self.limit is None else f" (cgroup limit {_gb(self.limit)})"
        return f"{_gb(self.available)} available{limit}"


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


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB"
