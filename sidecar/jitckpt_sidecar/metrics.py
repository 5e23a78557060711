"""Prometheus metrics, one group per concern, each registered on the registry passed in.

Every name, type, HELP text, label and bucket comes from metric_names.py (the contract that
dashboards, alerts and the README use); this module only builds and feeds the collectors:
checkpoints (from the trainer's status files and the restore), uploads and S3 retention, the
restore and readiness, the work at risk and the shared volume (both read from the disk at
scrape time).

Gauges whose value is not known yet (no checkpoint, no JIT save, no restore finished) have no
sample rather than a 0 that reads as a value (Metric.late).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from typing import Callable, Optional, TypeVar, Union

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from jitckpt_entrypoint.protocol.manifest import KINDS
from jitckpt_entrypoint.protocol.status import JitRecord, SaveEvent
from jitckpt_sidecar import metric_names as names
from jitckpt_sidecar.metric_names import Metric
from jitckpt_sidecar.pressure import Storage
from jitckpt_sidecar.work_at_risk import WorkAtRisk

Labelled = TypeVar("Labelled", bound=Union[Counter, Histogram])


def counter(spec: Metric, registry: CollectorRegistry) -> Counter:
    return _with_labels(spec, Counter(spec.name, spec.help, spec.label_names, registry=registry))


def histogram(spec: Metric, registry: CollectorRegistry) -> Histogram:
    metric = Histogram(
        spec.name, spec.help, spec.label_names, buckets=spec.buckets, registry=registry
    )
    return _with_labels(spec, metric)


def gauge(
    spec: Metric, registry: CollectorRegistry, value: Optional[Callable[[], float]] = None
) -> Gauge:
    """A gauge, read from `value` at scrape time when given."""
    metric = Gauge(spec.name, spec.help, registry=registry)
    if value is not None:
        metric.set_function(value)
    return metric


def _with_labels(spec: Metric, metric: Labelled) -> Labelled:
    """Every label value the contract fixes, exported from the start (at 0)."""
    if spec.labels:
        for values in itertools.product(*(values for _, values in spec.labels)):
            metric.labels(*values)
    return metric


class LateGauge(Collector):
    """A gauge with no sample until its first value: absence says "none yet", where a 0 would
    read as a value (a 0 s SIGTERM-to-commit, step 0)."""

    def __init__(self, spec: Metric, registry: CollectorRegistry) -> None:
        self.spec = spec
        self.value: Optional[float] = None
        self._labels: tuple[str, ...] = ()
        registry.register(self)

    def set(self, value: float, *labels: str) -> None:
        """The value; with the spec's labels, the one sample's label values."""
        self.value, self._labels = value, labels

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(self.spec.name, self.spec.help, labels=self.spec.label_names)]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        value, labels = self.value, self._labels
        if value is None:
            return
        if not self.spec.labels:
            yield GaugeMetricFamily(self.spec.name, self.spec.help, value=value)
            return
        family = GaugeMetricFamily(self.spec.name, self.spec.help, labels=self.spec.label_names)
        family.add_metric(list(labels), value)
        yield family


class CheckpointMetrics:
    """What the trainer saved, from status/save-<step>.json and status/jit.json."""

    def __init__(self, registry: CollectorRegistry, risk: WorkAtRisk) -> None:
        self.risk = risk
        self.last_step = LateGauge(names.CHECKPOINT_LAST_STEP, registry)
        self.saves = counter(names.CHECKPOINT_SAVES, registry)
        self.save_seconds = histogram(names.CHECKPOINT_SAVE_SECONDS, registry)
        self.jit_trigger_to_commit = LateGauge(names.JIT_TRIGGER_TO_COMMIT, registry)

    def saved(self, event: SaveEvent) -> None:
        kind = event.kind if event.kind in KINDS else "periodic"
        self.saves.labels(kind).inc()
        self.save_seconds.labels(kind).observe(max(0.0, event.seconds))
        self.risk.saved(event)
        self.on_volume(event.step)

    def on_volume(self, step: int) -> None:
        """checkpoint-<step> is committed on the volume (saved, or restored before training)."""
        self.last_step.set(max(step, self.last_step.value or 0))
        self.risk.on_volume(step)

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
        risk: WorkAtRisk,
    ) -> None:
        self.risk = risk
        self.uploads = counter(names.UPLOADS, registry)
        self.bytes = counter(names.UPLOAD_BYTES, registry)
        self.seconds = histogram(names.UPLOAD_SECONDS, registry)
        self.queue_length = gauge(names.UPLOAD_QUEUE_LENGTH, registry, queue_length)
        self.last_uploaded_step = LateGauge(names.LAST_UPLOADED_STEP, registry)
        self.lag = gauge(names.UPLOAD_LAG, registry, lag_seconds)
        self.oldest_pending = gauge(
            names.UPLOAD_OLDEST_PENDING_AGE, registry, oldest_pending_seconds
        )
        self.retries = counter(names.UPLOAD_RETRIES, registry)
        self.s3_deleted = counter(names.S3_DELETED, registry)

    def uploaded(self, step: int, seconds: float, sent: int) -> None:
        self.uploads.labels("success").inc()
        self.seconds.observe(seconds)
        self.bytes.inc(sent)
        self.in_s3(step)

    def in_s3(self, step: int) -> None:
        """checkpoint-<step> is committed in S3 (uploaded by us, or the one we restored)."""
        self.last_uploaded_step.set(max(step, self.last_uploaded_step.value or 0))
        self.risk.in_s3(step)

    def failed(self, sent: int) -> None:
        self.uploads.labels("failure").inc()
        self.bytes.inc(sent)

    def skipped(self) -> None:
        self.uploads.labels("skipped").inc()


class RestoreMetrics:
    """The start-up restore and readiness."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = LateGauge(names.RESTORE_SECONDS, registry)
        self.restores = counter(names.RESTORES, registry)
        self.ready = gauge(names.SIDECAR_READY, registry)

    def finished(self, result: str, seconds: float) -> None:
        self.restores.labels(result).inc()
        self.seconds.set(seconds)


class NoticeMetrics:
    """The cluster's notices before SIGTERM and how soon the save each asked for was in S3."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.notices = counter(names.NOTICES, registry)
        self.to_durable = LateGauge(names.NOTICE_TO_DURABLE, registry)

    def seen(self, source: str) -> None:
        self.notices.labels(source).inc()


class RecoveryMetrics:
    """The last recovery: start to the first training step, where from, bytes downloaded."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = LateGauge(names.RECOVERY_SECONDS, registry)
        self.bytes = LateGauge(names.RECOVERY_BYTES, registry)

    def recovered(self, seconds: float, source: str, nbytes: int) -> None:
        self.seconds.set(max(0.0, seconds), source)
        self.bytes.set(nbytes)


class WorkAtRiskCollector(Collector):
    """Steps and seconds at risk per durability, measured at scrape time (status files read
    then); a durability has no sample while the value is not known."""

    def __init__(self, risk: WorkAtRisk) -> None:
        self.risk = risk

    def describe(self) -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(spec.name, spec.help, labels=spec.label_names)
            for spec in (names.WORK_AT_RISK_STEPS, names.WORK_AT_RISK_SECONDS)
        ]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            measured = self.risk.measure()
        except OSError:  # a status file unreadable now (EIO, permissions): no sample, no 500
            return
        if not measured:
            return
        steps, seconds = self.describe()
        for durability, risk in sorted(measured.items()):
            steps.add_metric([durability], risk.steps)
            seconds.add_metric([durability], risk.seconds)
        yield steps
        yield seconds


class StorageCollector(Collector):
    """Capacity, usage, peak and pressure of the shared volume, measured at scrape time."""

    def __init__(self, storage: Storage, threshold: float) -> None:
        self.storage, self.threshold = storage, threshold

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sample = self.storage.sample()
        for spec, value in (
            (names.STORAGE_CAPACITY, sample.capacity),
            (names.STORAGE_USED, sample.used),
            (names.STORAGE_PEAK_USED, self.storage.peak),
            (names.STORAGE_PRESSURE, sample.ratio),
            (names.STORAGE_PRESSURE_THRESHOLD, self.threshold),
        ):
            yield GaugeMetricFamily(spec.name, spec.help, value=value)


class PeerCollector(Collector):
    """The peer replica's age and bytes, at scrape time (registered only with the replica on):
    `held` gives the kept snapshot's creation time (None while none is kept) and bytes, or
    None for no sample (training has ended: nothing is snapshotted to keep)."""

    def __init__(self, held: Callable[[], Optional[tuple[Optional[float], int]]]) -> None:
        self.held = held

    def collect(self) -> Iterator[GaugeMetricFamily]:
        held = self.held()
        if held is None:
            return
        created_at, nbytes = held
        age = math.inf if created_at is None else max(0.0, time.time() - created_at)
        for spec, value in ((names.PEER_REPLICA_AGE, age), (names.PEER_REPLICA_BYTES, nbytes)):
            yield GaugeMetricFamily(spec.name, spec.help, value=value)


class StorageMetrics:
    def __init__(self, registry: CollectorRegistry, storage: Storage, threshold: float) -> None:
        registry.register(StorageCollector(storage, threshold))
        self.pruned = counter(names.STORAGE_PRUNED, registry)
        self.save_peak = gauge(names.STORAGE_SAVE_PEAK, registry)


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
        risk: WorkAtRisk,
    ) -> None:
        self.registry = registry
        self.risk = risk
        self.checkpoints = CheckpointMetrics(registry, risk)
        self.uploads = UploadMetrics(
            registry, queue_length, lag_seconds, oldest_pending_seconds, risk
        )
        self.restore = RestoreMetrics(registry)
        self.recovery = RecoveryMetrics(registry)
        self.notice = NoticeMetrics(registry)
        registry.register(WorkAtRiskCollector(risk))
        self.storage = StorageMetrics(registry, storage, pressure_threshold)
