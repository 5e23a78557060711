"""Disk usage like du (hard links once); which local checkpoints retention and pressure delete."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import Optional

from harness.checkpoints import commit
from jitckpt_entrypoint.protocol import commit as protocol_commit
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import status, validity
from jitckpt_entrypoint.protocol.commit import remove_checkpoint
from jitckpt_entrypoint.protocol.layout import Layout, checkpoint_steps
from jitckpt_sidecar.pressure import Pruner, Storage, used_bytes

MiB = 1024 * 1024


def du(path) -> int:
    out = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def committed_checkpoint(layout: Layout, step: int, size: int = MiB, lineage: str = "") -> None:
    ckpt = layout.checkpoint_dir(step)
    os.makedirs(ckpt)
    with open(os.path.join(ckpt, "model.bin"), "wb") as f:
        f.write(os.urandom(size))
    files = (m.FileEntry("model.bin", size),)
    m.write_manifest(
        ckpt,
        m.new_manifest(
            step, "periodic", node=0, nodes=1, world_size=1, files=files, lineage=lineage
        ),
    )


def test_used_bytes_counts_hard_links_once_and_agrees_with_du(tmp_path):
    """A staged hard link adds no bytes; the total is what du (and the kubelet) reports."""
    layout = Layout(str(tmp_path))
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


def test_a_file_linked_while_the_volume_is_walked_is_counted_once(tmp_path, monkeypatch):
    """The hook hard-links a checkpoint file into staging/ between our visits of its two paths
    (seen with one link, then with two): still one file's bytes."""
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "staging").mkdir()
    (tmp_path / "checkpoint" / "model.bin").write_bytes(os.urandom(MiB))
    before = used_bytes(str(tmp_path))
    real_scandir = os.scandir

    def scandir(path):
        entries = list(real_scandir(path))
        if path == str(tmp_path):  # walk checkpoint/ first (the walk is a stack)
            entries.sort(key=lambda e: e.name != "staging")
        if path.endswith("checkpoint"):
            for entry in entries:
                entry.stat(follow_symlinks=False)  # seen with one link...
            os.link(entry.path, tmp_path / "staging" / "model.bin")  # ...then staged
        return iter(entries)

    monkeypatch.setattr(os, "scandir", scandir)
    assert used_bytes(str(tmp_path)) - before < MiB


def pruner(
    layout: Layout,
    capacity: int,
    threshold: float,
    in_s3: set[int],
    pruned: list[int],
    node: Optional[status.NodeStatus] = None,
    logger: Optional[logging.Logger] = None,
):
    """A Pruner whose S3 holds `in_s3` (whole checkpoints, or this node's part of them)."""
    return Pruner(
        layout,
        Storage(layout.root, capacity),
        threshold=threshold,
        in_s3=lambda step, _node: step in in_s3,
        node=lambda: node,
        logger=logger or logging.getLogger("test"),
        on_pruned=pruned.append,
        size_limit=lambda: "9Mi",
    )


def test_relief_deletes_oldest_first_and_stops_below_the_threshold(tmp_path):
    """Four 1 MiB checkpoints in 5 MiB at 0.6: deleting 10 and 20 brings it under 3 MiB."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    for step in (10, 20, 30, 40):
        committed_checkpoint(layout, step)
    pruned: list[int] = []
    assert pruner(layout, 5 * MiB, 0.6, {10, 20, 30, 40}, pruned).prune() == [10, 20]
    assert pruned == [10, 20]
    assert validity.committed_steps(layout.checkpoints) == [30, 40]


def test_a_stopped_pruner_deletes_and_says_nothing(tmp_path, caplog):
    """The sidecar is exiting (its summary is its last line): a pass asked before, or one
    under way, deletes nothing more, and logs nothing."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    for step in (10, 20, 30):
        committed_checkpoint(layout, step)
    pruned: list[int] = []
    prune = pruner(layout, MiB, 0.1, {10, 20}, pruned)
    prune.stop()
    with caplog.at_level(logging.INFO):
        assert prune.prune() == []
    assert pruned == []
    assert caplog.records == []
    assert validity.committed_steps(layout.checkpoints) == [10, 20, 30]


def test_a_no_from_before_an_upload_ended_is_not_remembered(tmp_path):
    """S3 says no about checkpoint-10 while its upload commits (forget() during the question):
    that no is stale, and the next pass asks again, and deletes it."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    for step in (10, 20):
        committed_checkpoint(layout, step)
    asked: list[int] = []

    def in_s3(step: int, _node: object) -> bool:
        asked.append(step)
        if len(asked) == 1:
            prune.forget()  # the upload worker, meanwhile
            return False
        return True

    prune = Pruner(
        layout,
        Storage(layout.root, MiB),
        threshold=0.1,
        in_s3=in_s3,
        logger=logging.getLogger("test"),
    )
    assert prune.prune() == []
    assert prune.prune() == [10]
    assert asked == [10, 10]


def test_relief_never_deletes_the_newest_one_not_in_s3_or_one_being_written(tmp_path):
    """Only committed, uploaded, not-newest checkpoints go, however high the pressure."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    for step in (10, 20, 30):
        committed_checkpoint(layout, step)
    os.makedirs(layout.checkpoint_dir(40))  # being written: no manifest
    with open(os.path.join(layout.checkpoint_dir(40), "model.bin"), "wb") as f:
        f.write(b"x" * MiB)
    pruned: list[int] = []
    assert pruner(layout, MiB, 0.1, {10, 30}, pruned).prune() == [10]
    assert sorted(os.listdir(layout.checkpoints)) == [
        "checkpoint-20",
        "checkpoint-30",
        "checkpoint-40",
    ]


def test_no_pressure_no_deletion(tmp_path):
    """Below the threshold nothing is touched."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    committed_checkpoint(layout, 10)
    committed_checkpoint(layout, 20)
    assert pruner(layout, 100 * MiB, 0.85, {10, 20}, []).prune() == []
    assert validity.committed_steps(layout.checkpoints) == [10, 20]


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


def node_parts(root: Path, steps: list[int]) -> tuple[Layout, Layout]:
    """Two nodes' volumes after saving `steps`: each holds only its own part (FSDP shards)."""
    roots = [root / "node0", root / "node1"]
    for step in steps:
        commit(
            roots,
            step,
            [{"shard-0.distcp": 300_000, "trainer_state.json": 50}, {"shard-1.distcp": 300_000}],
            staged=False,
        )
    return Layout(str(roots[0])), Layout(str(roots[1]))


def node1(limit: Optional[int], best: Optional[int] = None) -> status.NodeStatus:
    return status.NodeStatus("run", 1, 2, limit, best)


def test_retention_keeps_save_total_limit_parts_on_a_node_hf_does_not_rotate(tmp_path):
    """Node 1 holds only its part of each checkpoint: it keeps the newest save_total_limit and
    deletes older parts once S3 holds them (HF rotates only on process 0)."""
    _, layout = node_parts(tmp_path, [5, 10, 15, 20])
    pruned: list[int] = []
    assert pruner(layout, 100 * MiB, 0.85, {5, 10, 15, 20}, pruned, node1(2)).prune() == [5, 10]
    assert checkpoint_steps(layout.checkpoints) == [15, 20]
    assert pruned == [5, 10]


def test_retention_waits_for_s3_and_keeps_the_best_and_one_being_written(tmp_path):
    """A part S3 does not hold yet stays (deleted once it does); HF's best checkpoint and a
    checkpoint still being written are never touched."""
    _, layout = node_parts(tmp_path, [5, 10, 15, 20, 25])
    os.makedirs(layout.checkpoint_dir(30))  # being written: no manifest yet
    in_s3 = {5, 15, 20, 25}
    prune = pruner(layout, 100 * MiB, 0.85, in_s3, [], node1(2, best=5))
    assert prune.prune() == [15]
    assert checkpoint_steps(layout.checkpoints) == [5, 10, 20, 25, 30]
    in_s3.add(10)
    assert prune.prune() == [], "S3's answer is remembered until the next upload or rescan"
    prune.forget()
    assert prune.prune() == [10]
    assert checkpoint_steps(layout.checkpoints) == [5, 20, 25, 30]


def test_without_a_limit_or_node_status_retention_keeps_everything(tmp_path):
    """save_total_limit unset keeps every checkpoint (HF's rule); before the trainer wrote
    node.json the parts are not even recognised as committed (not held in full)."""
    _, layout = node_parts(tmp_path, [5, 10, 15])
    assert pruner(layout, 100 * MiB, 0.85, {5, 10, 15}, [], node1(None)).prune() == []
    assert pruner(layout, 100 * MiB, 0.85, {5, 10, 15}, [], None).prune() == []
    assert checkpoint_steps(layout.checkpoints) == [5, 10, 15]


def test_pressure_relief_deletes_a_nodes_parts_that_s3_holds(tmp_path):
    """Under pressure node 1 deletes its parts once S3 holds them, whatever the limit."""
    _, layout = node_parts(tmp_path, [5, 10, 15])
    pruned: list[int] = []
    prune = pruner(layout, 700_000, 0.5, {5, 10, 15}, pruned, node1(None))
    assert prune.prune() == [5, 10]
    assert checkpoint_steps(layout.checkpoints) == [15]


def test_stuck_pressure_names_what_holds_the_bytes_and_a_fix_that_works_on_this_node(
    tmp_path, caplog
):
    """Nothing deletable: the warning names the newest, the parts not in S3 and the sizing
    estimate, and never suggests lowering save_total_limit (which cannot help here)."""
    _, layout = node_parts(tmp_path, [5, 10, 15])
    logger = logging.getLogger("test.stuck")
    with caplog.at_level(logging.WARNING, logger="test.stuck"):
        pruner(layout, 300_000, 0.5, set(), [], node1(2), logger).prune()
    (message,) = [r.getMessage() for r in caplog.records]
    assert "no local checkpoint can be deleted" in message
    assert "checkpoint-15 is the newest" in message
    assert "checkpoint-5, checkpoint-10 not in S3 yet" in message
    assert "to at least 9Mi" in message
    assert "lower" not in message


def test_removing_a_checkpoint_another_process_is_removing_is_not_an_error(tmp_path, monkeypatch):
    """HF's rotation on process 0 may delete the same directory while we list it."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    committed_checkpoint(layout, 10)
    listed = [m.manifest_name(0), m.manifest_name(1)]  # node 1's is gone by the time we unlink
    monkeypatch.setattr(protocol_commit, "_listdir", lambda _path: listed)
    remove_checkpoint(layout.checkpoint_dir(10))
    assert not os.path.exists(layout.checkpoint_dir(10))


def test_pressure_deletes_an_earlier_runs_checkpoints_before_the_newest_runs(tmp_path):
    """A volume holds an earlier run's checkpoint-400 and -500 and the newer run's 300 (the
    one restored, a lower step): pressure deletes the earlier run's first, never the newest
    run's only checkpoint, and resume still finds 300 newest."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    for step in (400, 500):
        committed_checkpoint(layout, step, lineage="20250101T000000000Z-aaaa")
    committed_checkpoint(layout, 300, lineage="20260101T000000000Z-bbbb")
    pruned: list[int] = []
    pruner = Pruner(
        layout,
        Storage(layout.root, 4 * MiB),
        threshold=0.6,
        in_s3=lambda _step, _node: True,
        logger=logging.getLogger("test"),
        on_pruned=pruned.append,
    )
    pruner.prune()
    assert pruned == [400]
    assert validity.committed_steps(layout.checkpoints) == [500, 300]
