"""Preemption equivalence: a job SIGTERMed three times, each time restarted in a fresh pod (empty
emptyDir, restore from S3), ends with the weights of an uninterrupted run and loses no completed
step. The three: in the first pod, before its first periodic save; in a pod that made a
periodic save since its resume; a few steps after a resume."""

from __future__ import annotations

import json

import pytest

from harness.pod import final_weights, last_step, resumed_from

pytestmark = [pytest.mark.integration, pytest.mark.s3_stores("rgw")]  # moto ran it too: 90 s of CI

TOTAL, SAVE = 30, 10
ARGS = ["--max-steps", str(TOTAL), "--save-steps", str(SAVE)]
PREEMPTIONS = 3


def sigterm_after(preemption: int, begin: int) -> int:
    """The step after which each pod gets its SIGTERM (the stop may come a step or two later)."""
    if preemption == 0:
        return 6
    if preemption == 1:  # past this pod's first periodic save
        return (begin // SAVE + 1) * SAVE + 1
    return begin + 3


def test_three_sigterms_lose_nothing_and_match_an_uninterrupted_run(pods, s3_bucket):
    straight = pods(ARGS, storage_uri=f"s3://{s3_bucket.name}/straight").start()
    assert straight.finish().trainer == 0, straight.output()
    expected = final_weights(straight.jdir, TOTAL)

    step, done, lost = 0, 0, []  # done: the last step the previous pod completed
    for preemption in range(PREEMPTIONS):
        pod = pods(ARGS).start()
        begin = resumed_from(pod)
        lost.append(done - begin)
        assert begin == step, f"preemption {preemption}: resumed at {begin}, expected {step}"
        at = sigterm_after(preemption, begin)
        pod.wait_step(at)
        out = pod.terminate()
        assert (out.trainer, out.sidecar, out.sigkilled) == (143, 0, False), pod.output()
        jit = json.loads((pod.jdir / "status" / "jit.json").read_text())
        assert jit["step"] >= at
        name = f"checkpoint-{jit['step']}"
        assert f"{name}/jitckpt-manifest.node-0.json" in s3_bucket.keys(name), "not in S3"
        step, done = jit["step"], last_step(pod)

    last = pods(ARGS).start()
    lost.append(done - resumed_from(last))
    assert last.finish().trainer == 0, last.output()
    assert lost == [0] * (PREEMPTIONS + 1), f"steps lost per restart: {lost}"
    got = final_weights(last.jdir, TOTAL)
    assert got.keys() == expected.keys()
    worst = max((expected[k] - got[k]).abs().max().item() for k in expected)
    assert worst <= 1e-7, f"max abs diff {worst}"
