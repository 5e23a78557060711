"""The whole trainer container killed (its cgroup's OOM kill takes PID 1 too): nobody in it is
left to write the newest snapshot in RAM out, so the sidecar does (ram_rescue.py), uploads it,
and a replacement pod (new volumes) resumes from it, not from the older periodic save."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from harness.pod import assert_restored_from_s3, resumed_from
from jitckpt_entrypoint.protocol import validity

pytestmark = [pytest.mark.integration, pytest.mark.s3_stores("moto")]

ARGS = ["--max-steps", "40", "--save-steps", "40", "--step-sleep", "0.05"]
"""No periodic save before the last step: whatever lag the output has under load, the kill comes
long before it, and the next pod resumes from the sidecar's write-out or from the start."""


def files(directory: Path) -> dict[str, bytes]:
    """Every file of a checkpoint but its manifests (a restore writes those anew)."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in directory.rglob("*")
        if p.is_file() and not p.name.startswith("jitckpt-manifest.")
    }


def test_the_sidecar_writes_out_the_snapshot_of_a_trainer_container_killed_whole(pods, tmp_path):
    memory = tmp_path / "memory-0"
    memory.mkdir()
    env = {"JITCKPT_MEMORY_DIR": str(memory), "JITCKPT_SNAPSHOT_INTERVAL": "3steps"}
    pod = pods(ARGS, env=env)
    pod.start()
    pod.wait_step(12)
    assert pod.trainer is not None
    assert pod.sidecar is not None
    pod.trainer.kill_tree()  # the container's cgroup, PID 1 included: no exit recorded
    snapshots = validity.committed_steps(str(memory / "checkpoints"))
    assert snapshots, pod.output()
    step = snapshots[-1]
    assert 3 <= step < 40, snapshots  # every 3 steps (a slow writer passes some over)
    in_ram = files(memory / "checkpoints" / f"checkpoint-{step}")

    time.sleep(1)  # not before SIGTERM: the kubelet might restart the container in place
    assert not (pod.jdir / "checkpoints" / f"checkpoint-{step}").exists()
    pod.sidecar.send(signal.SIGTERM)  # the kubelet stops the sidecar once the trainer is gone
    assert pod.sidecar.wait(timeout=60) == 0, pod.output()
    said = "\n".join(pod.sidecar.stderr)
    assert "ended without its entrypoint exiting" in said, said
    assert f"committed checkpoint-{step} from RAM" in said, said
    assert "drained" in said, said
    assert files(pod.jdir / "checkpoints" / f"checkpoint-{step}") == in_ram

    memory.rename(tmp_path / "memory-gone")  # the replacement pod's memory volume is new
    memory.mkdir()
    second = pods(ARGS, env=env)
    second.start()
    assert resumed_from(second) == step, second.output()
    assert second.finish().trainer == 0, second.output()
    assert_restored_from_s3(second, step)
    assert second.sidecar is not None
    assert not [x for x in second.sidecar.stderr if "ended without" in x]  # it exited
