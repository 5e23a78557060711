"""Prometheus metrics, one group per concern, each registered on the registry passed in.

Names are a contract (dashboards and alerts use them; see metric_names.py and the README's
metrics table):

- checkpoints (from the trainer's status files and the restore): jitckpt_checkpoint_last_step,
  jitckpt_checkpoint_saves_total{kind}, jitckpt_checkpoint_save_seconds{kind},
  jitckpt_jit_trigger_to_commit_seconds
- uploads: jitckpt_uploads_total{result}, jitckpt_upload_bytes_total, jitckpt_upload_seconds,
  jitckpt_upload_queue_length, jitckpt_last_uploaded_step, jitckpt_upload_lag_seconds,
  jitckpt_upload_oldest_pending_age_seconds, jitckpt_upload_retries_total,
  jitckpt_s3_deleted_total
- restore: jitckpt_restore_seconds, jitckpt_restores_total{result}, jitckpt_sidecar_ready
- storage (read from the disk at scrape time): jitckpt_storage_capacity_bytes,
  jitckpt_storage_used_bytes, jitckpt_storage_peak_used_bytes, jitckpt_storage_pressure_ratio,
  jitckpt_storage_pressure_threshold_ratio, jitckpt_storage_pruned_total

Gauges whose value is not known yet (no checkpoint, no JIT save, no restore finished) have no
sample rather than a 0 that reads as a value (metric_names.ABSENT_UNTIL_KNOWN).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from jitckpt_entrypoint.manifest import KINDS
from jitckpt_entrypoint.status import JitRecord, SaveEvent
from jitckpt_sidecar.pressure import Storage

UPLOAD_RESULTS = ("success", "failure", "skipped")
RESTORE_RESULTS = ("success", "failure", "none")
_SECONDS_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600, 1200, 3600
)  # fmt: skip
"""10 ms to an hour: saves of small models take 20-250 ms, uploads of large ones many minutes."""


class LateGauge(Collector):
    """A gauge with no sample until its first value: absence says "none yet", where a 0 would
    read as a value (a 0 s SIGTERM-to-commit, step 0)."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.value: Optional[float] = None
        registry.register(self)

    def set(self, value: float) -> None:
        self.value = value

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        value = self.value
        if value is not None:
            yield GaugeMetricFamily(self.name, self.documentation, value=value)


class CheckpointMetrics:
    """What the trainer saved, from status/save-<step>.json and status/jit.json."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.last_step = LateGauge(
            "jitckpt_checkpoint_last_step",
            "Step of the newest committed checkpoint on the shared volume (saved or restored).",
            registry,
        )
        self.saves = Counter(
            "jitckpt_checkpoint_saves",
            "Checkpoints the trainer committed locally, by kind (periodic, jit, final).",
            ["kind"],
            registry=registry,
        )
        self.save_seconds = Histogram(
            "jitckpt_checkpoint_save_seconds",
            "Seconds from the start of a save to its local commit, by kind.",
            ["kind"],
            buckets=_SECONDS_BUCKETS,
            registry=registry,
        )
        self.jit_trigger_to_commit = LateGauge(
            "jitckpt_jit_trigger_to_commit_seconds",
            "Seconds from SIGTERM to the commit of the last JIT checkpoint.",
            registry,
        )
        for kind in KINDS:
            self.saves.labels(kind)
            self.save_seconds.labels(kind)

    def saved(self, event: SaveEvent) -> None:
        kind = event.kind if event.kind in KINDS else "periodic"
        self.saves.labels(kind).inc()
        self.save_seconds.labels(kind).observe(max(0.0, event.seconds))
        self.on_volume(event.step)

    def on_volume(self, step: int) -> None:
        """checkpoint-<step> is committed on the volume (saved, or restored before training)."""
        self.last_step.set(max(step, self.last_step.value or 0))

    def jit(self, record: JitRecord) -> None:
        if record.trigger_to_commit is not None:
            self.jit_trigger_to_commit.set(max(0.0, record.trigger_to_commit))


class UploadMetrics:
    """The sidecar's uploads and S3 retention."""

    def __init__(
        self,
        registry: CollectorRegistry,
        queue_length: Callable[[], float],
        lag_seconds: Callable[[], float],
        oldest_pending_seconds: Callable[[], float],
    ) -> None:
        self.uploads = Counter(
            "jitckpt_uploads",
            "Checkpoint uploads by result: success, failure (retried later) or skipped "
            "(superseded; retention would delete it).",
            ["result"],
            registry=registry,
        )
        self.bytes = Counter(
            "jitckpt_upload_bytes", "Bytes sent to S3 by uploads.", registry=registry
        )
        self.seconds = Histogram(
            "jitckpt_upload_seconds",
            "Seconds per successful checkpoint upload.",
            buckets=_SECONDS_BUCKETS,
            registry=registry,
        )
        self.queue_length = Gauge(
            "jitckpt_upload_queue_length",
            "Committed checkpoints not yet in S3 (waiting or uploading).",
            registry=registry,
        )
        self.queue_length.set_function(queue_length)
        self.last_uploaded_step = LateGauge(
            "jitckpt_last_uploaded_step",
            "Step of the newest checkpoint committed in S3 that this sidecar uploaded or restored.",
            registry,
        )
        self.lag = Gauge(
            "jitckpt_upload_lag_seconds",
            "Age of the newest committed checkpoint not yet in S3 (0 when none).",
            registry=registry,
        )
        self.lag.set_function(lag_seconds)
        self.oldest_pending = Gauge(
            "jitckpt_upload_oldest_pending_age_seconds",
            "Age of the oldest committed checkpoint not yet in S3 (0 when none): grows through "
            "an S3 outage while new checkpoints keep arriving.",
            registry=registry,
        )
        self.oldest_pending.set_function(oldest_pending_seconds)
        self.retries = Counter(
            "jitckpt_upload_retries",
            "S3 requests retried (throttling, 5xx, resets), uploads and restores retried.",
            registry=registry,
        )
        self.s3_deleted = Counter(
            "jitckpt_s3_deleted",
            "Checkpoints deleted from S3 by retention (JITCKPT_S3_KEEP).",
            registry=registry,
        )
        for result in UPLOAD_RESULTS:
            self.uploads.labels(result)

    def uploaded(self, step: int, seconds: float, sent: int) -> None:
        self.uploads.labels("success").inc()
        self.seconds.observe(seconds)
        self.bytes.inc(sent)
        self.in_s3(step)

    def in_s3(self, step: int) -> None:
        """checkpoint-<step> is committed in S3 (uploaded by us, or the one we restored)."""
        self.last_uploaded_step.set(max(step, self.last_uploaded_step.value or 0))

    def failed(self, sent: int) -> None:
        self.uploads.labels("failure").inc()
        self.bytes.inc(sent)

    def skipped(self) -> None:
        self.uploads.labels("skipped").inc()


class RestoreMetrics:
    """The start-up restore and readiness."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = LateGauge(
            "jitckpt_restore_seconds",
            "Seconds the last start-up restore attempt took (listing, download, verification).",
            registry,
        )
        self.restores = Counter(
            "jitckpt_restores",
            "Start-up restore attempts by result: success (downloaded), failure (tried again "
            "while the sidecar stays not ready), none (nothing newer in S3).",
            ["result"],
            registry=registry,
        )
        self.ready = Gauge(
            "jitckpt_sidecar_ready", "1 once the restore finished (readiness).", registry=registry
        )
        for result in RESTORE_RESULTS:
            self.restores.labels(result)

    def finished(self, result: str, seconds: float) -> None:
        self.restores.labels(result).inc()
        self.seconds.set(seconds)


class StorageCollector(Collector):
    """Capacity, usage, peak and pressure of the shared volume, measured at scrape time."""

    def __init__(self, storage: Storage, threshold: float) -> None:
        self.storage, self.threshold = storage, threshold

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sample = self.storage.sample()
        yield GaugeMetricFamily(
            "jitckpt_storage_capacity_bytes",
            "Capacity of the shared volume: the emptyDir sizeLimit, else the filesystem size.",
            value=sample.capacity,
        )
        yield GaugeMetricFamily(
            "jitckpt_storage_used_bytes",
            "Bytes allocated under JITCKPT_DIR (hard links counted once).",
            value=sample.used,
        )
        yield GaugeMetricFamily(
            "jitckpt_storage_peak_used_bytes",
            "Highest used bytes seen by this sidecar.",
            value=self.storage.peak,
        )
        yield GaugeMetricFamily(
            "jitckpt_storage_pressure_ratio",
            "Used bytes / capacity.",
            value=sample.ratio,
        )
        yield GaugeMetricFamily(
            "jitckpt_storage_pressure_threshold_ratio",
            "JITCKPT_DISK_PRESSURE_THRESHOLD: at this pressure ratio uploaded local checkpoints "
            "are deleted.",
            value=self.threshold,
        )


class StorageMetrics:
    def __init__(self, registry: CollectorRegistry, storage: Storage, threshold: float) -> None:
        registry.register(StorageCollector(storage, threshold))
        self.pruned = Counter(
            "jitckpt_storage_pruned",
            "Local checkpoints deleted under disk pressure (already committed in S3).",
            registry=registry,
        )


class Metrics:
    """Every group, on one registry."""

    def __init__(
        self,
        registry: CollectorRegistry,
        storage: Storage,
        *,
        queue_length: Callable[[], float],
        lag_seconds: Callable[[], float],
        oldest_pending_seconds: Callable[[], float],
        pressure_threshold: float,
    ) -> None:
        self.registry = registry
        self.checkpoints = CheckpointMetrics(registry)
        self.uploads = UploadMetrics(registry, queue_length, lag_seconds, oldest_pending_seconds)
        self.restore = RestoreMetrics(registry)
        self.storage = StorageMetrics(registry, storage, pressure_threshold)
