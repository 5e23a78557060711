"""Recovery in place, with the emptyDir still there: nothing is downloaded.

- A worker crash under `torchrun --max-restarts 1`: torchrun restarts the workers inside the same
  trainer container, and they resume from the newest checkpoint committed on the volume.
- The trainer container killed and restarted in the same pod (an OOM kill; the kubelet's
  restartPolicy): the new trainer resumes from the volume. Then the sidecar container killed and
  restarted: its restore finds the local checkpoint at least as new as S3's.

No checkpoint file is read from S3 in either case (the proxy sees every request)."""

from __future__ import annotations

import re
from typing import Optional

import pytest

from harness.pod import resumed_from
from harness.procs import wait_for
from harness.training import TORCHRUN, TRAIN_HF
from jitckpt_entrypoint.protocol import validity

pytestmark = [pytest.mark.integration, pytest.mark.s3_stores("moto")]

ARGS = ["--max-steps", "30", "--save-steps", "5", "--step-sleep", "0.05"]


def downloads(proxy) -> list[str]:
    """Checkpoint files read from S3 (manifests are read to compare with S3, not restored)."""
    return [
        r.key
        for r in proxy.log()
        if r.operation == "get" and "/checkpoint-" in r.key and "jitckpt-manifest" not in r.key
    ]


def recovery(pod, source: str = "") -> Optional[tuple[str, float]]:
    """The sidecar's jitckpt_recovery_seconds sample (source, seconds), when it has one (of
    `source`, when given)."""
    for line in pod.metrics().splitlines():
        found = re.match(r'^jitckpt_recovery_seconds\{source="(\w+)"\} (\S+)$', line)
        if found and found.group(1) == (source or found.group(1)):
            return found.group(1), float(found.group(2))
    return None


def newest_committed(jdir) -> int:
    return validity.committed_steps(str(jdir / "checkpoints"))[-1]


def test_a_worker_crash_under_max_restarts_resumes_from_the_volume(
    pods, s3_bucket, proxy, tmp_path
):
    args = [*ARGS, "--crash-at", "13", "--crash-marker", str(tmp_path / "crashed")]
    torchrun = [TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    pod = pods(
        args,
        s3_env=s3_bucket.env({}, endpoint=proxy.url),
        command=[*torchrun, str(TRAIN_HF), *args],
    )
    pod.start()
    assert resumed_from(pod) == 0
    restarted_at = resumed_from(pod)  # torchrun's restart of both workers
    assert (tmp_path / "crashed").exists()
    assert restarted_at in (10, 15), pod.output()  # checkpoint-15 if its save beat the crash
    assert pod.finish().trainer == 0, pod.output()
    assert newest_committed(pod.jdir) == 30
    assert downloads(proxy) == []
    assert pod.trainer is not None
    assert any("restarted workers get their own TCPStore" in x for x in pod.trainer.stderr)


def test_a_trainer_restart_and_a_sidecar_restart_in_the_same_pod_download_nothing(
    pods, s3_bucket, proxy
):
    pod = pods(ARGS, s3_env=s3_bucket.env({}, endpoint=proxy.url))
    pod.start()
    pod.wait_step(12)
    assert wait_for(lambda: recovery(pod), 30, "the recovery metric")[0] == "none"
    assert pod.trainer is not None
    pod.trainer.kill_tree()  # the trainer container OOM-killed; the emptyDir stays
    local = newest_committed(pod.jdir)
    assert local >= 10
    pod.start_trainer()
    assert resumed_from(pod) == local, pod.output()

    pod.wait_step(local + 3)
    _, seconds = wait_for(lambda: recovery(pod, "local"), 30, "the restart's recovery")
    assert 0 < seconds < 120
    assert pod.sidecar is not None
    pod.sidecar.kill_tree()
    sidecar = pod.start_sidecar()
    pod.wait_ready()
    line = wait_for(
        lambda: [x for x in sidecar.stderr if "nothing to download" in x], 30, "the restore's line"
    )
    assert "is committed and at least as new as S3's" in line[0], pod.output()
    assert pod.finish().trainer == 0, pod.output()
    assert newest_committed(pod.jdir) == 30
    assert downloads(proxy) == []
