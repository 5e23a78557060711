"""Readiness: set once the start-up restore finished. /readyz answers from it (the native
sidecar's startupProbe) and status/sidecar-ready.json (protocol.status.SidecarReady) records it
for anything that waits on the volume instead (the plain init-container variant, scripts)."""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Optional

from jitckpt_entrypoint.protocol import status


class Readiness:
    def __init__(self, status_dir: str, clock: Callable[[], float] = time.time) -> None:
        self.status_dir = status_dir
        self.clock = clock
        self._ready = threading.Event()

    def reset(self) -> None:
        """Forget a ready file left by an earlier sidecar in this pod: not ready until ours."""
        status.SIDECAR_READY.remove(self.status_dir)

    def set(self, source: str, step: Optional[int], seconds: float, nbytes: int = 0) -> None:
        """`restore_bytes_per_second` (S3 restores only) is what the entrypoint's grace-period
        estimate uses as the upload throughput."""
        rate = round(nbytes / seconds) if source == "s3" and nbytes > 0 and seconds > 0 else None
        record = status.SidecarReady(
            ready_at=self.clock(),
            pid=os.getpid(),
            restore=source,
            step=step,
            restore_seconds=round(seconds, 3),
            restore_bytes=nbytes,
            restore_bytes_per_second=rate,
        )
        status.SIDECAR_READY.write(self.status_dir, record)
        self._ready.set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()


def process_start(clock: Callable[[], float] = time.time) -> float:
    """This process's start (before the imports), else now: the recovery metric's origin."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - a metric's start: now is close enough
        return clock()
