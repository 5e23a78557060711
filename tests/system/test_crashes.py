"""Crashes: the whole pod SIGKILLed (a node lost) at random points — mid-step, mid-save (the
Trainer's own), mid-write of an async save (background writer), mid-upload, mid-restore — once
each on Ceph RGW (the real store), the restore last, when S3 holds something to restore. Every
restart resumes from the newest checkpoint committed in S3, never a partial one, and the job
still ends with the weights of an uninterrupted run."""

from __future__ import annotations

import random

import pytest

from harness.checkpoints import committed_in_s3
from harness.pod import final_weights, resumed_from
from harness.procs import wait_for
from harness.s3proxy import is_key

pytestmark = [pytest.mark.integration, pytest.mark.s3_stores("rgw")]  # moto ran it too: 85 s of CI

TOTAL = 60
SAVE = 4
# Big enough (13.5 MB checkpoints, ~0.1 s steps) that a kill lands while training still runs.
ARGS = ["--max-steps", str(TOTAL), "--save-steps", str(SAVE), "--hidden", "128", "--layers", "4"]
SEED = 11
KINDS = ["step", "save", "write", "upload", "restore"]
"""In this order: by the restore, earlier pods have put checkpoints in S3 to restore."""


def put_from(bucket, step: int):
    """Matches the first PUT into any checkpoint at or after `step` (uploads go newest-first)."""
    prefix = bucket.key("checkpoint-")

    def match(method: str, key: str, _query: dict[str, str]) -> bool:
        if method != "PUT" or not key.startswith(prefix):
            return False
        return int(key[len(prefix) :].split("/", maxsplit=1)[0]) >= step

    return match


def test_sigkills_at_random_points_resume_from_the_newest_committed_checkpoint(
    pods, s3_bucket, proxy, tmp_path
):
    straight = pods(ARGS, storage_uri=f"s3://{s3_bucket.name}/straight").start()
    assert straight.finish().trainer == 0, straight.output()

    rng = random.Random(SEED)
    s3_env = s3_bucket.env({}, endpoint=proxy.url)
    release = tmp_path / "never"
    seen = []
    for trial, planned in enumerate(KINDS):
        newest = (committed_in_s3(s3_bucket) or [0])[-1]
        kind = "step" if planned == "restore" and newest == 0 else planned  # nothing to restore
        nxt = (newest // SAVE + 2) * SAVE  # this pod's second periodic save
        args, env = list(ARGS), {}
        if kind == "save":  # the Trainer's own save, held after its files, before the commit
            args += ["--hold-save-at", str(nxt), "--release-file", str(release)]
            env["JITCKPT_ASYNC_SAVE"] = "0"
        elif kind == "write":  # an async save, held in the background writer: the first one
            nxt -= SAVE
            args += ["--slow-write", "1000"]
        pod = pods(args, s3_env=s3_env, env=env)
        hold = None
        if kind == "restore":
            hold = proxy.hold(is_key(f"checkpoint-{newest}/model.safetensors", "GET"))
            pod.start_sidecar()
            wait_for(lambda: hold.held, 60, "the restore's download")  # noqa: B023
        else:
            if kind == "upload":
                # A file, or the manifest (the commit) when an earlier pod sent the same bytes.
                hold = proxy.hold(put_from(s3_bucket, nxt))
            pod.start()
            begin = resumed_from(pod)
            assert begin == newest, f"trial {trial} ({kind}): resumed at {begin}, not {newest}"
            if kind == "step":
                pod.wait_step(begin + rng.randint(1, 2 * SAVE + 1))
            elif kind == "save":
                pod.trainer.expect(rf"^holding save {nxt} rank=0$", timeout=120)
            elif kind == "write":
                pod.trainer.expect(rf"^slow write .*checkpoint-{nxt}/optimizer.pt rank=0$", 120)
            else:
                wait_for(lambda: hold.held, 120, "the upload")  # noqa: B023
        running = pod.trainer is None or pod.trainer.popen.poll() is None
        assert running, f"trial {trial} ({kind}): training ended before the kill"
        pod.kill()
        if hold is not None:
            hold.release(forward=False)
        seen.append((kind, newest, committed_in_s3(s3_bucket)[-1:]))

    last = pods(ARGS, s3_env=s3_env).start()
    assert resumed_from(last) == (committed_in_s3(s3_bucket) or [0])[-1]
    assert last.finish().trainer == 0, last.output()
    expected, got = final_weights(straight.jdir, TOTAL), final_weights(last.jdir, TOTAL)
    worst = max((expected[k] - got[k]).abs().max().item() for k in expected)
    assert worst <= 1e-7, f"max abs diff {worst}; trials {seen}"
    assert {kind for kind, _, _ in seen} == set(KINDS), seen
