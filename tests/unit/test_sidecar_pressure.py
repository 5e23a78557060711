"""Disk usage like du (hard links once) and the pruning rules under pressure."""

from __future__ import annotations

import logging
import os
import subprocess

from jitckpt_entrypoint import manifest as m
from jitckpt_sidecar.pressure import Pruner, Storage, used_bytes

MiB = 1024 * 1024


def du(path) -> int:
    out = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def committed_checkpoint(layout: m.Layout, step: int, size: int = MiB) -> None:
    ckpt = layout.checkpoint_dir(step)
    os.makedirs(ckpt)
    with open(os.path.join(ckpt, "model.bin"), "wb") as f:
        f.write(os.urandom(size))
    files = (m.FileEntry("model.bin", size),)
    m.write_manifest(
        ckpt, m.new_manifest(step, "periodic", node=0, nodes=1, world_size=1, files=files)
    )


def test_used_bytes_counts_hard_links_once_and_agrees_with_du(tmp_path):
    """A staged hard link adds no bytes; the total is what du (and the kubelet) reports."""
    layout = m.Layout(str(tmp_path))
    layout.ensure()
    committed_checkpoint(layout, 10)
    before = used_bytes(str(tmp_path))
    os.makedirs(os.path.join(layout.staging, "checkpoint-10"))
    os.link(
        os.path.join(layout.checkpoint_dir(10), "model.bin"),
        os.path.join(layout.staging, "checkpoint-10", "model.bin"),
    )
    after = used_bytes(str(tmp_path))
    assert after - before <= 8192  # one more directory, no more file bytes
    assert after == du(tmp_path)
    assert after >= MiB


def pruner(layout: m.Layout, capacity: int, threshold: float, in_s3: set[int], pruned: list[int]):
    return Pruner(
        layout,
        Storage(layout.root, capacity),
        threshold=threshold,
        in_s3=lambda step: step in in_s3,
        logger=logging.getLogger("test"),
        on_pruned=pruned.append,
    )


def test_relief_deletes_oldest_first_and_stops_below_the_threshold(tmp_path):
    """Four 1 MiB checkpoints in 5 MiB at 0.6: deleting 10 and 20 brings it under 3 MiB."""
    layout = m.Layout(str(tmp_path))
    layout.ensure()
    for step in (10, 20, 30, 40):
        committed_checkpoint(layout, step)
    pruned: list[int] = []
    assert pruner(layout, 5 * MiB, 0.6, {10, 20, 30, 40}, pruned).relieve() == [10, 20]
    assert pruned == [10, 20]
    assert m.committed_steps(layout.checkpoints) == [30, 40]


def test_relief_never_deletes_the_newest_one_not_in_s3_or_one_being_written(tmp_path):
    """Only committed, uploaded, not-newest checkpoints go, however high the pressure."""
    layout = m.Layout(str(tmp_path))
    layout.ensure()
    for step in (10, 20, 30):
        committed_checkpoint(layout, step)
    os.makedirs(layout.checkpoint_dir(40))  # being written: no manifest
    with open(os.path.join(layout.checkpoint_dir(40), "model.bin"), "wb") as f:
        f.write(b"x" * MiB)
    pruned: list[int] = []
    assert pruner(layout, MiB, 0.1, {10, 30}, pruned).relieve() == [10]
    assert sorted(os.listdir(layout.checkpoints)) == [
        "checkpoint-20",
        "checkpoint-30",
        "checkpoint-40",
    ]


def test_no_pressure_no_deletion(tmp_path):
    """Below the threshold nothing is touched."""
    layout = m.Layout(str(tmp_path))
    layout.ensure()
    committed_checkpoint(layout, 10)
    committed_checkpoint(layout, 20)
    assert pruner(layout, 100 * MiB, 0.85, {10, 20}, []).relieve() == []
    assert m.committed_steps(layout.checkpoints) == [10, 20]


def test_storage_remembers_its_peak_and_uses_the_filesystem_size_without_a_limit(tmp_path):
    """Without JITCKPT_STORAGE_CAPACITY the capacity is the filesystem's size."""
    storage = Storage(str(tmp_path), None)
    (tmp_path / "f").write_bytes(b"x" * MiB)
    high = storage.sample().used
    (tmp_path / "f").unlink()
    low = storage.sample()
    st = os.statvfs(tmp_path)
    assert low.capacity == st.f_blocks * st.f_frsize
    assert storage.peak == high > low.used
