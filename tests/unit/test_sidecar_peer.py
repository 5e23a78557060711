"""The peer replica (sidecar/peer.py): two nodes' sidecars on loopback, real HTTP, snapshots
committed with the real manifests in two memory directories."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from jitckpt_entrypoint.hook import room
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import status
from jitckpt_sidecar.metrics import PeerCollector
from jitckpt_sidecar.peer import PeerError, PeerReplica, newest, peer_urls
from jitckpt_sidecar.server import MetricsServer

TOKEN = "s3cret-token"  # noqa: S105 - a test's token
log = logging.getLogger("test.peer")


def snapshot(memory: Path, step: int, node: int, save_id: str, size: int = 3 << 20) -> Path:
    """Node `node`'s snapshot of a 2-node save in RAM: the shared files, its rank's RNG state
    and every node's manifest (as the hook's commit leaves it there)."""
    path = memory / "checkpoints" / f"checkpoint-{step}"
    (path / "sub").mkdir(parents=True)
    files = {
        "model.safetensors": os.urandom(size),
        "sub/optimizer.pt": os.urandom(1000),
        f"rng_state_{node}.pth": os.urandom(100),
    }
    for rel, data in files.items():
        (path / rel).write_bytes(data)
    for n in range(2):
        entries = tuple(
            m.FileEntry(rel, len(data)) for rel, data in files.items() if n == node
        ) or (m.FileEntry(f"rng_state_{n}.pth", 100),)
        man = m.new_manifest(
            step, "periodic", node=n, nodes=2, world_size=2, files=entries, save_id=save_id
        )
        m.write_manifest(str(path), man, durable=False)
    return path


@pytest.fixture
def ring(tmp_path: Path) -> Iterator[list[PeerReplica]]:
    """Node 0's and node 1's sidecars, each serving /peer/ on its own loopback port."""
    servers = [
        MetricsServer(host="127.0.0.1", port=0, registry=CollectorRegistry(), logger=log)
        for _ in range(2)
    ]
    urls = tuple(f"http://127.0.0.1:{s.port}" for s in servers)
    replicas = []
    for node, server in enumerate(servers):
        (tmp_path / f"memory{node}").mkdir()
        replica = PeerReplica(str(tmp_path / f"memory{node}"), node, urls, TOKEN, log, poll=0.05)
        server.peer = replica.app
        server.serve(ready=lambda: True, healthy=lambda: True)
        replicas.append(replica)
    yield replicas
    for replica, server in zip(replicas, servers):
        replica.stop()
        server.stop()


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_a_replacement_node_restores_its_snapshot_from_the_peer_that_keeps_it(ring, tmp_path):
    node0, node1 = ring
    lost = snapshot(tmp_path / "memory1", 6, 1, "save-6")
    snapshot(tmp_path / "memory0", 6, 0, "save-6")
    assert node0.refresh()  # node 0 keeps node 1's newest (a ring of two)
    assert not node0.refresh()  # the same save: nothing copied again
    kept = tmp_path / "memory0" / "replica" / "checkpoints" / "checkpoint-6"
    assert tree(kept) == tree(lost)
    assert node0.metric()[1] == sum(len(b) for b in tree(lost).values())

    original = tree(lost)
    assert node1.restore_own() is None  # its own RAM first: it asks nobody
    os.rename(tmp_path / "memory1", tmp_path / "memory1-gone")  # a new pod: its RAM is empty
    (tmp_path / "memory1").mkdir()
    assert node1.restore_own() == (6, sum(map(len, original.values())))
    later = PeerReplica(str(tmp_path / "memory1"), 1, node1.peers, TOKEN, log)  # the next one
    assert later.restored_at_start() == (6, sum(map(len, original.values())))
    assert tree(tmp_path / "memory1" / "checkpoints" / "checkpoint-6") == original
    found = newest(str(tmp_path / "memory1" / "checkpoints"), 1, 2)
    assert found is not None
    assert found[1].save_id == "save-6"
    shutil.rmtree(tmp_path / "memory1" / "checkpoints")  # the trainer removed its snapshots
    assert node1.restore_own() is None  # a sidecar restarted on this volume asks nobody


def test_a_snapshot_retired_during_the_copy_is_not_kept(ring, tmp_path, monkeypatch):
    """The source's snapshot is written over (retired: manifests first) while it is copied: the
    copy is dropped, and the older replica stays."""
    node0, _ = ring
    snapshot(tmp_path / "memory1", 3, 1, "save-3")
    assert node0.refresh()
    newer = snapshot(tmp_path / "memory1", 6, 1, "save-6")
    real = node0._fetch
    calls = []

    def fetch(*args):
        real(*args)
        calls.append(args)
        if len(calls) == 5:  # its last file (a manifest) read: now the hook retires it
            for name in os.listdir(newer):
                if m.is_manifest_name(name):
                    os.unlink(newer / name)

    monkeypatch.setattr(node0, "_fetch", fetch)
    with pytest.raises(PeerError, match="changed at node 1 during the copy"):
        node0.refresh()
    assert len(calls) == 5
    replicas = tmp_path / "memory0" / "replica"
    assert sorted(p.name for p in (replicas / "checkpoints").iterdir()) == ["checkpoint-3"]
    assert not (replicas / ".incoming").exists()
    assert node0.held is not None
    assert node0.held.step == 3


def refused(url: str, headers: dict[str, str]) -> int:
    """The HTTP status of a request that must fail."""
    request = urllib.request.Request(url, headers=headers)  # noqa: S310 - http on loopback
    with pytest.raises(urllib.error.HTTPError) as failed:
        urllib.request.urlopen(request, timeout=5)  # noqa: S310
    return failed.value.code


def test_requests_without_the_token_or_outside_the_snapshot_are_refused(ring, tmp_path):
    node0, _ = ring
    snapshot(tmp_path / "memory1", 3, 1, "save-3")
    url = node0.peers[1] + "/peer/v1/snapshot/1"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert refused(url, headers) == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for path in ("file/1/3/..%2F..%2F..%2Fsecret", "file/1/3/%2Fetc%2Fpasswd", "snapshot/7"):
        assert refused(node0.peers[1] + "/peer/v1/" + path, auth) == 404, path


def test_an_unreachable_peer_costs_one_line_and_no_restore(tmp_path, caplog):
    (tmp_path / "memory1").mkdir()
    urls = ("http://127.0.0.1:9", "http://127.0.0.1:9")  # the discard port: refused
    replica = PeerReplica(str(tmp_path / "memory1"), 1, urls, TOKEN, log)
    with caplog.at_level(logging.INFO, logger=log.name):
        assert replica.restore_own() is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert "cannot restore this node's snapshot from node 0" in said[0], said
    assert TOKEN not in said[0]


def test_the_keeper_thread_follows_the_newest_snapshot_and_the_metrics_say_so(ring, tmp_path):
    node0, _ = ring
    collector = PeerCollector(node0.metric)
    age = {s.name: s.value for f in collector.collect() for s in f.samples}
    assert age["jitckpt_peer_replica_age_seconds"] == float("inf")
    node0.start()
    for step in (3, 6):
        snapshot(tmp_path / "memory1", step, 1, f"save-{step}", size=1 << 20)
        done = threading.Event()
        for _ in range(200):
            if node0.held is not None and node0.held.step == step:
                done.set()
                break
            done.wait(0.05)
        assert done.is_set(), step
    kept = sorted(p.name for p in (tmp_path / "memory0" / "replica" / "checkpoints").iterdir())
    assert kept == ["checkpoint-6"]
    samples = {s.name: s.value for f in collector.collect() for s in f.samples}
    assert 0 <= samples["jitckpt_peer_replica_age_seconds"] < 60
    assert samples["jitckpt_peer_replica_bytes"] == node0.held.bytes > 1 << 20


def test_peer_urls_from_a_template_or_a_list():
    assert peer_urls("http://job-{node}.svc:9402", 3) == tuple(
        f"http://job-{n}.svc:9402" for n in range(3)
    )
    assert peer_urls("http://a:1, http://b:2", 2) == ("http://a:1", "http://b:2")


def test_the_trainer_is_told_what_the_holder_keeps_and_not_to_wait_on_one_that_cannot(
    ring, tmp_path, monkeypatch
):
    """peer.json: the snapshot of this node its holder keeps (live); not live when the holder
    cannot keep it (no room), is unreachable, or serves no peer replica."""
    node0, node1 = ring
    snapshot(tmp_path / "memory1", 3, 1, "save-3")
    node1.report()
    kept = status.PEER_KEPT.read(str(tmp_path / "memory1"))
    assert kept is not None
    assert (kept.live, kept.step) == (True, None)  # not copied yet: the trainer waits
    assert node0.refresh()
    node1.report()
    kept = status.PEER_KEPT.read(str(tmp_path / "memory1"))
    assert kept is not None
    assert (kept.live, kept.step, kept.save_id) == (True, 3, "save-3")

    snapshot(tmp_path / "memory1", 6, 1, "save-6")
    monkeypatch.setattr(room, "free_bytes", lambda _: 1000)  # node 0's memory volume is full
    with pytest.raises(PeerError, match="size it for four snapshots"):
        node0.refresh()
    node0.failing = "no room"  # as keep() records it
    node1.report()
    kept = status.PEER_KEPT.read(str(tmp_path / "memory1"))
    assert kept is not None
    assert not kept.live  # node 1's trainer does not wait for a copy that cannot come

    no_peer = PeerReplica(str(tmp_path / "memory1"), 1, ("http://127.0.0.1:9",) * 2, TOKEN, log)
    no_peer.report()
    assert not status.PEER_KEPT.read(str(tmp_path / "memory1")).live  # type: ignore[union-attr]


def test_a_holder_without_the_peer_replica_is_an_error_not_an_empty_answer(tmp_path):
    server = MetricsServer(host="127.0.0.1", port=0, registry=CollectorRegistry(), logger=log)
    server.serve(ready=lambda: True, healthy=lambda: True)  # no /peer/ app: 404
    try:
        (tmp_path / "m").mkdir()
        urls = (f"http://127.0.0.1:{server.port}",) * 2
        replica = PeerReplica(str(tmp_path / "m"), 1, urls, TOKEN, log)
        with pytest.raises(PeerError, match="no peer replica there"):
            replica.refresh()
    finally:
        server.stop()


def test_a_source_with_no_snapshot_leaves_the_copy_and_sigterm_stops_a_copy(ring, tmp_path):
    """Node 1 comes back as a new pod (nothing in RAM) whose sidecar serves before it asks:
    node 0 keeps the copy the new pod is about to ask for."""
    node0, node1 = ring
    lost = snapshot(tmp_path / "memory1", 3, 1, "save-3")
    assert node0.refresh()
    shutil.rmtree(lost)
    assert not node0.refresh()
    assert node0.held is not None
    assert node1.restore_own() == (3, node0.held.bytes)

    snapshot(tmp_path / "memory1", 6, 1, "save-6")
    node0.cancel()
    with pytest.raises(PeerError, match="stopped"):
        node0.refresh()
    assert not (tmp_path / "memory0" / "replica" / ".incoming").exists()


def test_a_copy_leaves_room_for_the_trainers_next_snapshot_and_a_cut_short_one_goes(
    ring, tmp_path, monkeypatch
):
    node0, _ = ring
    own = snapshot(tmp_path / "memory0", 3, 0, "save-3")  # node 0's trainer has one snapshot
    need = sum(p.stat().st_size for p in own.rglob("*") if p.is_file())
    snapshot(tmp_path / "memory1", 3, 1, "save-3")
    leftover = tmp_path / "memory0" / "replica" / ".incoming" / "checkpoint-9"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"x" * 1000)  # a copy a kill cut short
    monkeypatch.setattr(room, "free_bytes", lambda _: need + 100)  # one snapshot's room
    with pytest.raises(PeerError, match="beside room for this node's next"):
        node0.refresh()
    assert not leftover.parent.exists()
    monkeypatch.setattr(room, "free_bytes", lambda _: 3 * need)
    assert node0.refresh()
