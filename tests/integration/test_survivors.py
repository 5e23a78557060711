"""A node lost without notice: the ranks left save the last completed step (hook/survivors.py).

Real torchrun, one CPU rank per node (gloo), the Trainer with attention dropout (so the RNG
states matter), two nodes on one machine with a volume each. Node 1's whole process tree is
SIGKILLed mid-training; node 0 commits the last step it completed as a one-node JIT save and
exits with JITCKPT_EXIT_CODE. The job restarted on both nodes (node 1 given the save, as the
sidecar's restore does) resumes there and ends bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from harness.pod import final_weights
from harness.procs import free_port
from harness.training import (
    TRAIN_HF,
    entrypoint,
    jit_record,
    manifest,
    steps_seen,
    torchrun_node,
    wait_for_step,
)

pytestmark = pytest.mark.integration
JIT_EXIT = 143
STEPS = 24
ARGS = ("--max-steps", str(STEPS), "--save-steps", "1000", "--dropout", "0.1")


def job(spawn, base_env, dirs: list[Path], *args: str, nproc: int = 1):
    """One torchrun per node (static rendezvous on node 0), each with its own JITCKPT_DIR."""
    port = free_port()
    return [
        spawn(
            entrypoint(
                torchrun_node(TRAIN_HF, *args, node=n, nodes=len(dirs), port=port, nproc=nproc)
            ),
            env={**base_env, "JITCKPT_DIR": str(d), "JITCKPT_TERMINATION_LOG": str(d / "tlog")},
        )
        for n, d in enumerate(dirs)
    ]


def node_dirs(root: Path, name: str) -> list[Path]:
    dirs = [root / name / f"node{n}" for n in (0, 1)]
    for d in dirs:
        d.mkdir(parents=True)
    return dirs


_uninterrupted: dict[int, dict[str, torch.Tensor]] = {}
_uninterrupted_flos: dict[int, float] = {}
STATE = "trainer_state.json"


def uninterrupted(spawn, base_env, tmp_path: Path, nproc: int) -> dict[str, torch.Tensor]:
    """The final weights of the same job run through (once per ranks a node)."""
    if nproc not in _uninterrupted:
        dirs = node_dirs(tmp_path, "straight")
        for proc in job(spawn, base_env, dirs, *ARGS, nproc=nproc):
            assert proc.wait(timeout=300) == 0, proc.output()
        _uninterrupted[nproc] = final_weights(dirs[0], STEPS)
        state = dirs[0] / "checkpoints" / f"checkpoint-{STEPS}" / STATE
        _uninterrupted_flos[nproc] = json.loads(state.read_text())["total_flos"]
    return _uninterrupted[nproc]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("nproc", "lost", "sigterm_after"),
    [(1, 1, None), (1, 0, None), (2, 1, 3.0)],
    ids=["node-1-killed", "node-0-killed", "2-rank-nodes-node-1-killed-then-sigterm"],
)
def test_a_lost_node_costs_at_most_one_step(spawn, base_env, tmp_path, nproc, lost, sigterm_after):
    """Node 0 hosts torchrun's store: its loss leaves node 1's agent without one. With 2 ranks a
    node, one rank of the node left saves; the other leaves once it has."""
    straight = uninterrupted(spawn, base_env, tmp_path, nproc)

    dirs = node_dirs(tmp_path, "lost")
    nodes = job(spawn, base_env, dirs, *ARGS, "--step-sleep", "0.2", nproc=nproc)
    left, left_dir, first = nodes[1 - lost], dirs[1 - lost], (1 - lost) * nproc
    wait_for_step(nodes[0], 8)
    nodes[lost].kill_tree()  # the node lost: no SIGTERM, no Python left to unwind
    killed = time.time()
    if sigterm_after is not None:  # what a controller deleting the job's pods sends next
        time.sleep(sigterm_after)
        if left.popen.poll() is None:
            left.send(signal.SIGTERM)
    assert left.wait(timeout=60) == JIT_EXIT, left.output()
    record = jit_record(left_dir)
    assert record is not None, left.output()
    assert record["committed_at"] - killed < 10, record  # the goal: <= 10 s
    step = record["step"]
    assert "peer_lost_at" in record
    man = manifest(left_dir, step, 0)
    world = 2 * nproc
    assert (man["nodes"], man["world_size"], man["kind"]) == (1, world, "jit")
    assert len(man["writers"]) == 1
    writer = man["writers"][0]
    assert writer in range(first, first + nproc), man  # a rank of the node left
    assert step == steps_seen(left, writer)[-1], left.output()  # all but the step in progress
    names = {f["path"] for f in man["files"]}
    rng = {f"rng_state_{r}.pth" for r in range(world)}
    assert {"model.safetensors", "optimizer.pt", *rng} <= names
    saves = [x for x in left.stderr if "the last step it completed" in x]
    assert len(saves) == 1, left.output()
    summary = (left_dir / "tlog").read_text()
    assert f"JIT checkpoint checkpoint-{step} committed" in summary, summary
    if sigterm_after is None:
        assert "by the survivors" in summary, summary
        assert "after a peer was lost" in summary, summary

    # The replacement pod of the node lost gets the save from S3 (here: a copy); both resume.
    shutil.copytree(
        left_dir / "checkpoints" / f"checkpoint-{step}",
        dirs[lost] / "checkpoints" / f"checkpoint-{step}",
    )
    resumed = job(spawn, base_env, dirs, *ARGS, nproc=nproc)
    for proc in resumed:
        assert proc.wait(timeout=300) == 0, proc.output()
    assert int(resumed[0].expect(r"^begin rank=0 pid=\d+ step=(\d+)$").group(1)) == step
    assert same(final_weights(dirs[0], STEPS), straight)
    state = json.loads((dirs[0] / "checkpoints" / f"checkpoint-{STEPS}" / STATE).read_text())
    assert state["total_flos"] == pytest.approx(_uninterrupted_flos[nproc], rel=1e-9)
