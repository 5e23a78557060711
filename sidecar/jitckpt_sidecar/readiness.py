"""Readiness: set once the start-up restore finished. /readyz answers from it (the native
sidecar's startupProbe) and status/sidecar-ready.json records it for anything that waits on
the volume instead (the plain init-container variant, scripts)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable, Optional

from jitckpt_entrypoint import atomic

READY_FILE = "sidecar-ready.json"


class Readiness:
    def __init__(self, status_dir: str, clock: Callable[[], float] = time.time) -> None:
        self.path = os.path.join(status_dir, READY_FILE)
        self.clock = clock
        self._ready = threading.Event()

    def reset(self) -> None:
        """Forget a ready file left by an earlier sidecar in this pod: not ready until ours."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def set(self, source: str, step: Optional[int], seconds: float, nbytes: int = 0) -> None:
        """`restore_bytes_per_second` (S3 restores only) is what the entrypoint's grace-period
        estimate uses as the upload throughput."""
        record: dict[str, object] = {
            "ready_at": self.clock(),
            "pid": os.getpid(),
            "restore": source,
            "step": step,
            "restore_seconds": round(seconds, 3),
            "restore_bytes": nbytes,
        }
        if source == "s3" and nbytes > 0 and seconds > 0:
            record["restore_bytes_per_second"] = round(nbytes / seconds)
        atomic.write_json(self.path, record, durable=True)
        self._ready.set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()
