"""A two-node job (two pods, torchrun --nnodes 2 on 127.0.0.1) drained one node at a time, and
the job resumed on one node (4 ranks -> 2)."""

from __future__ import annotations

import json

import pytest

from harness.pod import Node, Pod, finish_resumed_job, restored_by_sidecars, start_job
from harness.procs import free_port
from jitckpt_entrypoint.protocol import status

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
