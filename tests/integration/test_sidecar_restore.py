"""`jitckpt-sidecar restore` on a real S3 server: newest committed, verified, manifests last."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest

from harness.checkpoints import (
    SIDECAR,
    commit,
    data,
    hf_files,
    http_get,
    log_line,
    metrics_port,
    ready,
    scrape,
    sidecar_env,
    upload_directly,
    write_trainer,
)
from harness.procs import wait_for
from harness.s3proxy import S3Proxy
from jitckpt_entrypoint.protocol import durable, status, validity
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_sidecar.remote import PIN_NAME, Pin

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
    assert validity.newest_committed(checkpoints, node=0) == 10
    assert validity.newest_committed(checkpoints, node=1) == 10
    manifests = validity.committed(os.path.join(checkpoints, "checkpoint-10"))
    assert manifests is not None
    assert sorted(manifests) == [0, 1]
    for node_files in originals[10]:
        for rel, content in node_files.items():
            assert (root / "checkpoints" / "checkpoint-10" / rel).read_bytes() == content, rel
    ready = json.loads((root / "status" / status.SIDECAR_READY.name).read_text())
    assert (ready["restore"], ready["step"]) == ("s3", 10)
    sizes = {f.path: f.size for man in manifests.values() for f in man.files}
    assert ready["restore_bytes"] == sum(sizes.values())
    assert ready["restore_bytes_per_second"] > 0  # the entrypoint's grace estimate reads it
    log_line(proc, r"skipping checkpoint-50 in S3: not committed \(no manifest of node 0\)")
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
    ready = json.loads((root / "status" / status.SIDECAR_READY.name).read_text())
    assert (ready["restore"], ready["step"]) == ("none", None)
    assert "restore_bytes_per_second" not in ready


def test_restore_keeps_a_local_checkpoint_that_is_as_new_as_s3(
    spawn, base_env, s3_bucket, tmp_path
):
    """When the volume already holds a committed checkpoint at least as new (a container
    restart in the same pod, a PersistentVolume), nothing is downloaded; an earlier pod's
    trainer record goes (its exit is not this pod's trainer's)."""
    root = tmp_path / "node"
    commit([root], 5, [hf_files(5)])
    upload_directly(s3_bucket, root, 5)
    commit([root], 7, [hf_files(7)], staged=False)
    write_trainer(root, exited=True, exit_code=0, locked=True)
    proc = spawn([*SIDECAR, "restore"], env=s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)}))
    assert proc.wait(60) == 0, proc.output()
    log_line(proc, r"local checkpoint-7 is committed and at least as new as S3's")
    log_line(proc, r"an earlier pod's trainer record \(run run\) is not this pod's: removed")
    assert not (root / "status" / status.TRAINER.name).exists()
    assert sorted(os.listdir(root / "checkpoints")) == ["checkpoint-5", "checkpoint-7"]
    assert not any("restoring" in line for line in proc.stderr)


def test_a_restore_that_keeps_the_volumes_newer_checkpoint_pins_nothing(
    spawn, base_env, s3_bucket, tmp_path
):
    """A sidecar restarted beside a running trainer (S3 holds checkpoint-40; the volume holds 40
    and a newer 50, its upload pending) downloads nothing and writes no pin: once 50 is committed
    in S3, the next pod's restore takes 50, not the pinned 40 for the pin's half hour."""
    root = tmp_path / "node"
    commit([root], 40, [hf_files(40)])
    upload_directly(s3_bucket, root, 40)
    commit([root], 50, [hf_files(50)])  # staged: the restarted sidecar's uploader will send it
    proc = spawn([*SIDECAR, "restore"], env=s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)}))
    assert proc.wait(60) == 0, proc.output()
    log_line(proc, r"local checkpoint-50 is committed and at least as new as S3's")
    in_s3 = s3_bucket.keys()
    assert PIN_NAME not in in_s3

    upload_directly(s3_bucket, root, 50)
    fresh = tmp_path / "next-pod"
    proc = spawn([*SIDECAR, "restore"], env=s3_bucket.env({**base_env, "JITCKPT_DIR": str(fresh)}))
    assert proc.wait(60) == 0, proc.output()
    assert sorted(os.listdir(fresh / "checkpoints")) == ["checkpoint-50"]
    pin = Pin.from_bytes(s3_bucket.get(PIN_NAME))  # the restore that downloads pins its round
    assert pin is not None
    assert pin.step == 50


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
    assert validity.committed(str(torn)) is not None
    assert (torn / "model.safetensors").read_bytes() == hf_files(3)["model.safetensors"]


def denied_reads(proxy: S3Proxy, times: int | None) -> None:
    """GETs of checkpoint objects answer 403 AccessDenied (a policy without s3:GetObject)."""
    proxy.fail(
        lambda method, key, _query: method == "GET" and "/checkpoint-" in key,
        403,
        times=times,
        code="AccessDenied",
    )


FAILED = ("jitckpt_restores_total", (("result", "failure"),))


def test_a_failed_restore_keeps_the_sidecar_up_not_ready_and_tries_again(
    spawn, base_env, s3_bucket, proxy, tmp_path
):
    """A restore refused by S3 is one error line naming the fix; the sidecar stays up with
    /readyz 503 and the failure on /metrics, tries again after a backoff, and once that
    succeeds it is ready with the restored step as the last step and as the newest in S3."""
    source = tmp_path / "source"
    commit([source], 10, [hf_files(10)])
    upload_directly(s3_bucket, source, 10)
    denied_reads(proxy, times=1)
    root = tmp_path / "node"
    env = sidecar_env(s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)}, endpoint=proxy.url))
    proc = spawn(SIDECAR, env=env)
    port = metrics_port(proc)
    log_line(
        proc,
        r"ERROR restore failed: access denied: GetObject on s3://\S+ \(AccessDenied\); grant the "
        r"credentials s3:GetObject there \(attempt 1\); not ready, so the trainer waits; trying "
        r"again in \d+ s",
    )
    assert http_get(port, "/readyz") == (503, "restoring\n")
    failed = scrape(port)
    assert failed[FAILED] == 1
    assert failed[("jitckpt_sidecar_ready", ())] == 0
    assert ("jitckpt_checkpoint_last_step", ()) not in failed  # nothing on the volume yet
    assert ("jitckpt_restore_seconds", ()) in failed
    log_line(proc, r"ready \(restore: s3 checkpoint-10\)", timeout=30)
    restored = scrape(port)
    assert restored[FAILED] == 1
    assert restored[("jitckpt_restores_total", (("result", "success"),))] == 1
    assert restored[("jitckpt_sidecar_ready", ())] == 1
    assert restored[("jitckpt_checkpoint_last_step", ())] == 10
    assert restored[("jitckpt_last_uploaded_step", ())] == 10
    assert not os.path.exists(env["JITCKPT_TERMINATION_LOG"])
    # Committed without waiting for writeback; synced after it was ready (protocol/durable.py).
    log_line(proc, r"restored checkpoint-10 is on disk now \(synced in [\d.]+ s\)")
    assert not (root / "checkpoints" / "checkpoint-10" / durable.UNSYNCED).exists()


def test_sigterm_after_failed_restores_exits_1_with_the_error_as_termination_message(
    spawn, base_env, s3_bucket, proxy, tmp_path
):
    """A restore that keeps failing keeps counting; SIGTERM (the startupProbe gave up, or the
    pod is deleted) ends the sidecar at once with exit 1 and the error in the termination log;
    the init container's `restore` command exits 1 with the same termination message."""
    source = tmp_path / "source"
    commit([source], 10, [hf_files(10)])
    upload_directly(s3_bucket, source, 10)
    denied_reads(proxy, times=None)
    root = tmp_path / "node"
    env = sidecar_env(s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)}, endpoint=proxy.url))
    proc = spawn(SIDECAR, env=env)
    port = metrics_port(proc)
    wait_for(lambda: scrape(port)[FAILED] >= 2, 30, "a second failed attempt")
    assert http_get(port, "/readyz")[0] == 503
    proc.send(signal.SIGTERM)
    assert proc.wait(10) == 1, proc.output()
    log_line(proc, r"ERROR SIGTERM: exiting 1 without a restore \(restore failed: access denied")
    termination_log = Path(env["JITCKPT_TERMINATION_LOG"])
    message = termination_log.read_text()
    assert message.startswith("jitckpt-sidecar: restore failed: access denied: GetObject on s3://")
    assert message.count("\n") == 1

    termination_log.unlink()
    init = spawn([*SIDECAR, "restore"], env=env)
    assert init.wait(30) == 1, init.output()
    message = termination_log.read_text()
    assert message.startswith("jitckpt-sidecar restore: access denied: GetObject on s3://")
    assert not (root / "status" / status.SIDECAR_READY.name).exists()


def test_a_sharded_checkpoint_is_restored_in_part_and_the_rest_fetched_when_the_trainer_asks(
    spawn, base_env, s3_bucket, tmp_path
):
    """Node 1 of a 2-node sharded save restores its own shards, node 0's file of replicated
    values and the shared files, not node 0's shards. A trainer there that turns out to be
    node 0 (another node rank than the sidecar's) asks for the rest, and gets it."""
    from jitckpt_entrypoint.config import Config
    from jitckpt_entrypoint.hook import resume
    from jitckpt_entrypoint.hook.session import Session
    from jitckpt_entrypoint.hook.topology import Topology

    nodes = [tmp_path / "node0", tmp_path / "node1"]
    files = [
        {
            "trainer_state.json": b'{"global_step": 10}\n',
            "opt/.metadata": 300,
            "opt/__0_0.distcp": 2 * 1024 * 1024,
            "opt/__0_1.distcp": 500,
        },
        {"opt/__1_0.distcp": 2 * 1024 * 1024 + 1},
    ]
    reads = {0: (("opt",), ()), 1: (("opt",), ("opt/__0_1.distcp",))}
    commit(nodes, 10, files, reads=reads)
    for node in nodes:
        upload_directly(s3_bucket, node, 10)

    root = tmp_path / "restored"
    env = sidecar_env(
        s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)}),
        JITCKPT_NODE_RANK="1",
        JITCKPT_NNODES="2",
    )
    proc = spawn(SIDECAR, env=env)
    wait_for(lambda: ready(root), 60, "the sidecar's restore")
    ckpt = root / "checkpoints" / "checkpoint-10"
    line = log_line(proc, r"restoring checkpoint-10 from .*").group(0)
    assert "4 files" in line, line
    assert "node 1's part: its shards and the files every node reads (of 5 files" in line, line
    assert not (ckpt / "opt/__0_0.distcp").exists()
    assert validity.loadable(str(ckpt), 1, 2, 2) is not None
    assert validity.committed(str(ckpt)) is None

    inode = ckpt.stat().st_ino  # completed in place: ranks may be reading it
    topo = Topology(rank=0, world_size=2, local_world_size=1, node=0, nodes=2)
    session = Session(Config.from_env({"JITCKPT_DIR": str(root)}), topo, "run")
    resume.fetch_missing(session)
    answer = status.FETCHED.read(str(root / "status"))
    assert answer is not None, proc.output()
    assert answer.state == "done", proc.output()
    assert answer.bytes == 2 * 1024 * 1024  # node 0's shards: the rest was here

    assert validity.committed(str(ckpt)) is not None
    assert ckpt.stat().st_ino == inode
    assert [p.name for p in ckpt.parent.iterdir()] == ["checkpoint-10"]  # no temp left
    for rel, content in files[0].items():
        expected = content if isinstance(content, bytes) else data(content, 10)
        assert (ckpt / rel).read_bytes() == expected
    log_line(proc, r"the trainer needs more of checkpoint-10 than this node holds")
    proc.send(signal.SIGTERM)
    proc.wait(30)


@pytest.mark.s3_stores("moto")
def test_the_restore_init_container_gets_a_replacement_nodes_snapshot_from_its_peer(
    spawn, base_env, s3_bucket, tmp_path
):
    """The sidecar-as-container mode: `jitckpt-sidecar restore` (the init container, before the
    trainer starts) of node 1's replacement pod asks node 0's sidecar for node 1's snapshot
    (own RAM, the peer's copy, the volume, S3), byte for byte, and leaves the record the
    sidecar after it reads (the recovery's label). Re-run after a failed copy (the peer was
    down), it asks again."""
    from prometheus_client import CollectorRegistry

    from jitckpt_sidecar.peer import RESTORED, PeerReplica
    from jitckpt_sidecar.server import MetricsServer

    log = logging.getLogger("test.peer")

    token = "restore-peer-token"  # noqa: S105 - a test's
    kept = tmp_path / "memory0" / "replica" / "checkpoints" / "checkpoint-6"
    files = {"model.safetensors": data(1 << 20, 6), "rng_state_1.pth": data(100, 7)}
    kept.mkdir(parents=True)
    for name, content in files.items():
        (kept / name).write_bytes(content)
    for node in (0, 1):  # every node's manifest, as the hook's commit leaves them
        entries = tuple(m.FileEntry(n, len(c)) for n, c in files.items() if node == 1) or (
            m.FileEntry("rng_state_0.pth", 100),
        )
        man = m.new_manifest(6, "periodic", node=node, nodes=2, world_size=2, files=entries,
                             save_id="save-6")  # fmt: skip
        m.write_manifest(str(kept), man, durable=False)
    server = MetricsServer(host="127.0.0.1", port=0, registry=CollectorRegistry(), logger=log)
    urls = f"http://127.0.0.1:{server.port},http://127.0.0.1:9"
    node0 = PeerReplica(str(tmp_path / "memory0"), 0, tuple(urls.split(",")), token, log)
    server.peer = node0.app
    server.serve(ready=lambda: True, healthy=lambda: True)
    memory = tmp_path / "memory1"
    memory.mkdir()
    env = {
        **base_env,
        "JITCKPT_DIR": str(tmp_path / "node1"),
        "JITCKPT_MEMORY_DIR": str(memory),
        "JITCKPT_PEERS": urls,
        "JITCKPT_PEER_TOKEN": token,
        "JITCKPT_NODE_RANK": "1",
        "JITCKPT_NNODES": "2",
    }
    try:
        down = {**env, "JITCKPT_PEERS": "http://127.0.0.1:9,http://127.0.0.1:9"}  # refused
        proc = spawn([*SIDECAR, "restore"], env=s3_bucket.env(down))
        assert proc.wait(60) == 0, proc.output()
        log_line(proc, r"peer replica: cannot restore this node's snapshot from node 0")
        assert not (memory / "checkpoints").exists() or not os.listdir(memory / "checkpoints")
        proc = spawn([*SIDECAR, "restore"], env=s3_bucket.env(env))  # the init container again
        assert proc.wait(60) == 0, proc.output()
    finally:
        server.stop()
    log_line(proc, r"peer replica: restored checkpoint-6 \(a snapshot in RAM\) from node 0")
    restored = memory / "checkpoints" / "checkpoint-6"
    assert {p.name: p.read_bytes() for p in restored.iterdir() if p.name in files} == files
    assert validity.whole_here(str(restored), 1) is not None
    record = RESTORED.read(str(memory / "replica"))
    assert record is not None
    assert record.step == 6
    assert token not in proc.output()
