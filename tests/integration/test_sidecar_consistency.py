"""One consistent checkpoint in S3, whatever happened before: the sidecar's own uploader and
restore against a real S3 server (moto and Ceph RGW).

Each test replays what a job's history leaves in S3 (attempts that saved the same step, a run
started over on the prefix, a smaller job, retention and late uploads during a restore) and
checks that the restore hands the trainer one save of one run, or nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from harness.checkpoints import SIDECAR, commit, committed_in_s3, data, remote, upload_directly
from harness.procs import wait_for
from harness.s3 import Bucket
from harness.s3proxy import S3Proxy, is_key
from jitckpt_entrypoint.protocol import durable, status, validity
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.layout import Layout
from jitckpt_sidecar import s3
from jitckpt_sidecar.config import Config
from jitckpt_sidecar.remote import PIN_NAME, Remote
from jitckpt_sidecar.restore import Restorer, RestoreResult
from jitckpt_sidecar.retention import Retention
from jitckpt_sidecar.s3 import is_transient
from jitckpt_sidecar.uploader import StaleSaveError, superseded

pytestmark = [pytest.mark.integration, pytest.mark.s3_stores("moto", "rgw")]

OLD, NEW = "20260101T000000000Z-0000aaaa", "20260201T000000000Z-0000bbbb"
"""Two lineages: an earlier run, and a run started over later on the same prefix."""


def shards(step: int, seed: int, nodes: int = 2) -> list[dict[str, Any]]:
    """What each node of a `nodes`-node FSDP-like save holds: its own shard, the shared state.
    `seed` tells two trainings apart (same step, other bytes)."""
    state = f'{{"global_step": {step}, "seed": {seed}}}\n'.encode()
    return [
        {f"__{n}_0.distcp": data(64 * 1024 + n, seed * 100 + n), "trainer_state.json": state}
        for n in range(nodes)
    ]


def save(
    tmp_path: Path,
    name: str,
    step: int,
    seed: int,
    *,
    nodes: int = 2,
    lineage: str = OLD,
) -> list[Path]:
    """Commit one save of checkpoint-<step> on fresh node volumes; returns their roots."""
    roots = [tmp_path / f"{name}-node{n}" for n in range(nodes)]
    commit(roots, step, shards(step, seed, nodes), lineage=lineage)
    return roots


def manifest_of(root: Path, step: int) -> m.Manifest:
    """Node `root`'s own manifest of its local checkpoint-<step>."""
    manifests = m.read_manifests(Layout(str(root)).checkpoint_dir(step))
    return next(man for man in manifests.values() if root.name.endswith(f"node{man.node}"))


def restorer(bucket: Bucket, root: Path, client: Any = None, clock: Any = None) -> Restorer:
    cfg = Config(storage_uri=bucket.uri, s3_endpoint=bucket.server.endpoint)
    client = client or bucket.client
    extra = {} if clock is None else {"clock": clock}
    return Restorer(
        client, Remote(client, cfg.uri), cfg, Layout(str(root)), logging.getLogger("test"), **extra
    )


def restore(bucket: Bucket, root: Path, **kwargs: Any) -> RestoreResult:
    return restorer(bucket, root, **kwargs).run()


def restored_seed(root: Path, step: int) -> list[bytes]:
    """The shards a restore put in checkpoint-<step> (to tell the trainings apart)."""
    ckpt = Layout(str(root)).checkpoint_dir(step)
    assert validity.committed(ckpt) is not None, f"checkpoint-{step} is not committed in {root}"
    return [(Path(ckpt) / f"__{n}_0.distcp").read_bytes() for n in range(2)]


def expected(step: int, seed: int) -> list[bytes]:
    return [files[f"__{n}_0.distcp"] for n, files in enumerate(shards(step, seed))]


def test_shards_of_two_attempts_at_one_step_are_never_restored_together(s3_bucket, tmp_path):
    """Attempt A: node 1 uploads step 40, node 0 is preempted first. Attempt B resumes from 30,
    saves 40 again; only node 0 uploads. Every object of 40 is there with a good checksum, but
    of two trainings: the restore takes 30. Once B's node 1 uploads too, 40 is B's alone."""
    base = save(tmp_path, "base", 30, seed=1)
    for root in base:
        upload_directly(s3_bucket, root, 30)
    attempt_a = save(tmp_path, "a", 40, seed=2)
    upload_directly(s3_bucket, attempt_a[1], 40)
    attempt_b = save(tmp_path, "b", 40, seed=3)
    upload_directly(s3_bucket, attempt_b[0], 40)

    assert validity.s3_problems(remote(s3_bucket).load(40)) == [
        "manifest of node 1 is of another save of the step (an earlier attempt)"
    ]
    result = restore(s3_bucket, tmp_path / "fresh")
    assert (result.source, result.step) == ("s3", 30)
    assert restored_seed(tmp_path / "fresh", 30) == expected(30, 1)

    upload_directly(s3_bucket, attempt_b[1], 40)  # withdraws A's manifest of node 1 first
    s3_bucket.delete(PIN_NAME)  # a later round (the pin binds only the round that wrote it)
    result = restore(s3_bucket, tmp_path / "later")
    assert (result.source, result.step) == ("s3", 40)
    assert restored_seed(tmp_path / "later", 40) == expected(40, 3)


def test_a_run_started_over_on_the_prefix_is_restored_and_never_superseded(s3_bucket, tmp_path):
    """An earlier run left checkpoint-60 and -70; a run started over (JITCKPT_RESUME=0: a new
    lineage) saves checkpoint-30. Its upload is not skipped as superseded, retention does not
    count or delete the other run's, and the restore takes the new run's 30."""
    old = {}
    for step in (60, 70):
        old[step] = save(tmp_path, f"old{step}", step, seed=step)
        for root in old[step]:
            upload_directly(s3_bucket, root, step)
    new = save(tmp_path, "new", 30, seed=5, lineage=NEW)
    in_s3 = remote(s3_bucket)
    assert superseded(in_s3, manifest_of(new[0], 30), 1) is None
    # Within one run, retention's rule holds: 70 was saved after 60.
    assert superseded(in_s3, manifest_of(old[60][0], 60), 1) == [70]
    for root in new:
        upload_directly(s3_bucket, root, 30)
    assert Retention(in_s3, 1, logging.getLogger("test")).apply(NEW) == []
    assert remote(s3_bucket).committed_steps() == [30, 60, 70]

    result = restore(s3_bucket, tmp_path / "fresh")
    assert (result.source, result.step) == ("s3", 30)
    assert restored_seed(tmp_path / "fresh", 30) == expected(30, 5)


def test_stale_manifests_of_nodes_a_smaller_job_no_longer_has_do_not_block_a_step(
    s3_bucket, tmp_path
):
    """A 4-node job uploaded step 40; the job came back with 2 nodes and saved 40 again. The
    manifests of nodes 2 and 3 are still there (written back by a sidecar of a version that
    does not withdraw them): the 2-node save is committed and restored, and S3 holds each
    node's part of it (so its local copies may be pruned)."""
    four = save(tmp_path, "four", 40, seed=4, nodes=4)
    for root in four:
        upload_directly(s3_bucket, root, 40)
    stale = {n: s3_bucket.get("checkpoint-40", m.manifest_name(n)) for n in (2, 3)}
    two = save(tmp_path, "two", 40, seed=2)
    for root in two:
        upload_directly(s3_bucket, root, 40)
    assert sorted(remote(s3_bucket).load(40).manifests) == [0, 1]  # node 0 withdrew them
    for n, body in stale.items():
        s3_bucket.put(body, "checkpoint-40", m.manifest_name(n))
    ckpt = remote(s3_bucket).load(40)
    assert sorted(ckpt.manifests) == [0, 1, 2, 3]
    assert validity.s3_problems(ckpt) == []
    local = m.read_manifests(Layout(str(two[1])).checkpoint_dir(40))[1]
    assert remote(s3_bucket).holds(40, 1, local.save_id)

    result = restore(s3_bucket, tmp_path / "fresh")
    assert (result.source, result.step) == ("s3", 40)
    assert restored_seed(tmp_path / "fresh", 40) == expected(40, 2)
    restored = m.read_manifests(Layout(str(tmp_path / "fresh")).checkpoint_dir(40))
    assert sorted(restored) == [0, 1]


def test_a_checkpoint_deleted_during_the_restore_means_list_again_not_an_older_one(
    s3_bucket, tmp_path
):
    """Another node's retention deletes checkpoint-50 while this node restores it, after the
    newer 60 was committed: the restore lists again and takes 60, never the older 40."""
    for step in (40, 50):
        for root in save(tmp_path, f"s{step}", step, seed=step):
            upload_directly(s3_bucket, root, step)
    newer = save(tmp_path, "s60", 60, seed=60)
    job = restorer(s3_bucket, tmp_path / "fresh")
    real_load = job.remote.load
    moved = []

    def load_then_prune(step: int) -> validity.RemoteCheckpoint:
        ckpt = real_load(step)
        if step == 50 and not moved:
            moved.append(step)
            for root in newer:
                upload_directly(s3_bucket, root, 60)
            s3_bucket.delete("checkpoint-50", "__1_0.distcp")  # pruned under the restore
        return ckpt

    job.remote.load = load_then_prune  # type: ignore[method-assign]
    result = job.run()
    assert moved == [50]
    assert (result.source, result.step) == ("s3", 60)
    assert restored_seed(tmp_path / "fresh", 60) == expected(60, 60)


def test_every_node_of_a_round_restores_the_pinned_step(s3_bucket, tmp_path):
    """Node A restores checkpoint-50 and pins it. A node of the previous round finishes
    uploading checkpoint-60 (saved before the pin) before node B restores: B restores 50 too.
    Once training saves after the pin, the next restore chooses afresh."""
    for root in save(tmp_path, "s50", 50, seed=50):
        upload_directly(s3_bucket, root, 50)
    late = save(tmp_path, "s60", 60, seed=60)  # saved now, uploaded after node A's restore
    pinned_at = m.read_manifests(Layout(str(late[0])).checkpoint_dir(60))[0].created_at + 0.01
    assert restore(s3_bucket, tmp_path / "a", clock=lambda: pinned_at).step == 50
    for root in late:
        upload_directly(s3_bucket, root, 60)
    assert restore(s3_bucket, tmp_path / "b", clock=lambda: pinned_at + 0.01).step == 50

    resumed = save(tmp_path, "s70", 70, seed=70)  # training resumed from 50, saved after it
    for root in resumed:
        upload_directly(s3_bucket, root, 70)
    assert restore(s3_bucket, tmp_path / "c").step == 70


def test_a_pinned_checkpoint_gone_is_never_fallen_back_below(s3_bucket, tmp_path, monkeypatch):
    """Node A restored checkpoint-50 (pinned); it is gone before node B restores, and only 40
    is left: B does not fall back below what A restored, it fails (and tries again later)."""
    monkeypatch.setattr("jitckpt_sidecar.restore.RESTORE_PATIENCE", 0.5)
    for step in (40, 50):
        for root in save(tmp_path, f"s{step}", step, seed=step):
            upload_directly(s3_bucket, root, step)
    assert restore(s3_bucket, tmp_path / "a").step == 50
    s3_bucket.delete("checkpoint-50", m.manifest_name(0))
    with pytest.raises(Exception, match="no longer committed in S3 and nothing newer is"):
        restore(s3_bucket, tmp_path / "b")
    assert not (tmp_path / "b" / "checkpoints" / "checkpoint-40").exists()


@pytest.mark.s3_stores("rgw")  # its range reads: on the real store (moto ran it too: 8 s)
def test_a_restore_interrupted_keeps_what_it_verified_and_sends_no_head(
    s3_bucket, proxy: S3Proxy, tmp_path, monkeypatch
):
    """The store fails every GET of one file for a while: the restore waits (patience counts
    from the last progress), keeps the files it already has, and fetches only the rest. The
    downloads send no HeadObject (size and ETag come from the listing), with the sidecar's own
    client (boto3's default checksums on moto; checksums when required on RGW, as its probe
    finds)."""
    for root in save(tmp_path, "s20", 20, seed=20):
        upload_directly(s3_bucket, root, 20)
    for name, value in s3_bucket.env({}, endpoint=proxy.url).items():
        monkeypatch.setenv(name, value)
    cfg = Config(storage_uri=s3_bucket.uri, s3_endpoint=proxy.url, s3_max_attempts=2)
    rgw = s3_bucket.server.ca_bundle is not None
    client = s3.make_client(cfg, s3.new_session(), checksums=s3.WHEN_REQUIRED if rgw else None)
    failing = is_key("checkpoint-20/__1_0.distcp", "GET")
    # The first failure waits until the other file is whole under its own name: that a file
    # already whole is kept is what is asked, whatever the order the threads run in under load.
    held = proxy.hold(failing)
    proxy.fail(failing, status=503, times=6)

    def release_once_whole() -> None:
        try:
            wait_for(lambda: any((tmp_path / "fresh").rglob("__0_0.distcp")), 60, "__0_0 whole")
        finally:
            held.release()

    releaser = threading.Thread(target=release_once_whole, daemon=True)
    releaser.start()
    result = restore(s3_bucket, tmp_path / "fresh", client=client)
    releaser.join(timeout=5)
    assert (result.source, result.step) == ("s3", 20)
    assert restored_seed(tmp_path / "fresh", 20) == expected(20, 20)
    gets = [r for r in proxy.log() if r.method == "GET" and r.key.endswith("__0_0.distcp")]
    assert len(gets) == 1, "a verified file was downloaded again"
    assert not [r for r in proxy.log() if r.method == "HEAD"]


def test_a_range_that_fails_every_time_ends_the_restore_once_no_file_lands(
    s3_bucket, proxy: S3Proxy, tmp_path, monkeypatch
):
    """Every GET of one range of one file fails (503) while the file's other ranges land:
    each attempt moves bytes but lands no file, and the restore gives up after MAX_FRUITLESS
    such attempts (bytes moved kept its patience from running out: it tried forever)."""
    monkeypatch.setattr("jitckpt_sidecar.restore.MAX_FRUITLESS", 2)  # backoffs 1, 2, 4 s at most
    for root in save(tmp_path, "s20", 20, seed=20):
        upload_directly(s3_bucket, root, 20)
    for name, value in s3_bucket.env({}, endpoint=proxy.url).items():
        monkeypatch.setenv(name, value)
    cfg = Config(storage_uri=s3_bucket.uri, s3_endpoint=proxy.url, s3_max_attempts=2)
    object.__setattr__(cfg, "download_chunk", 16384)  # below the setting's 5Mi floor: small files
    rgw = s3_bucket.server.ca_bundle is not None
    client = s3.make_client(cfg, s3.new_session(), checksums=s3.WHEN_REQUIRED if rgw else None)
    # 64 KiB + 1 bytes in ranges of 1, 16384, ... bytes: the second one always fails
    bad = "bytes=1-16384"
    proxy.fail(
        lambda _method, key, q: key.endswith("__1_0.distcp") and q.get("Range") == bad, times=None
    )
    r = Restorer(
        client,
        Remote(client, cfg.uri),
        cfg,
        Layout(str(tmp_path / "fresh")),
        logging.getLogger("t"),
    )
    started = time.monotonic()
    with pytest.raises(ClientError) as failed:  # the store's 503, not the test's cancel
        r.run(cancel=lambda: "still restoring" if time.monotonic() - started > 60 else None)
    assert is_transient(failed.value), failed.value
    landed = [q for q in proxy.log() if q.key.endswith("__1_0.distcp") and q.status == 206]
    assert len(landed) >= 6, landed  # the file's other ranges moved, attempt after attempt
    assert time.monotonic() - started < 45


def test_a_restored_checkpoint_counts_only_on_its_boot_until_it_is_synced(
    s3_bucket, tmp_path, monkeypatch
):
    """A restore commits without waiting for writeback (a cache of S3), its boot's id marked
    before the manifests: committed on this boot, uncommitted on any other (a node that crashed
    and came back, another node of a shared volume) until `settle` synced it."""
    for root in save(tmp_path, "s20", 20, seed=20):
        upload_directly(s3_bucket, root, 20)
    order: list[str] = []
    from jitckpt_sidecar import restore as restore_module

    real_mark, real_write = restore_module.durable.mark_unsynced, restore_module.m.write_manifest

    def mark_unsynced(path: str) -> None:
        order.append("mark")
        real_mark(path)

    def write_manifest(path: str, manifest: m.Manifest, *, durable: bool = True) -> str:
        order.append("manifest" if durable else "manifest, not synced")
        return real_write(path, manifest, durable=durable)

    monkeypatch.setattr(restore_module.durable, "mark_unsynced", mark_unsynced)
    monkeypatch.setattr(restore_module.m, "write_manifest", write_manifest)
    assert restore(s3_bucket, tmp_path / "fresh").step == 20
    assert order == ["mark", "manifest, not synced", "manifest, not synced"]
    ckpt = Layout(str(tmp_path / "fresh")).checkpoint_dir(20)
    assert validity.committed(ckpt) is not None
    monkeypatch.setattr(durable, "boot_id", lambda: "another-boot")
    assert validity.committed(ckpt) is None
    assert not durable.settle(ckpt)  # another boot's cache is never vouched for
    monkeypatch.undo()
    assert durable.settle(ckpt)
    assert not (Path(ckpt) / durable.UNSYNCED).exists()
    monkeypatch.setattr(durable, "boot_id", lambda: "another-boot")
    assert validity.committed(ckpt) is not None


def test_check_warns_when_the_bucket_keeps_what_retention_deletes(spawn, base_env, s3_bucket):
    """A versioned bucket keeps deleted checkpoints as noncurrent versions: `check` (and the
    sidecar at start) says that retention then frees no bytes, and what to do."""
    client, name = s3_bucket.client, s3_bucket.name
    client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    try:
        proc = spawn([*SIDECAR, "check"], env=s3_bucket.env(base_env))
        assert proc.wait(60) == 0, proc.output()
        assert f"warning: bucket '{name}' has versioning Enabled" in proc.output()
        assert "lifecycle rule" in proc.output()
    finally:  # the probe left versions behind: the bucket's teardown needs it empty
        versions = client.list_object_versions(Bucket=name)
        doomed = [
            {"Key": v["Key"], "VersionId": v["VersionId"]}
            for kind in ("Versions", "DeleteMarkers")
            for v in versions.get(kind, [])
        ]
        if doomed:
            client.delete_objects(Bucket=name, Delete={"Objects": doomed, "Quiet": True})


def test_a_late_upload_of_an_earlier_attempt_never_replaces_a_newer_save(s3_bucket, tmp_path):
    """Attempt A's node 1 sidecar, still running, uploads its save of step 40 after attempt B
    saved and uploaded 40: it is skipped (B's save stays committed), not withdrawn."""
    attempt_a = save(tmp_path, "a", 40, seed=1)
    attempt_b = save(tmp_path, "b", 40, seed=2)
    for root in attempt_b:
        upload_directly(s3_bucket, root, 40)
    with pytest.raises(StaleSaveError, match="newer save"):
        upload_directly(s3_bucket, attempt_a[1], 40)
    assert remote(s3_bucket).load(40).save_id == manifest_of(attempt_b[0], 40).save_id
    assert restore(s3_bucket, tmp_path / "fresh").step == 40
    assert restored_seed(tmp_path / "fresh", 40) == expected(40, 2)


def test_a_bigger_job_saving_a_step_again_uncommits_the_old_save_before_any_file(
    s3_bucket, tmp_path
):
    """A 2-node save of step 40 is committed; the job grows to 4 nodes and saves 40 again.
    Node 2 uploads first, and a file may change owners: the old save stops being committed
    before any of node 2's files goes up, and nothing in S3 passes for it."""
    for root in save(tmp_path, "two", 40, seed=2):
        upload_directly(s3_bucket, root, 40)
    four = save(tmp_path, "four", 40, seed=4, nodes=4)
    upload_directly(s3_bucket, four[2], 40)
    ckpt = remote(s3_bucket).load(40)
    assert m.manifest_name(0) not in ckpt.objects
    assert not ckpt.committed
    for root in (four[0], four[1], four[3]):
        upload_directly(s3_bucket, root, 40)
    assert remote(s3_bucket).load(40).save_id == manifest_of(four[0], 40).save_id


@pytest.mark.parametrize("keep", [0, 1])
def test_an_abandoned_attempts_higher_step_never_wins_over_the_live_runs_saves(
    s3_bucket, tmp_path, keep
):
    """Attempt A (lineage OLD) committed 50 and uploaded node 0's part of 60. The next attempt
    restores 50, and the restore records that S3 holds 60 of OLD above it, so the trainer's
    saves begin lineage NEW (hook/resume.py). It saves 55; A's late upload then completes 60.
    Whatever the steps, the restore takes 55 (JITCKPT_S3_KEEP=0), and with KEEP=1 neither
    lineage's retention deletes the other's: not the half-uploaded 55 (node 1 never uploads
    into nothing), not the live run's 55 once complete."""
    for root in save(tmp_path, "s50", 50, seed=50):
        upload_directly(s3_bucket, root, 50)
    a60 = save(tmp_path, "a60", 60, seed=60)
    upload_directly(s3_bucket, a60[0], 60)
    assert restore(s3_bucket, tmp_path / "next").step == 50
    tip = status.LINEAGE_TIP.read(Layout(str(tmp_path / "next")).status)
    assert tip == status.LineageTip(OLD, 60)
    s3_bucket.delete(PIN_NAME)  # that round is over (its pin would hold retention off 50)

    s55 = save(tmp_path, "s55", 55, seed=55, lineage=NEW)
    in_s3 = remote(s3_bucket)
    upload_directly(s3_bucket, s55[0], 55)
    assert superseded(in_s3, manifest_of(s55[1], 55), 1) is None
    if keep:
        assert Retention(remote(s3_bucket), keep, logging.getLogger("test")).apply(NEW) == []
    upload_directly(s3_bucket, a60[1], 60)  # the late upload: 60 of OLD is complete now
    if keep:
        assert Retention(remote(s3_bucket), keep, logging.getLogger("test")).apply(OLD) == [50]
    assert committed_in_s3(s3_bucket) == ([60] if keep else [50, 60])
    upload_directly(s3_bucket, s55[1], 55)
    if keep:
        assert Retention(remote(s3_bucket), keep, logging.getLogger("test")).apply(NEW) == []
    s3_bucket.delete(PIN_NAME)  # a new round
    result = restore(s3_bucket, tmp_path / "fresh")
    assert (result.source, result.step) == ("s3", 55)
    assert status.LINEAGE_TIP.read(Layout(str(tmp_path / "fresh")).status) is None


def test_retention_keeps_the_highest_steps_of_its_lineage_and_only_its_own_leftovers(
    s3_bucket, tmp_path
):
    """KEEP=1 of OLD: 30 goes, 40 stays; the uncommitted leftover 35 of OLD goes, an
    uncommitted 36 of NEW (its node 0 uploaded, node 1 still uploading) stays, and so does a
    directory of files without a manifest written just now (an upload in progress)."""
    for step in (30, 40):
        for root in save(tmp_path, f"s{step}", step, seed=step):
            upload_directly(s3_bucket, root, step)
    upload_directly(s3_bucket, save(tmp_path, "s35", 35, seed=35)[0], 35)
    upload_directly(s3_bucket, save(tmp_path, "s36", 36, seed=36, lineage=NEW)[0], 36)
    s3_bucket.put(b"x" * 10, "checkpoint-37", "__1_0.distcp")
    retention = Retention(remote(s3_bucket), 1, logging.getLogger("test"))
    assert retention.doomed(OLD) == [30, 35]
    later = Retention(
        remote(s3_bucket), 1, logging.getLogger("test"), clock=lambda: time.time() + 3600
    )
    assert later.doomed(OLD) == [30, 35, 37]


def test_a_local_copy_of_another_save_of_the_chosen_step_is_replaced(s3_bucket, tmp_path):
    """A volume holds attempt A's save of checkpoint-40; S3's (pinned) 40 is attempt B's: the
    restore downloads B's, so every node loads one save."""
    volume = save(tmp_path, "a", 40, seed=1)[0]
    for root in save(tmp_path, "b", 40, seed=2):
        upload_directly(s3_bucket, root, 40)
    # the volume must hold A's checkpoint in full to count as "as new": give it node 1's files
    shard = Layout(str(tmp_path / "a-node1")).checkpoint_dir(40) + "/__1_0.distcp"
    target = Path(Layout(str(volume)).checkpoint_dir(40)) / "__1_0.distcp"
    target.write_bytes(Path(shard).read_bytes())
    assert validity.committed(Layout(str(volume)).checkpoint_dir(40)) is not None
    result = restore(s3_bucket, volume)
    assert (result.source, result.step) == ("s3", 40)
    assert restored_seed(volume, 40) == expected(40, 2)
