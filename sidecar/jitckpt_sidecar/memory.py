"""Keep the sidecar's resident memory small between transfers (glibc only; a no-op elsewhere).

A transfer's worker threads each get a glibc malloc arena and leave freed memory in it, so a
1 GiB upload leaves tens of MB resident for the rest of the pod's life. Capping the arenas
(before any thread starts) and trimming the heap after each transfer returns that memory to
the kernel; the cost is a few microseconds per transfer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from typing import Optional

_M_ARENA_MAX = -8  # mallopt parameter number from <malloc.h>
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


def limit_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas; call before starting threads. True when applied."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(_M_ARENA_MAX, arenas))


def trim() -> None:
    """Collect garbage and give the free heap back to the kernel."""
    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
