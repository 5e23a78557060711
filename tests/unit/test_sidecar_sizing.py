"""Storage sizing: the save peak sampled while the trainer saves, and the per-pod estimate."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from harness.checkpoints import commit
from harness.procs import wait_for
from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.layout import Layout
from jitckpt_sidecar import sizing
from jitckpt_sidecar.pressure import Storage

MB = 1_000_000


def test_quantity_rounds_up_to_a_whole_mebibyte_or_gibibyte():
    """The sizeLimit named is never below the estimate."""
    assert sizing.quantity(1) == "1Mi"
    assert sizing.quantity(4 * 1024**2) == "4Mi"
    assert sizing.quantity(4 * 1024**2 + 1) == "5Mi"
    assert sizing.quantity(10 * 1024**3) == "10240Mi"
    assert sizing.quantity(10 * 1024**3 + 1) == "11Gi"


def test_estimate_is_restored_plus_n_checkpoints_plus_peak_plus_final_plus_ten_percent(tmp_path):
    """Node 1 of two: restored = every node's files, checkpoint = its own part, final model =
    its model files (FSDP's pytorch_model_fsdp_0/ shards), N = save_total_limit."""
    roots = [tmp_path / "n0", tmp_path / "n1"]
    files = [
        {"pytorch_model_fsdp_0/__0_0.distcp": 2 * MB, "optimizer_0/__0_0.distcp": 4 * MB},
        {"pytorch_model_fsdp_0/__1_0.distcp": 2 * MB, "optimizer_0/__1_0.distcp": 4 * MB},
    ]
    commit(roots, 10, files, staged=False)
    node = status.NodeStatus("run", 1, 2, 3)
    got = sizing.estimate(Layout(str(roots[1])), node, save_peak=7 * MB, restored=0)
    assert got is not None
    assert (got.node, got.step, got.restored, got.checkpoint) == (1, 10, 12 * MB, 6 * MB)
    assert (got.keep, got.final, got.save_peak) == (3, 2 * MB, 7 * MB)
    assert got.total == round((12 + 3 * 6 + 7 + 2) * MB * 1.1)
    line = got.line(4 * 1024**2)
    assert "restored checkpoint 12.0 MB + 3 x checkpoint 6.0 MB (save_total_limit=3)" in line
    assert "save peak 7.0 MB + final model 2.0 MB + 10% = 42.9 MB" in line
    assert line.endswith("to at least 41Mi (now 4Mi)")


def test_no_estimate_before_the_first_checkpoint_and_n_is_one_without_a_limit(tmp_path):
    """Nothing saved yet: no line. Without save_total_limit pressure keeps one checkpoint."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    assert sizing.estimate(layout, None, 0, 0) is None
    commit([tmp_path], 5, [{"model.safetensors": MB, "optimizer.pt": 2 * MB}], staged=False)
    got = sizing.estimate(layout, None, 0, restored=5 * MB)
    assert got is not None
    assert (got.keep, got.restored, got.final) == (1, 5 * MB, MB)
    assert "save_total_limit unset" in got.line(None)


def test_save_peak_is_the_highest_usage_during_a_save_over_its_start(tmp_path: Path):
    """A save that writes 3 MB of checkpoint plus a 2 MB temporary file it removes again: the
    peak over the start is at least 5 MB; the save event of that step ends the sampling."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    peaks = sizing.SavePeaks(Storage(str(tmp_path), None), layout.status, logging.getLogger("t"))
    peaks.start()
    try:
        status.SAVING.write(layout.status, status.SaveStart("run", 7, time.time()))
        peaks.wake()
        ckpt = Path(layout.checkpoint_dir(7))
        ckpt.mkdir()
        (ckpt / "model.safetensors").write_bytes(os.urandom(3 * MB))
        (ckpt / "consolidating.tmp").write_bytes(os.urandom(2 * MB))
        time.sleep(0.3)  # several sampling intervals
        (ckpt / "consolidating.tmp").unlink()
        status.write_save_event(
            layout.status, status.SaveEvent("periodic", 7, 0.0, time.time(), 3 * MB, "run")
        )
        peaks.wake()
        wait_for(lambda: peaks.last > 0, 10, "the save peak")
    finally:
        peaks.stop()
    assert 5 * MB <= peaks.last < 6 * MB
    assert peaks.highest == peaks.last


def test_a_save_seen_after_its_commit_is_not_measured(tmp_path: Path):
    """A sidecar that starts after the save finished has no baseline: it measures nothing."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    status.SAVING.write(layout.status, status.SaveStart("run", 3, time.time()))
    status.write_save_event(layout.status, status.SaveEvent("periodic", 3, 0.0, 1.0, 10, "run"))
    peaks = sizing.SavePeaks(Storage(str(tmp_path), None), layout.status, logging.getLogger("t"))
    measured = threading.Event()
    peaks._measure = lambda _start: measured.set()  # type: ignore[method-assign]
    peaks.start()
    peaks.wake()
    time.sleep(0.2)
    peaks.stop()
    assert not measured.is_set()
    assert peaks.last == 0


def test_bytes_a_save_wrote_before_the_sampler_saw_it_still_count(tmp_path: Path):
    """A fast save writes much before inotify wakes the sampler: the baseline is the volume at
    rest before the save, not the first sample after saving.json appeared."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    peaks = sizing.SavePeaks(Storage(str(tmp_path), None), layout.status, logging.getLogger("t"))
    peaks.start()
    try:
        peaks.wake()
        wait_for(lambda: peaks._at_rest is not None, 10, "a sample at rest")
        ckpt = Path(layout.checkpoint_dir(9))
        ckpt.mkdir()
        (ckpt / "model.safetensors").write_bytes(os.urandom(3 * MB))  # before saving.json is seen
        status.SAVING.write(layout.status, status.SaveStart("run", 9, time.time()))
        peaks.wake()
        time.sleep(0.2)
        status.write_save_event(
            layout.status, status.SaveEvent("periodic", 9, 0.0, time.time(), 3 * MB, "run")
        )
        peaks.wake()
        wait_for(lambda: peaks.last > 0, 10, "the save peak")
    finally:
        peaks.stop()
    assert 3 * MB <= peaks.last < 4 * MB
