"""Disk pressure: an emptyDir sizeLimit far smaller than the checkpoints a run writes. The
sidecar deletes local checkpoints already committed in S3, oldest first; the newest one and any
not yet in S3 survive; the pressure metric and the log say so."""

from __future__ import annotations

import re

import pytest

from harness.checkpoints import committed_in_s3, scrape
from harness.procs import wait_for
from harness.s3proxy import is_key
from harness.training import checkpoint_steps

pytestmark = pytest.mark.integration

# 7.6 MB per checkpoint; 40 MB holds five, and pressure starts at 0.85 of it. Steps take at
# least 0.2 s, so a checkpoint comes every second or more: with async saves nothing else slows
# training, and a 2-core runner's first uploads (1.2 s for checkpoint-5) would fall behind.
ARGS = [
    *("--max-steps", "3000", "--save-steps", "5", "--hidden", "128", "--layers", "4"),
    *("--step-sleep", "0.2"),
]
CAPACITY = 40_000_000


def test_pressure_prunes_uploaded_checkpoints_and_keeps_the_newest_and_the_unuploaded(
    pods, s3_bucket, proxy
):
    stuck = proxy.fail(is_key("checkpoint-10/model.safetensors", "PUT"), 500, times=None)
    pod = pods(
        ARGS,
        s3_env=s3_bucket.env({}, endpoint=proxy.url),
        env={"JITCKPT_STORAGE_CAPACITY": str(CAPACITY), "JITCKPT_S3_MAX_ATTEMPTS": "2"},
    ).start()
    pruned = ("jitckpt_storage_pruned_total", ())
    wait_for(lambda: scrape(pod.metrics_port)[pruned] >= 4, 180, "four checkpoints pruned")
    metrics = scrape(pod.metrics_port)
    local = checkpoint_steps(pod.jdir)
    in_s3 = committed_in_s3(s3_bucket)

    assert 10 in local, "checkpoint-10 is not in S3 yet: it must stay"
    assert 10 not in in_s3
    assert 5 not in local, "the oldest uploaded checkpoint goes first"
    assert metrics[("jitckpt_storage_capacity_bytes", ())] == CAPACITY
    assert metrics[("jitckpt_storage_peak_used_bytes", ())] > 0
    assert metrics[("jitckpt_storage_pressure_ratio", ())] > 0
    assert assert_log(pod, r"disk pressure 0\.\d\d >= 0\.85: deleted local checkpoint-5 \(")
    for line in pod.sidecar.stderr:
        found = re.search(r"deleted local checkpoint-(\d+) \(committed in S3\)", line)
        if found:
            assert int(found.group(1)) != 10, line

    stuck.times = stuck.hits  # S3 recovers: the drain uploads checkpoint-10 as well
    out = pod.terminate()
    assert (out.trainer, out.sidecar, out.sigkilled) == (143, 0, False), pod.output()
    assert 10 in committed_in_s3(s3_bucket)


def assert_log(pod, pattern: str) -> bool:
    return any(re.search(pattern, line) for line in pod.sidecar.stderr)
