"""The metrics the sidecar exports: the contract that k8s/monitoring/ is checked against.

One place for the names, types and labels, so that the dashboard, the alert rules and the
sidecar's own collectors can be reconciled with one import (tests/k8s checks the first two).
"""

from __future__ import annotations

# name -> (type, label names). "histogram" means the _bucket/_sum/_count series exist. The
# contract types only the two histograms; the other types are read off the names (`_total` =
# counter) and matter nowhere but here.
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "jitckpt_checkpoint_last_step": ("gauge", ()),
    "jitckpt_checkpoint_saves_total": ("counter", ("kind",)),
    "jitckpt_checkpoint_save_seconds": ("histogram", ("kind",)),
    "jitckpt_jit_trigger_to_commit_seconds": ("gauge", ()),
    "jitckpt_uploads_total": ("counter", ("result",)),
    "jitckpt_upload_bytes_total": ("counter", ()),
    "jitckpt_upload_seconds": ("histogram", ()),
    "jitckpt_upload_queue_length": ("gauge", ()),
    "jitckpt_last_uploaded_step": ("gauge", ()),
    "jitckpt_upload_lag_seconds": ("gauge", ()),
    "jitckpt_upload_oldest_pending_age_seconds": ("gauge", ()),
    "jitckpt_restore_seconds": ("gauge", ()),
    "jitckpt_storage_capacity_bytes": ("gauge", ()),
    "jitckpt_storage_used_bytes": ("gauge", ()),
    "jitckpt_storage_peak_used_bytes": ("gauge", ()),
    "jitckpt_storage_pressure_ratio": ("gauge", ()),
    "jitckpt_storage_pressure_threshold_ratio": ("gauge", ()),
    "jitckpt_upload_retries_total": ("counter", ()),
    "jitckpt_restores_total": ("counter", ("result",)),
    "jitckpt_storage_pruned_total": ("counter", ()),
    "jitckpt_s3_deleted_total": ("counter", ()),
    "jitckpt_sidecar_ready": ("gauge", ()),
}

# Label values the contract fixes, per metric and label.
LABEL_VALUES: dict[tuple[str, str], tuple[str, ...]] = {
    ("jitckpt_checkpoint_saves_total", "kind"): ("periodic", "jit", "final"),
    ("jitckpt_checkpoint_save_seconds", "kind"): ("periodic", "jit", "final"),
    ("jitckpt_uploads_total", "result"): ("success", "failure", "skipped"),
    ("jitckpt_restores_total", "result"): ("success", "failure", "none"),
}

# Gauges with no sample until their value is known: "no JIT checkpoint yet" must not read as a
# 0 s SIGTERM-to-commit, nor "nothing restored yet" as step 0.
ABSENT_UNTIL_KNOWN = (
    "jitckpt_checkpoint_last_step",
    "jitckpt_jit_trigger_to_commit_seconds",
    "jitckpt_last_uploaded_step",
    "jitckpt_restore_seconds",
)

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def series_names() -> dict[str, str]:
    """Every series name a scrape can contain -> the metric it belongs to."""
    out = {}
    for name, (kind, _) in METRICS.items():
        out[name] = name
        if kind == "histogram":
            out.update({name + suffix: name for suffix in HISTOGRAM_SUFFIXES})
    return out
