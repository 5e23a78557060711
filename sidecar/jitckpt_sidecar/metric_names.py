"""The metrics the sidecar exports, each defined once: name, type, HELP, labels, buckets.

metrics.py builds its collectors from these definitions; k8s/monitoring/ (tests/k8s), the
metrics table (docs/monitoring.md) and every scrape in the tests are checked against them.
Standard library only, so tools and docs can read it without prometheus_client.
"""

from __future__ import annotations

import dataclasses

from jitckpt_entrypoint.protocol.manifest import KINDS

UPLOAD_RESULTS = ("success", "failure", "skipped")
RESTORE_RESULTS = ("success", "failure", "none")
SECONDS_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600, 1200, 3600
)  # fmt: skip
"""10 ms to an hour: saves of small models take 20-250 ms, uploads of large ones many minutes."""
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str
    """As exported: counters end in _total; a histogram's series add HISTOGRAM_SUFFIXES."""
    type: str
    """gauge, counter or histogram."""
    help: str
    labels: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(label name, the values the contract fixes), each value exported from the start (a
    late gauge's samples, once known, carry some of them)."""
    buckets: tuple[float, ...] = ()
    doc: str = ""
    """The metrics table's meaning column (markdown); the HELP text when empty."""
    late: bool = False
    """No sample until the value is known: "no JIT checkpoint yet" must not read as a 0 s
    SIGTERM-to-commit, nor "nothing restored yet" as step 0."""

    @property
    def label_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.labels)


METRICS: dict[str, Metric] = {}
"""Every metric, by exported name, in the order defined below (the order of a scrape)."""
Label = tuple[str, tuple[str, ...]]


def _define(metric: Metric) -> Metric:
    if metric.name in METRICS:
        raise ValueError(f"metric {metric.name} defined twice")
    METRICS[metric.name] = metric
    return metric


def _gauge(name: str, text: str, *, doc: str = "", late: bool = False) -> Metric:
    return _define(Metric(name, "gauge", text, doc=doc, late=late))


def _counter(name: str, text: str, *labels: Label, doc: str = "") -> Metric:
    return _define(Metric(name, "counter", text, labels, doc=doc))


def _histogram(name: str, text: str, *labels: Label, doc: str = "") -> Metric:
    return _define(Metric(name, "histogram", text, labels, SECONDS_BUCKETS, doc=doc))


# Checkpoints (from the trainer's status files and the restore).
CHECKPOINT_LAST_STEP = _gauge(
    "jitckpt_checkpoint_last_step",
    "Step of the newest committed checkpoint on the shared volume (saved or restored).",
    late=True,
    doc=(
        "step of the newest committed checkpoint on the volume: saved by the trainer "
        "(`status/save-*.json`) or restored; absent before the first"
    ),
)
CHECKPOINT_SAVES = _counter(
    "jitckpt_checkpoint_saves_total",
    "Checkpoints the trainer committed locally, by kind (periodic, jit, final).",
    ("kind", KINDS),
    doc="local commits by kind",
)
CHECKPOINT_SAVE_SECONDS = _histogram(
    "jitckpt_checkpoint_save_seconds",
    "Seconds from the start of a save to its local commit, by kind.",
    ("kind", KINDS),
    doc="save start to local commit (buckets 10 ms to 1 h)",
)
JIT_TRIGGER_TO_COMMIT = _gauge(
    "jitckpt_jit_trigger_to_commit_seconds",
    "Seconds from SIGTERM to the commit of the last JIT checkpoint.",
    late=True,
    doc=(
        "SIGTERM to commit of the last JIT checkpoint (`status/jit.json`); absent before "
        "one. Only the terminating pod's sidecar has it, while it uploads that "
        "checkpoint: a scrape interval shorter than that upload sees it (the trainer's "
        "termination message always says it)"
    ),
)
# Uploads and S3 retention.
UPLOADS = _counter(
    "jitckpt_uploads_total",
    "Checkpoint uploads by result: success, failure (retried later) or skipped "
    "(superseded; retention would delete it).",
    ("result", UPLOAD_RESULTS),
    doc=(
        "checkpoint uploads; `result`: `success`, `failure` (retried later), `skipped` "
        "(superseded: retention would delete it)"
    ),
)
UPLOAD_BYTES = _counter(
    "jitckpt_upload_bytes_total",
    "Bytes sent to S3 by uploads.",
    doc="bytes sent by completed uploads",
)
UPLOAD_SECONDS = _histogram(
    "jitckpt_upload_seconds",
    "Seconds per successful checkpoint upload.",
    doc=(
        "duration of each successful checkpoint upload (buckets 10 ms to 1 h); "
        "`rate(jitckpt_upload_bytes_total) / rate(jitckpt_upload_seconds_sum)` is the "
        "upload speed"
    ),
)
UPLOAD_QUEUE_LENGTH = _gauge(
    "jitckpt_upload_queue_length",
    "Committed checkpoints not yet in S3 (waiting or uploading).",
    doc="committed checkpoints not yet in S3 (waiting or uploading)",
)
LAST_UPLOADED_STEP = _gauge(
    "jitckpt_last_uploaded_step",
    "Step of the newest checkpoint committed in S3 that this sidecar uploaded or restored.",
    late=True,
    doc=(
        "newest step committed in S3 that this sidecar uploaded or restored; absent "
        "before the first"
    ),
)
UPLOAD_LAG = _gauge(
    "jitckpt_upload_lag_seconds",
    "Age of the newest committed checkpoint not yet in S3 (0 when none).",
    doc=(
        "age of the newest committed checkpoint not yet in S3; 0 when none (it starts "
        "again near 0 with every commit, so it stays small through an outage)"
    ),
)
UPLOAD_OLDEST_PENDING_AGE = _gauge(
    "jitckpt_upload_oldest_pending_age_seconds",
    "Age of the oldest committed checkpoint not yet in S3 (0 when none): grows through "
    "an S3 outage while new checkpoints keep arriving.",
    doc=(
        "age of the oldest committed checkpoint not yet in S3; 0 when none (grows through "
        "an outage: what `JitckptUploadLag` alerts on)"
    ),
)
UPLOAD_RETRIES = _counter(
    "jitckpt_upload_retries_total",
    "S3 requests retried (throttling, 5xx, resets), uploads and restores retried.",
    doc=(
        "S3 requests retried (throttling, 5xx, connection errors) plus whole uploads and "
        "restores started again"
    ),
)
S3_DELETED = _counter(
    "jitckpt_s3_deleted_total",
    "Checkpoints deleted from S3 by retention (JITCKPT_S3_KEEP).",
    doc="checkpoints deleted from S3 by retention (`JITCKPT_S3_KEEP`)",
)
# The start-up restore and readiness.
RESTORE_SECONDS = _gauge(
    "jitckpt_restore_seconds",
    "Seconds the last start-up restore attempt took (listing, download, verification).",
    late=True,
    doc=(
        "duration of the last start-up restore attempt (listing, download, verification); "
        "absent before one ended"
    ),
)
RESTORES = _counter(
    "jitckpt_restores_total",
    "Start-up restore attempts by result: success (downloaded), failure (tried again "
    "while the sidecar stays not ready), none (nothing newer in S3).",
    ("result", RESTORE_RESULTS),
    doc=(
        "start-up restore attempts; a restore ends before the first scrape, so count "
        "series (`count by (result) (jitckpt_restores_total > 0)`) rather than "
        "`increase()`; `result`: `success` (downloaded), `failure` (tried again, not "
        "ready meanwhile), `none` (nothing newer in S3)"
    ),
)
SIDECAR_READY = _gauge(
    "jitckpt_sidecar_ready",
    "1 once the restore finished (readiness).",
    doc="1 once a restore succeeded; 0 while it runs or keeps failing",
)
RECOVERY_SOURCES = ("s3", "local", "ram", "peer", "none")
RECOVERY_SECONDS = _define(
    Metric(
        "jitckpt_recovery_seconds",
        "gauge",
        "Seconds from the pod's start (or the trainer container's restart) to the first "
        "training step finished, by where the checkpoint came from (s3, local, ram, peer, "
        "none).",
        (("source", RECOVERY_SOURCES),),
        late=True,
        doc=(
            "the last recovery: the pod's start (this sidecar's) or the trainer container's "
            "restart, to its first optimizer step finished (`status/first-step.json`); one "
            "sample, `source`: `s3` (restored), `local` (the volume's), `ram` (a snapshot in "
            "`JITCKPT_MEMORY_DIR`), `peer` (a snapshot the peer replica restored), `none` (began "
            "at step 0); absent before the first step. A plain loop records it when it passes the "
            "step: `should_stop(step)`"
        ),
    )
)
RECOVERY_BYTES = _gauge(
    "jitckpt_recovery_bytes",
    "Bytes downloaded from S3 for the last recovery (0 when the volume had the checkpoint).",
    late=True,
    doc="bytes downloaded for the last recovery (0 from the volume); absent before the first",
)
# The cluster's notice before SIGTERM (notice.py).
NOTICE_SOURCES = ("node", "pod")
NOTICES = _counter(
    "jitckpt_notices_total",
    "Notices before SIGTERM seen (a notice taint on this pod's node, a notice condition on "
    "the pod), each answered by a save asked of the trainer.",
    ("source", NOTICE_SOURCES),
    doc=(
        "notices seen before SIGTERM, each answered by a save asked of the trainer: a taint of "
        '`JITCKPT_NOTICE_TAINTS` on this pod\'s node or a cordon (`source="node"`), a '
        "condition of `JITCKPT_NOTICE_CONDITIONS` on the pod (`pod`)"
    ),
)
NOTICE_TO_DURABLE = _gauge(
    "jitckpt_notice_to_durable_seconds",
    "Seconds from the last notice to the save it asked for committed in S3.",
    late=True,
    doc=(
        "the last notice to the save it asked for committed in S3 (this node's part); absent "
        "until one is"
    ),
)
# Work at risk: the trainer's progress against the newest durable checkpoints (work_at_risk.py).
DURABILITIES = ("s3", "volume")
WORK_AT_RISK_STEPS = _define(
    Metric(
        "jitckpt_work_at_risk_steps",
        "gauge",
        "Optimizer steps since the newest checkpoint of this run committed in S3 (s3) or on "
        "the shared volume (volume): what a failure without notice would lose.",
        (("durability", DURABILITIES),),
        late=True,
        doc=(
            "what a failure without notice (node loss, OOM kill) would lose now: the "
            "trainer's newest finished step (`status/progress.json`, once a second) minus the "
            "step of the newest checkpoint of its run (saved in it, or the one it resumed "
            'from; with none, the step it began at) committed in S3 (`durability="s3"`: '
            "uploaded or restored by this sidecar; on several nodes, this node's part) or on "
            "the volume (`volume`; a plain loop writes progress with `should_stop(step)`). "
            "Absent until the running trainer (`status/trainer.json`) wrote progress of its "
            "own run; after "
            "it exited it stays at its exit value until the JIT or final checkpoint is durable"
        ),
    )
)
WORK_AT_RISK_SECONDS = _define(
    Metric(
        "jitckpt_work_at_risk_seconds",
        "gauge",
        "Seconds of this run's training since the step of the newest checkpoint committed in "
        "S3 (s3) or on the shared volume (volume) was reached.",
        (("durability", DURABILITIES),),
        late=True,
        doc=(
            "the same in seconds of this run's training: now (the trainer's exit once it "
            "exited) minus that checkpoint's save start (`status/save-<step>.json`), or minus "
            "the run's first step when this run did not save it (it resumed from it, or there "
            "is none: the time before was not its training); what `JitckptWorkAtRisk` alerts on"
        ),
    )
)
# The shared volume (read from the disk at scrape time).
STORAGE_CAPACITY = _gauge(
    "jitckpt_storage_capacity_bytes",
    "Capacity of the shared volume: the emptyDir sizeLimit, else the filesystem size.",
    doc=(
        "`JITCKPT_STORAGE_CAPACITY` (the emptyDir `sizeLimit`), else the filesystem size; "
        "read at scrape time"
    ),
)
STORAGE_USED = _gauge(
    "jitckpt_storage_used_bytes",
    "Bytes allocated under JITCKPT_DIR (hard links counted once).",
    doc=("allocated bytes under `JITCKPT_DIR`, hard links counted once; read at scrape time"),
)
STORAGE_PEAK_USED = _gauge(
    "jitckpt_storage_peak_used_bytes",
    "Highest used bytes seen by this sidecar.",
    doc="highest used bytes seen by this sidecar",
)
STORAGE_PRESSURE = _gauge(
    "jitckpt_storage_pressure_ratio",
    "Used bytes / capacity.",
    doc="used / capacity",
)
STORAGE_PRESSURE_THRESHOLD = _gauge(
    "jitckpt_storage_pressure_threshold_ratio",
    "JITCKPT_DISK_PRESSURE_THRESHOLD: at this pressure ratio uploaded local checkpoints "
    "are deleted.",
    doc=("`JITCKPT_DISK_PRESSURE_THRESHOLD`: at this ratio uploaded local checkpoints are deleted"),
)
STORAGE_PRUNED = _counter(
    "jitckpt_storage_pruned_total",
    "Local checkpoints deleted by per-node retention (save_total_limit) or under disk "
    "pressure, each once S3 held it.",
    doc=(
        "local checkpoints deleted by per-node retention (`save_total_limit`) or under "
        "disk pressure, each once S3 held it"
    ),
)
STORAGE_SAVE_PEAK = _gauge(
    "jitckpt_storage_save_peak_bytes",
    "Peak used bytes during the last checkpoint save over the usage when it began (the "
    "new checkpoint plus what the save wrote and removed again).",
    doc=(
        "the last save's peak used bytes over the usage when it began: the new checkpoint "
        "plus what the save wrote and removed again (sampled every 50 ms)"
    ),
)
# The peer replica (peer.py; only with JITCKPT_PEERS).
PEER_REPLICA_AGE = _gauge(
    "jitckpt_peer_replica_age_seconds",
    "Seconds since the snapshot this sidecar keeps of its peer node was taken; +Inf while it "
    "keeps none.",
    late=True,
    doc=(
        "age of the newest snapshot of the node before this one in the ring that this sidecar "
        "keeps (`JITCKPT_PEERS`); `+Inf` while it keeps none; absent without the peer replica"
    ),
)
PEER_REPLICA_BYTES = _gauge(
    "jitckpt_peer_replica_bytes",
    "Bytes of the snapshot this sidecar keeps of its peer node (0 while none).",
    late=True,
    doc="bytes of that snapshot in this pod's memory volume; absent without the peer replica",
)

LABEL_VALUES: dict[tuple[str, str], tuple[str, ...]] = {
    (m.name, label): values for m in METRICS.values() for label, values in m.labels
}
"""The label values the contract fixes, per metric and label."""
ABSENT_UNTIL_KNOWN = tuple(m.name for m in METRICS.values() if m.late)


def series_names() -> dict[str, str]:
    """Every series name a scrape can contain -> the metric it belongs to."""
    out = {}
    for metric in METRICS.values():
        out[metric.name] = metric.name
        if metric.type == "histogram":
            out.update({metric.name + suffix: metric.name for suffix in HISTOGRAM_SUFFIXES})
    return out
