"""Keep the sidecar's resident memory small between transfers (glibc only; a no-op elsewhere).

A transfer leaves freed memory in glibc's heap: worker threads each get an arena, and after
the first large buffer is freed glibc raises its mmap threshold, so later multi-MiB buffers
(hashing, ranged GETs) come from the heap and fragment it. Left alone, a 1 GiB upload leaves
~20 MB resident for the rest of the pod's life. Capping the arenas, fixing the mmap threshold
(large buffers go back to the kernel on free) and trimming after each transfer keeps the RSS
at its start-up level, for a few mmap calls per transfer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from typing import Optional

# mallopt parameter numbers from <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_libc: Optional[ctypes.CDLL] = None
_loaded = False


def _glibc() -> Optional[ctypes.CDLL]:
    global _libc, _loaded  # noqa: PLW0603 - the loaded library is process-wide by nature
    if not _loaded:
        _loaded = True
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            libc.malloc_trim  # noqa: B018 - probe: glibc has it, musl does not
            libc.mallopt  # noqa: B018
        except (OSError, AttributeError):
            return None
        _libc = libc
    return _libc


def configure(arenas: int = 2) -> bool:
    """Tune glibc malloc for a long-lived process with bursts of large buffers; call before
    starting threads. True when applied."""
    libc = _glibc()
    if libc is None:
        return False
    return all(
        libc.mallopt(param, value)
        for param, value in (
            (_M_ARENA_MAX, arenas),
            (_M_MMAP_THRESHOLD, 2 * 1024 * 1024),  # a fixed value also stops the dynamic raise
            (_M_TRIM_THRESHOLD, 1024 * 1024),
        )
    )


def trim() -> None:
    """Collect garbage and give the free heap back to the kernel."""
    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
