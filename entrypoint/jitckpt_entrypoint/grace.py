"""Will the grace period be enough? An estimate from the newest local checkpoint, at start-up.

After the sidecar's restore (or from an earlier run in the same pod) the newest committed
checkpoint records its size and how long its save took. The JIT save after SIGTERM writes about
as much: it must finish before torchrun's shutdown timeout, and its upload before the pod's
grace period ends. When the numbers say it will not, the entrypoint warns before training.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.layout import Layout, checkpoint_name, checkpoint_steps


@dataclasses.dataclass(frozen=True)
class Estimate:
    checkpoint: str
    bytes: int
    save_seconds: float
    upload_seconds: Optional[float]
    """None when no upload throughput is known (local mode, or nothing measured yet)."""

    @property
    def needed(self) -> float:
        return self.save_seconds + (self.upload_seconds or 0.0)


def estimate(layout: Layout) -> Optional[Estimate]:
    """From the newest checkpoint that has a manifest; None when there is none."""
    for step in reversed(checkpoint_steps(layout.checkpoints)):
        manifests = m.read_manifests(layout.checkpoint_dir(step))
        if not manifests:
            continue
        size = max(man.total_bytes for man in manifests.values())
        save = max(man.save_seconds for man in manifests.values())
        rate = _upload_rate(layout)
        upload = size / rate if rate else None
        return Estimate(checkpoint_name(step), size, save, upload)
    return None


def _upload_rate(layout: Layout) -> Optional[float]:
    """Bytes/s the sidecar measured (its restore), as a stand-in for the upload throughput."""
    ready = status.SIDECAR_READY.read(layout.status)
    rate = None if ready is None else ready.restore_bytes_per_second
    return rate if rate is not None and rate > 0 else None


def warning(est: Estimate, grace_seconds: int, shutdown_timeout: int) -> Optional[str]:
    """One line naming the fix when the estimate does not fit, else None."""
    mb = est.bytes / 1e6
    size = f"{mb:.1f}" if mb < 10 else f"{mb:.0f}"
    upload = (
        "" if est.upload_seconds is None else f" and uploading it about {est.upload_seconds:.1f} s"
    )
    if est.save_seconds >= shutdown_timeout or est.needed >= grace_seconds:
        enough = math.ceil(max(est.save_seconds * 4 / 3, est.needed) * 1.25) + 5
        return (
            f"the grace period may be too short: saving {est.checkpoint} ({size} MB) took "
            f"{est.save_seconds:.1f} s{upload}, but torchrun kills workers {shutdown_timeout} s "
            f"and Kubernetes kills the pod {grace_seconds} s after SIGTERM; set "
            f"terminationGracePeriodSeconds and JITCKPT_GRACE_SECONDS to at least {enough}"
        )
    return None
