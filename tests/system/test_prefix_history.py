"""Whole pods on Ceph RGW against a prefix with a history: a run started over on it, and two
attempts of a two-node job that each uploaded half of the same step."""

from __future__ import annotations

import json

import pytest

from harness.pod import Node, Pod, finish_resumed_job, start_job
from harness.procs import free_port, wait_for
from harness.s3proxy import S3Proxy, is_key
from jitckpt_entrypoint.protocol import status

pytestmark = [pytest.mark.integration, pytest.mark.s3_stores("rgw")]


def test_a_run_started_over_on_the_prefix_is_what_the_next_pod_resumes(pods, s3_bucket):
    """Run 1 leaves checkpoint-8 in S3. Run 2 starts over (JITCKPT_RESUME=0: a new lineage)
    and ends at step 4. A new pod resumes run 2's checkpoint-4, not run 1's higher step."""
    first = pods(["--max-steps", "8", "--save-steps", "4"]).start()
    assert first.finish().trainer == 0, first.output()
    again = pods(["--max-steps", "4", "--save-steps", "2"], env={"JITCKPT_RESUME": "0"}).start()
    assert again.finish().trainer == 0, again.output()
    lineages = {
        step: json.loads(s3_bucket.get(f"checkpoint-{step}", "jitckpt-manifest.node-0.json"))[
            "lineage"
        ]
        for step in (4, 8)
    }
    assert lineages[4] > lineages[8], lineages  # run 2 was born later
    resumed = pods(["--max-steps", "6", "--save-steps", "100"]).start()
    finish_resumed_job([resumed], 4)
    assert resumed.sidecar is not None
    assert "not restored" in resumed.sidecar.output()  # names run 1's checkpoints it passed over
    final = json.loads(s3_bucket.get("checkpoint-6", "jitckpt-manifest.node-0.json"))
    assert final["lineage"] == lineages[4]  # a resumed run carries its lineage on


def two_nodes(pods, args: list[str], s3_env: dict[str, str]) -> list[Pod]:
    port = free_port()
    return start_job([pods(args, node=Node(rank, 2, port), s3_env=s3_env) for rank in (0, 1)])


def test_two_attempts_that_each_uploaded_one_node_of_a_step_are_never_mixed(
    pods, s3_bucket, proxy: S3Proxy
):
    """A two-node job ends at step 3. Attempt A resumes and ends at step 6: node 1 uploads it,
    node 0 dies before its manifest is in S3. Attempt B resumes from checkpoint-3 and saves
    step 6 again: node 0 uploads it, node 1 dies before its upload began. S3 then holds every
    file of step 6 with good checksums and both manifests, of two trainings: the next job's
    nodes restore checkpoint-3."""
    env = s3_bucket.env({}, endpoint=proxy.url)
    for pod in two_nodes(pods, ["--max-steps", "3", "--save-steps", "100"], env):
        assert pod.finish().trainer == 0, pod.output()
    args = ["--max-steps", "6", "--save-steps", "100"]
    manifest = "checkpoint-6/jitckpt-manifest.node-{}.json".format
    # A: node 0's manifest upload never arrives. B: node 1 dies at its first request for
    # step 6 (it reads its old manifest, to withdraw it before any file goes up).
    for attempt, lost, method in (("A", 0, "PUT"), ("B", 1, "GET")):
        hold = proxy.hold(is_key(manifest(lost), method))
        job = two_nodes(pods, args, env)
        for pod in job:
            assert pod.trainer is not None
            assert pod.trainer.wait(timeout=300) == 0, pod.output()
        kept = manifest(1 - lost)
        wait_for(lambda k=kept: k in s3_bucket.keys("checkpoint-6"), 120, f"{attempt}: {kept}")
        wait_for(lambda h=hold: h.held > 0, 120, f"{attempt}: node {lost} held")
        job[lost].kill()  # the node is lost with its emptyDir
        hold.release(forward=False)
        job[1 - lost].finish()
    keys = s3_bucket.keys("checkpoint-6")
    assert {manifest(0), manifest(1)} <= set(keys)

    port = free_port()
    restored = [pods([], node=Node(rank, 2, port), s3_env=env) for rank in (0, 1)]
    for pod in restored:
        pod.start_sidecar()
    for pod in restored:
        pod.wait_ready()
        ready = status.SIDECAR_READY.read(str(pod.jdir / "status"))
        assert ready is not None
        assert (ready.restore, ready.step) == ("s3", 3), pod.output()
