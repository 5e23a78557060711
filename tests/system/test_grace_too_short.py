"""A grace period shorter than a save: the JIT save is SIGKILLed half-way, the checkpoint
committed before it is what the next pod resumes from, and that pod's entrypoint warns at
start-up that the grace period will not be enough (its estimate: the restored checkpoint's
size and save time, the sidecar's measured throughput)."""

from __future__ import annotations

import pytest

from harness.checkpoints import committed_in_s3
from harness.pod import resumed_from
from harness.procs import wait_for

pytestmark = pytest.mark.integration

SLOW = 6.0
GRACE = 4  # torchrun's shutdown timeout becomes 3 s: shorter than one save
ARGS = ["--max-steps", "3000", "--save-steps", "10", "--slow-save", str(SLOW)]


def test_a_grace_period_shorter_than_a_save_falls_back_to_the_last_commit_and_warns(
    pods, s3_bucket
):
    first = pods(ARGS, grace=GRACE).start()
    assert first.trainer is not None
    wait_for(lambda: committed_in_s3(s3_bucket) == [10], 120, "checkpoint-10 in S3")
    first.wait_step(12)
    out = first.terminate()
    assert out.trainer != 143, first.output()  # no JIT checkpoint was committed
    assert not (first.jdir / "status" / "jit.json").exists()
    assert any("slow save rank=0" in line for line in first.trainer.stdout[-5:]), first.output()
    assert committed_in_s3(s3_bucket) == [10]
    warned = [line for line in first.trainer.stderr if "grace period may be too short" in line]
    assert warned == [], "nothing to estimate from at the first start"

    second = pods(ARGS, grace=GRACE).start()
    assert resumed_from(second) == 10
    assert second.trainer is not None
    warned = [line for line in second.trainer.stderr if "grace period may be too short" in line]
    assert len(warned) == 1, second.output()
    assert warned[0].startswith("jitckpt-entrypoint: WARNING ")
    assert "set terminationGracePeriodSeconds and JITCKPT_GRACE_SECONDS to at least" in warned[0]
