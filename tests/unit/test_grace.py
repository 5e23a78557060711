"""The start-up estimate of whether the grace period fits a JIT save and its upload."""

from __future__ import annotations

import os

from jitckpt_entrypoint import grace
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.layout import Layout


def make(tmp_path, step: int, size: int, save_seconds: float) -> Layout:
    layout = Layout(str(tmp_path))
    layout.ensure()
    d = layout.checkpoint_dir(step)
    os.makedirs(d)
    with open(os.path.join(d, "model.bin"), "wb") as f:
        f.truncate(size)
    files = m.assign_owners({0: m.list_files(d)})[0]
    man = m.new_manifest(
        step, "periodic", node=0, nodes=1, world_size=1, files=files, save_seconds=save_seconds
    )
    m.write_manifest(d, man)
    return layout


def test_no_checkpoint_no_estimate(tmp_path):
    """Nothing saved yet: nothing to estimate, no warning."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    assert grace.estimate(layout) is None


def test_a_save_longer_than_torchruns_timeout_warns_with_the_fix(tmp_path):
    """A 10 s save against a 30 s grace (torchrun kills at 22 s) is fine; against 8 s it warns."""
    est = grace.estimate(make(tmp_path, 40, 2_000_000, 10.0))
    assert est is not None
    assert (est.checkpoint, est.bytes, est.save_seconds) == ("checkpoint-40", 2_000_000, 10.0)
    assert grace.warning(est, 30, 22) is None
    line = grace.warning(est, 8, 6)
    assert line is not None
    assert "checkpoint-40" in line
    assert "JITCKPT_GRACE_SECONDS to at least" in line
    assert "\n" not in line


def test_the_upload_counts_when_the_sidecar_measured_a_throughput(tmp_path):
    """With the sidecar's measured rate, save + upload must fit the grace period."""
    layout = make(tmp_path, 5, 100_000_000, 1.0)
    ready = status.SidecarReady(0.0, 1, "s3", 5, 10.0, 100_000_000, 10_000_000)
    status.SIDECAR_READY.write(layout.status, ready)
    est = grace.estimate(layout)
    assert est is not None
    assert est.upload_seconds == 10.0
    assert grace.warning(est, 30, 22) is None
    warning = grace.warning(est, 10, 7)
    assert warning is not None
    assert "uploading it about 10.0 s" in warning
