"""Checkpoint metrics come from the trainer's status files, each event counted once."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from prometheus_client import CollectorRegistry, generate_latest

from harness.prometheus import needs_promtool, promtool
from jitckpt_entrypoint.protocol import status
from jitckpt_sidecar.metric_names import ABSENT_UNTIL_KNOWN, METRICS, series_names
from jitckpt_sidecar.metrics import Metrics, PeerCollector
from jitckpt_sidecar.pressure import Storage
from jitckpt_sidecar.status_feed import StatusFeed
from jitckpt_sidecar.work_at_risk import WorkAtRisk


def build(
    tmp_path, threshold: float = 0.85, clock: Callable[[], float] = time.time
) -> tuple[CollectorRegistry, Metrics]:
    registry = CollectorRegistry()
    metrics = Metrics(
        registry,
        Storage(str(tmp_path), 10**9),
        queue_length=lambda: 0,
        lag_seconds=lambda: 0.0,
        oldest_pending_seconds=lambda: 0.0,
        pressure_threshold=threshold,
        risk=WorkAtRisk(str(tmp_path), clock),
    )
    return registry, metrics


def training(
    d: str, run: str, *, began_at: int, first_step_at: float, step: int, at: float
) -> None:
    """The status files of run `run` as the entrypoint and the hook write them while it trains:
    trainer.json (running), first-step.json, progress.json."""
    status.TRAINER.write(d, status.TrainerStatus(run, 1, ("torchrun",), first_step_at - 5))
    status.FIRST_STEP.write(d, status.FirstStep(run, began_at, first_step_at))
    status.PROGRESS.write(d, status.Progress(run, step, at))


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
    metrics.notice.to_durable.set(1.5)
    registry.register(PeerCollector(lambda: (time.time(), 10)))  # the service's, with a peer
    training(str(tmp_path), "r", began_at=120, first_step_at=time.time(), step=121, at=time.time())
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
    status.TRAINER.write(d, status.TrainerStatus("run-a", 1, ("x",), 104.0))
    status.FIRST_STEP.write(d, status.FirstStep("run-a", 40, 100.0))  # before the sidecar
    feed.restored(103.0, "s3", 5_000_000, own_start=103.0, first=True)  # the trainer at 104
    feed.poll()
    assert value("jitckpt_recovery_seconds", {"source": "s3"}) is None
    status.FIRST_STEP.write(d, status.FirstStep("run-a", 40, 115.5))
    status.FIRST_STEP.write(d, status.FirstStep("run-b", 40, 115.5))
    feed.poll()
    assert value("jitckpt_recovery_seconds", {"source": "s3"}) == 12.5
    assert value("jitckpt_recovery_bytes") == 5_000_000
    status.TRAINER.write(d, status.TrainerStatus("run-c", 1, ("x",), 200.0))
    status.FIRST_STEP.write(d, status.FirstStep("run-c", 50, 203.0))
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
    status.TRAINER.write(d, status.TrainerStatus("run-e", 1, ("x",), 240.0))
    status.FIRST_STEP.write(d, status.FirstStep("run-e", 60, 255.0))  # began before it
    restarted.poll()
    assert value("jitckpt_recovery_seconds", {"source": "local"}) == 3.0  # unchanged
    status.TRAINER.write(d, status.TrainerStatus("run-d", 1, ("x",), 260.0))
    status.FIRST_STEP.write(d, status.FirstStep("run-d", 60, 261.5))
    restarted.poll()
    assert value("jitckpt_recovery_seconds", {"source": "local"}) == 1.5
    status.TRAINER.write(d, status.TrainerStatus("run-f", 1, ("x",), 270.0))
    status.FIRST_STEP.write(d, status.FirstStep("run-f", 0, 272.0))  # started over
    restarted.poll()
    assert value("jitckpt_recovery_seconds", {"source": "none"}) == 2.0


def test_a_resume_from_ram_is_labelled_ram_and_peer_when_the_peer_replica_restored_it(tmp_path):
    """A replacement pod whose sidecar restored its snapshot from the peer (source `peer`, the
    bytes copied); its trainer restarted in place, from its own RAM (`ram`)."""
    registry, metrics = build(tmp_path)
    d = str(tmp_path)
    feed = StatusFeed(d, metrics.checkpoints, metrics.recovery)
    value = registry.get_sample_value
    feed.from_peer = (30, 7_000)
    feed.restored(100.0, "none", 0, own_start=100.0, first=True)
    status.TRAINER.write(d, status.TrainerStatus("run-a", 1, ("x",), 101.0))
    status.FIRST_STEP.write(d, status.FirstStep("run-a", 30, 108.0, in_ram=True))
    feed.poll()
    assert value("jitckpt_recovery_seconds", {"source": "peer"}) == 8.0
    assert value("jitckpt_recovery_bytes") == 7_000
    status.TRAINER.write(d, status.TrainerStatus("run-b", 1, ("x",), 200.0))
    status.FIRST_STEP.write(d, status.FirstStep("run-b", 36, 202.0, in_ram=True))
    feed.poll()
    assert value("jitckpt_recovery_seconds", {"source": "ram"}) == 2.0
    assert value("jitckpt_recovery_bytes") == 0


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
    training(str(tmp_path), "r", began_at=10, first_step_at=time.time(), step=12, at=time.time())
    text = generate_latest(registry)
    out = promtool("check", "metrics", stdin=text)
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    samples = [line for line in text.decode().splitlines() if not line.startswith("#")]
    assert len(samples) < 150


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def at_risk(registry: CollectorRegistry) -> dict[str, tuple[float, float]]:
    """durability -> (steps, seconds) at risk, as scraped."""
    out = {}
    for durability in ("s3", "volume"):
        steps = registry.get_sample_value("jitckpt_work_at_risk_steps", {"durability": durability})
        seconds = registry.get_sample_value(
            "jitckpt_work_at_risk_seconds", {"durability": durability}
        )
        assert (steps is None) == (seconds is None)
        if steps is not None and seconds is not None:
            out[durability] = (steps, seconds)
    return out


def test_work_at_risk_counts_from_the_newest_checkpoint_on_the_volume_and_in_s3(tmp_path):
    """Before any checkpoint the whole run is at risk; a save makes the volume's risk start
    again from its step and save start, its upload the S3 one; a save newer than progress.json
    (rewritten once a second) counts as reached."""
    clock = Clock(135.0)
    registry, metrics = build(tmp_path, clock=clock)
    d = str(tmp_path)
    feed = StatusFeed(d, metrics.checkpoints)
    assert at_risk(registry) == {}  # no trainer yet: absent, not 0
    training(d, "a", began_at=0, first_step_at=100.0, step=30, at=130.0)
    assert at_risk(registry) == {"s3": (30, 35.0), "volume": (30, 35.0)}
    status.write_save_event(d, status.SaveEvent("periodic", 20, 120.0, 121.0, 10, run_id="a"))
    feed.poll()
    assert at_risk(registry) == {"s3": (30, 35.0), "volume": (10, 15.0)}
    metrics.uploads.uploaded(20, 3.0, 10)
    assert at_risk(registry) == {"s3": (10, 15.0), "volume": (10, 15.0)}
    status.write_save_event(d, status.SaveEvent("periodic", 40, 133.0, 134.0, 10, run_id="a"))
    feed.poll()
    assert at_risk(registry) == {"s3": (20, 15.0), "volume": (0, 2.0)}
    metrics.uploads.failed(0)  # a failed upload changes nothing
    clock.now = 300.0
    assert at_risk(registry) == {"s3": (20, 180.0), "volume": (0, 167.0)}


def test_work_at_risk_stops_at_the_trainers_exit_and_never_mixes_runs(tmp_path):
    """After the trainer exited the seconds stay at its exit; a newer trainer hides the older
    run's progress until its own; a run resumed in place counts against the newest checkpoint
    at or before its start, from that save's start (the time down is at risk too); a run that
    started over ignores the checkpoints of the one before."""
    clock = Clock(150.0)
    registry, metrics = build(tmp_path, clock=clock)
    d = str(tmp_path)
    feed = StatusFeed(d, metrics.checkpoints)
    training(d, "a", began_at=0, first_step_at=100.0, step=45, at=139.0)
    for step, started in ((20, 120.0), (40, 135.0)):
        status.write_save_event(d, status.SaveEvent("periodic", step, started, started, 1, "a"))
    feed.poll()
    metrics.uploads.uploaded(20, 1.0, 1)
    exited = status.TrainerStatus("a", 1, ("torchrun",), 95.0, exited_at=140.0, exit_code=137)
    status.TRAINER.write(d, exited)
    clock.now = 400.0
    assert at_risk(registry) == {"s3": (25, 20.0), "volume": (5, 5.0)}

    status.TRAINER.write(d, status.TrainerStatus("b", 1, ("torchrun",), 395.0))
    assert at_risk(registry) == {}  # progress.json is still run a's
    training(d, "b", began_at=40, first_step_at=402.0, step=48, at=409.0)
    clock.now = 410.0
    assert at_risk(registry) == {"s3": (28, 290.0), "volume": (8, 275.0)}

    training(d, "c", began_at=0, first_step_at=500.0, step=60, at=530.0)  # JITCKPT_RESUME=0
    clock.now = 531.0
    assert at_risk(registry) == {"s3": (60, 31.0), "volume": (60, 31.0)}


def test_a_checkpoint_restored_at_start_is_at_no_risk_until_training_goes_on(tmp_path):
    """The restored checkpoint is on the volume and in S3: the risk counts from it, from the
    run's first step."""
    registry, metrics = build(tmp_path, clock=Clock(1010.0))
    metrics.checkpoints.on_volume(120)
    metrics.uploads.in_s3(120)
    training(str(tmp_path), "a", began_at=120, first_step_at=1000.0, step=125, at=1009.0)
    assert at_risk(registry) == {"s3": (5, 10.0), "volume": (5, 10.0)}


def test_a_step_saved_again_is_not_in_s3_until_its_own_upload(tmp_path):
    """JITCKPT_RESUME=0 (or an older resume point) saves a step number again: the earlier
    upload of that number is not this save."""
    clock = Clock(230.0)
    registry, metrics = build(tmp_path, clock=clock)
    d = str(tmp_path)
    feed = StatusFeed(d, metrics.checkpoints)
    training(d, "a", began_at=0, first_step_at=100.0, step=25, at=129.0)
    status.write_save_event(d, status.SaveEvent("periodic", 20, 120.0, 121.0, 1, run_id="a"))
    feed.poll()
    metrics.uploads.uploaded(20, 1.0, 1)
    feed.poll()  # the same save event again: still in S3
    assert at_risk(registry)["s3"][0] == 5
    training(d, "b", began_at=0, first_step_at=200.0, step=25, at=229.0)
    status.write_save_event(d, status.SaveEvent("periodic", 20, 220.0, 221.0, 1, run_id="b"))
    feed.poll()
    assert at_risk(registry) == {"s3": (25, 30.0), "volume": (5, 10.0)}
    metrics.uploads.uploaded(20, 1.0, 1)
    assert at_risk(registry) == {"s3": (5, 10.0), "volume": (5, 10.0)}
