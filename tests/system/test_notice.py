"""The cluster's notice before SIGTERM, end to end: a pod (jitckpt-sidecar beside
jitckpt-entrypoint running torchrun, 2 CPU ranks) under a Kubernetes API (tests/harness/kube_api.py:
no real kube-apiserver can be installed here; this one speaks the watch protocol). Karpenter
taints the pod's node: the sidecar asks the trainer for a save now, every rank saves one step,
and the sidecar has it in S3 while training goes on; the SIGTERM that follows adds a JIT save
of the steps since."""

from __future__ import annotations

import time

import pytest

from harness.checkpoints import committed_in_s3
from harness.kube_api import KubeApi
from harness.procs import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.s3_stores("moto")]
JIT_EXIT = 143


def sample(metrics: str, name: str) -> float | None:
    for line in metrics.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_node_taint_has_a_save_in_s3_before_sigterm(pods, s3_bucket, tmp_path):
    api = KubeApi(tmp_path / "kube")
    api.add_node("node-a")
    api.add_pod("training", "trainer-0")
    env = {
        **api.env(),
        "JITCKPT_KUBE_CREDENTIALS": str(api.credentials),
        "JITCKPT_NODE_NAME": "node-a",
        "JITCKPT_POD_NAME": "trainer-0",
        "JITCKPT_POD_NAMESPACE": "training",
    }
    try:
        pod = pods(["--max-steps", "2000", "--save-steps", "1000", "--step-sleep", "0.05"], env=env)
        pod.start()
        pod.wait_step(5)
        assert committed_in_s3(s3_bucket) == []
        noticed = time.time()
        api.taint("node-a", "karpenter.sh/disrupted")
        wait_for(lambda: committed_in_s3(s3_bucket), 60, "the save asked for in S3")
        durable = time.time() - noticed
        (saved,) = committed_in_s3(s3_bucket)
        assert saved >= 5
        assert pod.trainer is not None
        assert pod.trainer.popen.poll() is None  # training goes on
        wait_for(
            lambda: sample(pod.metrics(), "jitckpt_notice_to_durable_seconds") is not None,
            10,
            "the notice-to-S3 time",
        )
        metrics = pod.metrics()
        assert sample(metrics, 'jitckpt_notices_total{source="node"}') == 1
        seconds = sample(metrics, "jitckpt_notice_to_durable_seconds")
        assert seconds is not None
        assert 0 < seconds <= durable + 1
        print(f"notice to save in S3: {seconds:.2f} s (checkpoint-{saved})")

        pod.wait_step(saved + 5)
        done = pod.terminate()
        assert done.trainer == JIT_EXIT, pod.output()
        assert done.sidecar == 0, pod.output()
        steps = committed_in_s3(s3_bucket)
        assert steps[0] == saved
        assert steps[-1] >= saved + 5  # the JIT save: the steps since the notice's save
        assert any(
            "early notice (node node-a: karpenter.sh/disrupted)" in x for x in pod.sidecar.stderr
        )  # type: ignore[union-attr]
    finally:
        api.stop()
