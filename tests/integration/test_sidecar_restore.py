"""`jitckpt-sidecar restore` on a real S3 server: newest committed, verified, manifests last."""

from __future__ import annotations

import json
import os

import pytest

from harness.checkpoints import SIDECAR, commit, data, hf_files, log_line, upload_directly
from jitckpt_entrypoint import manifest as m

pytestmark = [pytest.mark.integration, pytest.mark.s3_stores("moto", "rgw")]


def two_node_files(step: int) -> list[dict[str, bytes | int]]:
    """Node 0 holds the model and its RNG state; node 1 its RNG state; both the trainer state."""
    state = f'{{"global_step": {step}}}\n'.encode()
    node0 = {**hf_files(step), "trainer_state.json": state, "rng_state_0.pth": data(700, step)}
    if step == 10:  # the one restored: a shard large enough for ranged GETs (5 MiB ranges)
        node0["model-2.safetensors"] = data(11 * 1024 * 1024, step)
    node1 = {"trainer_state.json": state, "rng_state_1.pth": data(900, step + 7)}
    return [node0, node1]


def test_restore_picks_the_newest_committed_checkpoint_and_passes_over_broken_ones(
    spawn, base_env, s3_bucket, tmp_path
):
    """Newer checkpoints with a node's manifest missing, a short object, a corrupted object
    or no manifest at all are ignored; the newest committed one is restored and the trainer's
    resume (manifest.committed / newest_committed) accepts it for every node."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    originals = {}
    for step in (10, 20, 30, 40, 50):
        commit(nodes, step, two_node_files(step))
        originals[step] = two_node_files(step)
        upload_directly(s3_bucket, nodes[0], step)
        if step != 40:  # checkpoint-40: node 1 never uploaded (its manifest is missing)
            upload_directly(s3_bucket, nodes[1], step)
    # checkpoint-20: same size, different bytes (only the checksum can tell).
    size = len(s3_bucket.get("checkpoint-20", "model.safetensors"))
    s3_bucket.put(data(size, 999), "checkpoint-20", "model.safetensors")
    # checkpoint-30: a short object.
    s3_bucket.put(b"short", "checkpoint-30", "optimizer.pt")
    # checkpoint-50: files present, every manifest gone.
    s3_bucket.delete("checkpoint-50", m.manifest_name(0))
    s3_bucket.delete("checkpoint-50", m.manifest_name(1))

    root = tmp_path / "restored"
    leftover = root / "checkpoints" / ".jitckpt-restore-10-1"
    leftover.mkdir(parents=True)  # a restore killed earlier
    env = s3_bucket.env({**base_env, "JITCKPT_DIR": str(root), "JITCKPT_DOWNLOAD_CHUNK": "5Mi"})
    proc = spawn([*SIDECAR, "restore"], env=env)
    assert proc.wait(60) == 0, proc.output()

    checkpoints = str(root / "checkpoints")
    assert sorted(os.listdir(checkpoints)) == ["checkpoint-10"]
    assert m.newest_committed(checkpoints, node=0) == 10
    assert m.newest_committed(checkpoints, node=1) == 10
    manifests = m.committed(os.path.join(checkpoints, "checkpoint-10"))
    assert manifests is not None
    assert sorted(manifests) == [0, 1]
    for node_files in originals[10]:
        for rel, content in node_files.items():
            assert (root / "checkpoints" / "checkpoint-10" / rel).read_bytes() == content, rel
    ready = json.loads((root / "status" / "sidecar-ready.json").read_text())
    assert (ready["restore"], ready["step"]) == ("s3", 10)
    sizes = {f.path: f.size for man in manifests.values() for f in man.files}
    assert ready["restore_bytes"] == sum(sizes.values())
    assert ready["restore_bytes_per_second"] > 0  # the entrypoint's grace estimate reads it
    log_line(proc, r"skipping checkpoint-50 in S3: not committed \(no manifest\)")
    log_line(proc, r"skipping checkpoint-40 in S3: not committed \(manifest of node 1 missing\)")
    log_line(proc, r"skipping checkpoint-30 in S3: not committed \(optimizer.pt: object has 5")
    log_line(proc, r"discarding checkpoint-20 from S3: model.safetensors does not match")
    log_line(proc, r"restored checkpoint-10: \d+ files, [\d.]+ MB in [\d.]+ s \([\d.]+ MB/s\)")


def test_restore_with_nothing_in_s3_is_ready_at_once(spawn, base_env, s3_bucket, tmp_path):
    """An empty prefix restores nothing, exits 0 and writes the ready file."""
    root = tmp_path / "fresh"
    proc = spawn([*SIDECAR, "restore"], env=s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)}))
    assert proc.wait(60) == 0, proc.output()
    assert os.listdir(root / "checkpoints") == []
    ready = json.loads((root / "status" / "sidecar-ready.json").read_text())
    assert (ready["restore"], ready["step"]) == ("none", None)
    assert "restore_bytes_per_second" not in ready


def test_restore_keeps_a_local_checkpoint_that_is_as_new_as_s3(
    spawn, base_env, s3_bucket, tmp_path
):
    """When the volume already holds a committed checkpoint at least as new (a container
    restart in the same pod), nothing is downloaded."""
    root = tmp_path / "node"
    commit([root], 5, [hf_files(5)])
    upload_directly(s3_bucket, root, 5)
    commit([root], 7, [hf_files(7)], staged=False)
    proc = spawn([*SIDECAR, "restore"], env=s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)}))
    assert proc.wait(60) == 0, proc.output()
    log_line(proc, r"local checkpoint-7 is committed and at least as new as S3's")
    assert sorted(os.listdir(root / "checkpoints")) == ["checkpoint-5", "checkpoint-7"]
    assert not any("restoring" in line for line in proc.stderr)


def test_restore_replaces_an_uncommitted_local_directory_of_the_same_step(
    spawn, base_env, s3_bucket, tmp_path
):
    """A torn local checkpoint-<step> (no manifest) is replaced by the committed S3 copy."""
    source = tmp_path / "source"
    commit([source], 3, [hf_files(3)])
    upload_directly(s3_bucket, source, 3)
    root = tmp_path / "node"
    torn = root / "checkpoints" / "checkpoint-3"
    torn.mkdir(parents=True)
    (torn / "model.safetensors").write_bytes(b"torn")
    proc = spawn([*SIDECAR, "restore"], env=s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)}))
    assert proc.wait(60) == 0, proc.output()
    assert m.committed(str(torn)) is not None
    assert (torn / "model.safetensors").read_bytes() == hf_files(3)["model.safetensors"]
