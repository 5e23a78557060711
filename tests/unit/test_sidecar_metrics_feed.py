"""Checkpoint metrics come from the trainer's status files, each event counted once."""

from __future__ import annotations

import logging
import os
import time

from prometheus_client import CollectorRegistry, generate_latest

from harness.prometheus import needs_promtool, promtool
from jitckpt_entrypoint.protocol import status
from jitckpt_sidecar.metric_names import ABSENT_UNTIL_KNOWN, METRICS, series_names
from jitckpt_sidecar.metrics import Metrics
from jitckpt_sidecar.pressure import Storage
from jitckpt_sidecar.status_feed import StatusFeed


def build(tmp_path, threshold: float = 0.85) -> tuple[CollectorRegistry, Metrics]:
    registry = CollectorRegistry()
    metrics = Metrics(
        registry,
        Storage(str(tmp_path), 10**9),
        queue_length=lambda: 0,
        lag_seconds=lambda: 0.0,
        oldest_pending_seconds=lambda: 0.0,
        pressure_threshold=threshold,
    )
    return registry, metrics


def exposed(registry: CollectorRegistry) -> set[str]:
    """The metric_names.METRICS with at least one sample in a scrape (every sample must
    belong to one; prometheus_client's own `_created` series aside)."""
    from prometheus_client.parser import text_string_to_metric_families

    series = series_names()
    text = generate_latest(registry).decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    names = {n for n in names if not n.endswith("_created")}
    assert names <= set(series), names - set(series)
    return {series[n] for n in names}


def test_every_metric_is_exposed_on_a_fresh_registry_except_the_unknown_ones(tmp_path):
    """Every name of metric_names.METRICS (DESIGN.md's and the additions) has a sample from
    the start, except the gauges whose value is not known yet: no sample, not a 0."""
    registry, _ = build(tmp_path)
    build(tmp_path)  # no global state: a second set registers fine
    assert exposed(registry) == set(METRICS) - set(ABSENT_UNTIL_KNOWN)


def test_unknown_gauges_appear_with_their_first_value(tmp_path):
    """The last step, the JIT time, the last uploaded step and the restore time appear once
    known; a restored checkpoint counts as the last step on the volume and as in S3."""
    registry, metrics = build(tmp_path, threshold=0.7)
    metrics.checkpoints.on_volume(120)
    metrics.uploads.in_s3(120)
    metrics.restore.finished("success", 2.5)
    metrics.checkpoints.jit(status.JitRecord("r", 7, "checkpoint-7", 10.0, 8.0, 1.0))
    metrics.recovery.recovered(12.5, "s3", 1000)
    assert exposed(registry) == set(METRICS)
    value = registry.get_sample_value
    assert value("jitckpt_checkpoint_last_step") == 120
    assert value("jitckpt_last_uploaded_step") == 120
    assert value("jitckpt_restore_seconds") == 2.5
    assert value("jitckpt_jit_trigger_to_commit_seconds") == 2.0
    assert value("jitckpt_storage_pressure_threshold_ratio") == 0.7
    metrics.uploads.uploaded(110, 1.0, 5)  # an older one: the newest in S3 stays 120
    assert value("jitckpt_last_uploaded_step") == 120


def test_histogram_buckets_separate_saves_from_10_ms_to_an_hour(tmp_path):
    """A 20 ms save and a 40 min upload each land in a bucket of their own order."""
    registry, metrics = build(tmp_path)
    metrics.uploads.uploaded(1, 2400.0, 1)
    now = time.time()
    metrics.checkpoints.saved(status.SaveEvent("periodic", 5, now - 0.02, now, 10))
    value = registry.get_sample_value
    bucket = "jitckpt_checkpoint_save_seconds_bucket"
    assert value(bucket, {"kind": "periodic", "le": "0.01"}) == 0
    assert value(bucket, {"kind": "periodic", "le": "0.025"}) == 1
    assert value("jitckpt_upload_seconds_bucket", {"le": "1200.0"}) == 0
    assert value("jitckpt_upload_seconds_bucket", {"le": "3600.0"}) == 1


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


def test_recovery_is_timed_from_the_pod_start_then_from_each_trainer_restart(tmp_path, caplog):
    """The first trainer after the restore: from the sidecar's start, with the restore's
    source and bytes. A trainer restarted in the pod: from its own start, from the volume.
    A record older than the sidecar (it restarted mid-run) is not its to time."""
    registry, metrics = build(tmp_path)
    d = str(tmp_path)
    feed = StatusFeed(d, metrics.checkpoints, metrics.recovery, logging.getLogger("test"))
    value = registry.get_sample_value
    status.write_trainer(d, status.TrainerStatus("run-a", 1, ("x",), 104.0))
    status.write_first_step(d, status.FirstStep("run-a", 40, 100.0))  # before the sidecar
    feed.restored(103.0, "s3", 5_000_000, own_start=103.0, first=True)  # the trainer at 104
    feed.poll()
    assert value("jitckpt_recovery_seconds", {"source": "s3"}) is None
    status.write_first_step(d, status.FirstStep("run-a", 40, 115.5))
    status.write_first_step(d, status.FirstStep("run-b", 40, 115.5))
    feed.poll()
    assert value("jitckpt_recovery_seconds", {"source": "s3"}) == 12.5
    assert value("jitckpt_recovery_bytes") == 5_000_000
    status.write_trainer(d, status.TrainerStatus("run-c", 1, ("x",), 200.0))
    status.write_first_step(d, status.FirstStep("run-c", 50, 203.0))
    with caplog.at_level(logging.INFO):
        feed.poll()
        feed.poll()
    assert value("jitckpt_recovery_seconds", {"source": "s3"}) is None  # one sample: the last
    assert value("jitckpt_recovery_seconds", {"source": "local"}) == 3.0
    assert value("jitckpt_recovery_bytes") == 0
    (line,) = [r.getMessage() for r in caplog.records if "recovered" in r.getMessage()]
    assert "the trainer's restart to the first training step (from checkpoint-50) in 3.0 s" in line

    restarted = StatusFeed(d, metrics.checkpoints, metrics.recovery)  # the sidecar restarted
    restarted.restored(250.0, "local", 0, own_start=250.0, first=False)
    status.write_trainer(d, status.TrainerStatus("run-e", 1, ("x",), 240.0))
    status.write_first_step(d, status.FirstStep("run-e", 60, 255.0))  # began before it
    restarted.poll()
    assert value("jitckpt_recovery_seconds", {"source": "local"}) == 3.0  # unchanged
    status.write_trainer(d, status.TrainerStatus("run-d", 1, ("x",), 260.0))
    status.write_first_step(d, status.FirstStep("run-d", 60, 261.5))
    restarted.poll()
    assert value("jitckpt_recovery_seconds", {"source": "local"}) == 1.5
    status.write_trainer(d, status.TrainerStatus("run-f", 1, ("x",), 270.0))
    status.write_first_step(d, status.FirstStep("run-f", 0, 272.0))  # started over
    restarted.poll()
    assert value("jitckpt_recovery_seconds", {"source": "none"}) == 2.0


def test_the_first_long_running_sidecar_of_a_pod_is_told_from_a_restarted_one(tmp_path):
    assert status.first_sidecar_in_pod(str(tmp_path))
    assert not status.first_sidecar_in_pod(str(tmp_path))


@needs_promtool
def test_promtool_finds_nothing_to_lint_in_a_full_scrape(tmp_path):
    """With every metric holding a value, `promtool check metrics` (names, units, HELP,
    counters' _total) reports nothing, and a scrape stays small (bounded labels)."""
    registry, metrics = build(tmp_path)
    metrics.checkpoints.on_volume(10)
    metrics.uploads.in_s3(10)
    metrics.restore.finished("success", 1.0)
    metrics.checkpoints.jit(status.JitRecord("r", 7, "checkpoint-7", 10.0, 8.0, 1.0))
    metrics.recovery.recovered(12.5, "s3", 1000)
    text = generate_latest(registry)
    out = promtool("check", "metrics", stdin=text)
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    samples = [line for line in text.decode().splitlines() if not line.startswith("#")]
    assert len(samples) < 150
