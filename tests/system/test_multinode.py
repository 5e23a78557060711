"""A two-node job (two pods, torchrun --nnodes 2 on 127.0.0.1) drained one node at a time, and
the job resumed on one node (4 ranks -> 2); a node lost without notice (the survivors' save;
the peer replica's copy of its snapshot in RAM)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.pod import (
    Node,
    Pod,
    finish_resumed_job,
    restored_by_sidecars,
    resumed_from,
    start_job,
)
from harness.procs import free_port, wait_for
from harness.training import TRAIN_HF
from jitckpt_entrypoint.protocol import status, validity

pytestmark = pytest.mark.integration

ARGS = ["--max-steps", "3000", "--save-steps", "1000"]


def job(pods, args: list[str]) -> list[Pod]:
    port = free_port()
    return start_job([pods(args, node=Node(rank, 2, port)) for rank in (0, 1)])


def test_draining_one_node_stops_both_at_one_step_and_the_new_job_resumes_from_s3(pods, s3_bucket):
    node0, node1 = job(pods, ARGS)
    node0.wait_step(6)
    drained = node1.terminate()  # kubectl drain: only node 1's pod is evicted
    assert (drained.trainer, drained.sidecar, drained.sigkilled) == (143, 0, False), node1.output()
    assert node0.trainer is not None
    assert node0.trainer.wait(timeout=120) == 143, node0.output()
    steps = {
        json.loads((p.jdir / "status" / status.JIT.name).read_text())["step"]
        for p in (node0, node1)
    }
    assert len(steps) == 1, f"the nodes stopped at different steps: {steps}"
    step = steps.pop()
    rest = node0.terminate()  # the Job controller replaces the whole group
    assert (rest.sidecar, rest.sigkilled) == (0, False), node0.output()

    name = f"checkpoint-{step}"
    keys = s3_bucket.keys(name)
    assert {f"{name}/jitckpt-manifest.node-0.json", f"{name}/jitckpt-manifest.node-1.json"} <= set(
        keys
    ), sorted(keys)

    total = step + 4
    finish_resumed_job(job(pods, ["--max-steps", str(total), "--save-steps", "1000"]), step)
    # The job comes back on one node (spot capacity came back smaller): DDP at world size 2
    # resumes from the 4-rank final checkpoint, every file of both nodes restored.
    finish_resumed_job(
        [pods(["--max-steps", str(total + 3), "--save-steps", "1000"]).start()], total
    )


def test_a_node_lost_without_notice_the_survivors_save_reaches_s3_and_a_new_job_resumes(
    pods, s3_bucket
):
    """Node 1's pod SIGKILLed (a node lost): node 0 saves the last completed step alone (a
    one-node save of the 4-rank job), its sidecar uploads it, and both nodes' new pods restore
    that save whole from S3 (their trainers' resume from such a save: test_survivors.py)."""
    node0, node1 = job(pods, ARGS)
    node0.wait_step(6)
    node1.kill()
    assert node0.trainer is not None
    assert node0.trainer.wait(timeout=120) == 143, node0.output()
    record = json.loads((node0.jdir / "status" / status.JIT.name).read_text())
    step = record["step"]
    assert "peer_lost_at" in record, record
    rest = node0.terminate()  # the Job controller deletes the pods left
    assert (rest.sidecar, rest.sigkilled) == (0, False), node0.output()

    name = f"checkpoint-{step}"
    keys = set(s3_bucket.keys(name))
    assert f"{name}/jitckpt-manifest.node-0.json" in keys, sorted(keys)
    assert f"{name}/jitckpt-manifest.node-1.json" not in keys, sorted(keys)
    port = free_port()
    new = [pods(ARGS, node=Node(rank, 2, port)) for rank in (0, 1)]
    restored_by_sidecars(new, node0.jdir / "checkpoints" / name, step)


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_a_lost_node_replaced_resumes_from_the_snapshot_its_peer_kept_in_ram(pods, tmp_path):
    """The peer replica (sidecar/peer.py): each node's sidecar keeps the other's newest
    snapshot in RAM. An FSDP full-shard job (each node's snapshot: its own ranks' shards and
    what they read, hook/dcp_reads.py `spread`). Node 0's trainer container dies (restarted in
    place, its memory volume kept) and node 1 is lost whole: no survivor saves (no rank holds
    node 1's shards), nothing is in S3. Node 1's replacement pod (new volumes, the same
    address) gets its snapshot from node 0's sidecar, byte for byte what node 1 held, its
    shards too, and both nodes resume from it in RAM."""
    args = ["--strategy", "fsdp2-sharded", "--max-steps", "40", "--save-steps", "1000"]
    args += ["--step-sleep", "0.1"]
    memory = [tmp_path / f"memory-{n}" for n in (0, 1, 2)]
    for path in memory:
        path.mkdir()
    snap = {"JITCKPT_SNAPSHOT_INTERVAL": "3steps", "JITCKPT_PEER_TOKEN": "job-secret"}
    port = free_port()
    members = [
        pods(args, node=Node(n, 2, port), env={**snap, "JITCKPT_MEMORY_DIR": str(memory[n])})
        for n in (0, 1)
    ]
    peers = ",".join(f"http://127.0.0.1:{p.metrics_port}" for p in members)
    for pod in members:
        pod.env["JITCKPT_PEERS"] = peers
    node0, node1 = start_job(members)
    node0.wait_step(15)
    replicas = memory[0] / "replica" / "checkpoints"
    wait_for(lambda: validity.committed_steps(str(replicas), 1), 60, "node 0 keeps node 1's")
    assert re.search(r"^jitckpt_peer_replica_bytes [1-9]", node0.metrics(), re.MULTILINE)
    assert node0.trainer is not None
    assert node1.trainer is not None
    assert node1.sidecar is not None
    node0.trainer.kill_tree()  # its container dies (the kubelet restarts it in place)
    node1.sidecar.kill_tree()  # node 1 is lost: its pod, memory volume and all
    node1.trainer.kill_tree()
    kept = validity.committed_steps(str(replicas), 1)[-1]
    assert kept % 3 == 0, kept
    assert kept in validity.committed_steps(str(memory[0] / "checkpoints"), 0), node0.output()
    lost = tree(memory[1] / "checkpoints" / f"checkpoint-{kept}")
    assert "pytorch_model_fsdp_0/__2_0.distcp" in lost, sorted(lost)  # rank 2's shards
    assert "pytorch_model_fsdp_0/__0_0.distcp" not in lost, sorted(lost)

    port = free_port()
    replacement = pods(
        args, node=Node(1, 2, port), env={**snap, "JITCKPT_MEMORY_DIR": str(memory[2])}
    )
    replacement.metrics_port = node1.metrics_port  # the same DNS name in a cluster
    replacement.env.update(JITCKPT_METRICS_PORT=str(node1.metrics_port), JITCKPT_PEERS=peers)
    replacement.start_sidecar()
    replacement.wait_ready()
    assert replacement.sidecar is not None
    said = "\n".join(replacement.sidecar.stderr)
    assert f"restored checkpoint-{kept} (a snapshot in RAM) from node 0" in said, said
    assert tree(memory[2] / "checkpoints" / f"checkpoint-{kept}") == lost

    node0.node = Node(0, 2, port)
    node0.command = node0._torchrun(TRAIN_HF, args)
    node0.start_trainer()
    replacement.start_trainer()
    assert resumed_from(node0) == kept, node0.output()
    assert replacement.trainer is not None
    begun = replacement.trainer.expect(r"^begin rank=2 pid=\d+ step=(\d+)$", timeout=120)
    assert int(begun.group(1)) == kept, replacement.output()
    for pod in (node0, replacement):
        assert pod.finish().trainer == 0, pod.output()
    recovered = [x for x in replacement.sidecar.stderr if "recovered:" in x]
    assert "(a snapshot in RAM from the peer replica" in "".join(recovered), recovered
    assert node0.sidecar is not None
    recovered = [x for x in node0.sidecar.stderr if f"(from checkpoint-{kept})" in x]
    assert "(a snapshot in RAM)" in "".join(recovered), node0.output()
