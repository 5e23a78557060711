"""Retention in S3 and disk-pressure pruning on the volume follow their rules."""

from __future__ import annotations

import os
import re

import pytest

from harness.checkpoints import (
    SIDECAR,
    commit,
    hf_files,
    log_line,
    metrics_port,
    remote,
    scrape,
    sidecar_env,
    upload_directly,
    write_trainer,
)
from harness.procs import wait_for
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import validity
from jitckpt_entrypoint.protocol.layout import checkpoint_steps

pytestmark = [pytest.mark.integration, pytest.mark.s3_stores("moto", "rgw")]
MiB = 1024 * 1024


def test_retention_keeps_the_newest_committed_and_deletes_manifests_first(
    spawn, base_env, s3_bucket, proxy, tmp_path
):
    """With JITCKPT_S3_KEEP=2, an upload of checkpoint-30 over committed 10 and 20 deletes 10
    (manifests first), and keeps 20, 30, a newer partial 45 and a partial 5 without a manifest
    written just now (an upload in progress of another lineage, for all retention can tell: it
    goes once nothing was written in it for 30 minutes, test_sidecar_consistency)."""
    source = tmp_path / "source"
    for step in (5, 10, 20, 45):
        commit([source], step, [hf_files(step)])
        upload_directly(s3_bucket, source, step)
    for step in (5, 45):  # uploads that never finished: no manifest
        s3_bucket.delete(f"checkpoint-{step}", m.manifest_name(0))
    root = tmp_path / "node"
    commit([root], 30, [hf_files(30)])
    write_trainer(root, exited=True)
    env = s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)}, endpoint=proxy.url)
    proc = spawn(SIDECAR, env=sidecar_env(env, JITCKPT_S3_KEEP="2", JITCKPT_EXIT_WITH_TRAINER="1"))
    assert proc.wait(60) == 0, proc.output()

    assert remote(s3_bucket).steps() == [5, 20, 30, 45]
    assert remote(s3_bucket).committed_steps() == [20, 30]
    deletes = [r for r in proxy.log() if r.deleted and "/checkpoint-10/" in r.deleted[0]]
    assert deletes, "checkpoint-10 was not deleted"
    first, rest = deletes[0].deleted, [k for r in deletes[1:] for k in r.deleted]
    assert all(m.is_manifest_name(k.rsplit("/", 1)[1]) for k in first)
    assert not any(m.is_manifest_name(k.rsplit("/", 1)[1]) for k in rest)
    log_line(proc, r"retention: deleted checkpoint-10 ")
    assert not [r for r in proxy.log() if r.deleted and "/checkpoint-5/" in r.deleted[0]]


def test_a_superseded_checkpoint_in_the_backlog_is_skipped(spawn, base_env, s3_bucket, tmp_path):
    """With JITCKPT_S3_KEEP=1, a backlog of 10, 20, 30 uploads 30 and skips the older two,
    whose staged links are removed and counted as skipped."""
    root = tmp_path / "node"
    for step in (10, 20, 30):
        commit([root], step, [hf_files(step)])
    write_trainer(root)
    env = s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)})
    proc = spawn(SIDECAR, env=sidecar_env(env, JITCKPT_S3_KEEP="1"))
    port = metrics_port(proc)
    log_line(proc, r"skipping checkpoint-10: checkpoint-30 newer and committed in S3")

    def counted() -> dict:
        sample = scrape(port)
        return sample if sample[("jitckpt_uploads_total", (("result", "skipped"),))] == 2 else {}

    got = wait_for(counted, what="two skipped uploads")
    assert got[("jitckpt_uploads_total", (("result", "success"),))] == 1
    assert remote(s3_bucket).committed_steps() == [30]
    assert checkpoint_steps(str(root / "staging")) == []
    assert validity.committed_steps(str(root / "checkpoints")) == [10, 20, 30]  # local copies stay


def test_disk_pressure_deletes_only_old_local_checkpoints_already_committed_in_s3(
    spawn, base_env, s3_bucket, tmp_path
):
    """Above the threshold the sidecar deletes local checkpoints oldest first, only those
    committed in S3, never the newest local one, never one being written, and says it is stuck
    when nothing else may go."""
    root = tmp_path / "node"
    for step in (10, 20):
        commit([root], step, [hf_files(step, big=MiB)])
        upload_directly(s3_bucket, root, step)
    commit([root], 30, [hf_files(30, big=MiB)], staged=False)  # committed locally, not in S3
    commit([root], 40, [hf_files(40, big=MiB)], staged=False)  # the newest, not in S3 either
    writing = root / "checkpoints" / "checkpoint-50"  # a save in progress: no manifest yet
    writing.mkdir()
    (writing / "model.safetensors").write_bytes(b"\0" * MiB)
    write_trainer(root)
    env = s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)})
    proc = spawn(
        SIDECAR,
        env=sidecar_env(env, JITCKPT_STORAGE_CAPACITY="4Mi", JITCKPT_DISK_PRESSURE_THRESHOLD="0.5"),
    )
    port = metrics_port(proc)
    log_line(proc, r"no local checkpoint can be deleted")
    pruned = [
        int(match.group(1))
        for line in proc.stderr
        if (match := re.search(r"deleted local checkpoint-(\d+) \(committed in S3\)", line))
    ]
    assert pruned == [10, 20]
    assert sorted(os.listdir(root / "checkpoints")) == [
        "checkpoint-30",
        "checkpoint-40",
        "checkpoint-50",
    ]
    assert (writing / "model.safetensors").exists()
    got = scrape(port)
    assert got[("jitckpt_storage_pruned_total", ())] == 2
    assert got[("jitckpt_storage_pressure_ratio", ())] >= 0.5
    assert remote(s3_bucket).committed_steps() == [10, 20]  # S3 copies untouched


def test_disk_pressure_stops_deleting_once_below_the_threshold(
    spawn, base_env, s3_bucket, tmp_path
):
    """Relief stops as soon as used/capacity drops below the threshold."""
    root = tmp_path / "node"
    for step in (10, 20, 30):
        commit([root], step, [hf_files(step, big=MiB)])
        upload_directly(s3_bucket, root, step)
    write_trainer(root)
    env = s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)})
    # ~1.5 MiB per checkpoint: 4.5 MiB of 6 MiB is 0.75; dropping 10 gives 0.5, below 0.6.
    proc = spawn(
        SIDECAR,
        env=sidecar_env(env, JITCKPT_STORAGE_CAPACITY="6Mi", JITCKPT_DISK_PRESSURE_THRESHOLD="0.6"),
    )
    port = metrics_port(proc)
    log_line(proc, r"deleted local checkpoint-10 \(committed in S3\)")
    wait_for(lambda: scrape(port)[("jitckpt_storage_pruned_total", ())] == 1, what="one prune")
    assert validity.committed_steps(str(root / "checkpoints")) == [20, 30]
    assert scrape(port)[("jitckpt_storage_pressure_ratio", ())] < 0.6
