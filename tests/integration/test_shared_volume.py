"""PVC mode: two nodes whose JITCKPT_DIR is one shared directory (a ReadWriteMany volume).

Each node's entrypoint runs torchrun with two CPU ranks; both see every checkpoint file, so both
nodes' manifests land in the same checkpoint directory, a restart resumes from there without any
restore, and retention by world rank 0 alone (the Trainer's save_total_limit) is then correct.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from harness.procs import free_port
from harness.training import (
    TRAIN_HF,
    checkpoint_steps,
    entrypoint,
    jit_record,
    manifest,
    steps_seen,
    torchrun_node,
    wait_for_step,
)
from jitckpt_entrypoint.protocol import validity
from jitckpt_entrypoint.protocol.layout import checkpoint_name

pytestmark = pytest.mark.integration
JIT_EXIT = 143


def two_nodes(spawn, base_env, shared: Path, tmp_path: Path, *args: str):
    port = free_port()
    return [
        spawn(
            entrypoint(torchrun_node(TRAIN_HF, *args, node=n, nodes=2, port=port)),
            env={
                **base_env,
                "JITCKPT_DIR": str(shared),
                "JITCKPT_SAVE_TOTAL_LIMIT": "2",
                "JITCKPT_TERMINATION_LOG": str(tmp_path / f"tlog-{n}"),
            },
        )
        for n in range(2)
    ]


def test_two_nodes_on_one_shared_directory_commit_resume_and_rotate(spawn, base_env, tmp_path):
    """SIGTERM to node 1: both nodes exit 143 with one JIT checkpoint holding both nodes'
    manifests in the shared directory; only the newest save_total_limit checkpoints remain; a
    restart of both resumes from the JIT step (nothing to restore) and finishes."""
    shared = tmp_path / "pvc"
    shared.mkdir()
    args = ("--max-steps", "3000", "--save-steps", "4")
    node0, node1 = two_nodes(spawn, base_env, shared, tmp_path, *args)
    wait_for_step(node0, 14)
    node1.send(signal.SIGTERM)
    for proc in (node1, node0):
        assert proc.wait(timeout=120) == JIT_EXIT, proc.output()
    step = jit_record(shared)["step"]  # type: ignore[index]
    assert max(steps_seen(node0, 0)) == max(steps_seen(node1, 2)) == step
    ckpt = shared / "checkpoints" / checkpoint_name(step)
    assert validity.committed(str(ckpt)) is not None
    kinds = {manifest(shared, step, n)["kind"] for n in (0, 1)}
    # At a periodic step the one save is the JIT one, unless the periodic commit came first.
    assert kinds == {"jit"} or (kinds == {"periodic"} and step % 4 == 0), kinds
    files = {f["path"] for f in manifest(shared, step, 1)["files"]}
    assert {"model.safetensors", "rng_state_0.pth", "rng_state_3.pth"} <= files
    saved = sorted({*range(4, step + 1, 4), step})
    assert len(saved) >= 3
    assert checkpoint_steps(shared) == saved[-2:]  # rotated by world rank 0 only
    for n in (0, 1):
        text = (tmp_path / f"tlog-{n}").read_text()
        assert text.startswith(f"JIT checkpoint {checkpoint_name(step)} committed"), text

    total = step + 6
    again = two_nodes(spawn, base_env, shared, tmp_path, "--max-steps", str(total), *args[2:])
    for proc in again:
        assert proc.wait(timeout=180) == 0, proc.output()
    assert int(again[0].expect(r"^begin rank=0 pid=\d+ step=(\d+)$").group(1)) == step
    assert min(steps_seen(again[0], 0)) == step + 1
    assert manifest(shared, total, 1)["kind"] == "final"
    assert len(checkpoint_steps(shared)) == 2
