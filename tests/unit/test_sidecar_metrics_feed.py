"""Checkpoint metrics come from the trainer's status files, each event counted once."""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, generate_latest

from jitckpt_entrypoint import status
from jitckpt_sidecar.metrics import Metrics
from jitckpt_sidecar.pressure import Storage
from jitckpt_sidecar.status_feed import StatusFeed

NAMES = (
    "jitckpt_checkpoint_last_step",
    "jitckpt_checkpoint_saves_total",
    "jitckpt_checkpoint_save_seconds",
    "jitckpt_jit_trigger_to_commit_seconds",
    "jitckpt_uploads_total",
    "jitckpt_upload_bytes_total",
    "jitckpt_upload_seconds",
    "jitckpt_upload_queue_length",
    "jitckpt_last_uploaded_step",
    "jitckpt_upload_lag_seconds",
    "jitckpt_restore_seconds",
    "jitckpt_storage_capacity_bytes",
    "jitckpt_storage_used_bytes",
    "jitckpt_storage_peak_used_bytes",
    "jitckpt_storage_pressure_ratio",
    "jitckpt_upload_retries_total",
    "jitckpt_restores_total",
    "jitckpt_storage_pruned_total",
    "jitckpt_s3_deleted_total",
    "jitckpt_sidecar_ready",
)


def build(tmp_path) -> tuple[CollectorRegistry, Metrics]:
    registry = CollectorRegistry()
    metrics = Metrics(registry, Storage(str(tmp_path), 10**9), lambda: 0, lambda: 0.0)
    return registry, metrics


def test_every_contract_metric_is_exposed_on_a_fresh_registry(tmp_path):
    """All names from DESIGN.md and the additions exist from the start (two registries too)."""
    registry, _ = build(tmp_path)
    build(tmp_path)  # no global state: a second set registers fine
    text = generate_latest(registry).decode()
    for name in NAMES:
        assert f"\n{name}" in text or text.startswith(name) or f"# TYPE {name}" in text, name


def test_save_events_and_the_jit_record_are_counted_once(tmp_path):
    """Polling twice counts each save event once; a rewritten JIT record updates the gauge."""
    registry, metrics = build(tmp_path)
    feed = StatusFeed(str(tmp_path), metrics.checkpoints)
    now = time.time()
    status.write_save_event(str(tmp_path), status.SaveEvent("periodic", 5, now - 2, now, 10))
    status.write_save_event(str(tmp_path), status.SaveEvent("jit", 7, now - 1, now, 10))
    record = status.JitRecord("r", 7, "checkpoint-7", now, now - 3.5, 1.0)
    status.write_jit(str(tmp_path), record)
    feed.poll()
    feed.poll()
    value = registry.get_sample_value
    assert value("jitckpt_checkpoint_saves_total", {"kind": "periodic"}) == 1
    assert value("jitckpt_checkpoint_saves_total", {"kind": "jit"}) == 1
    assert value("jitckpt_checkpoint_save_seconds_sum", {"kind": "periodic"}) == 2
    assert value("jitckpt_checkpoint_last_step") == 7
    assert value("jitckpt_jit_trigger_to_commit_seconds") == 3.5
    status.write_jit(str(tmp_path), status.JitRecord("r2", 9, "checkpoint-9", now, now - 1.25, 1.0))
    feed.poll()
    assert value("jitckpt_jit_trigger_to_commit_seconds") == 1.25
    assert not os.path.exists(os.path.join(tmp_path, "trainer.json"))
    assert feed.trainer() is None
