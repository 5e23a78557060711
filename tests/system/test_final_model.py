"""TRL's `trl sft`, as a user runs it, in pods with a sidecar: preempted, resumed in a fresh pod,
finished; the model ends up in the user's --output_dir and in S3 under final/."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness import sft
from harness.procs import wait_for
from harness.s3 import Bucket

pytestmark = pytest.mark.integration
TOTAL = 40
SAVE = ["--save_steps", "1000"]


@pytest.fixture(scope="module")
def tiny_sft(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return sft.build(tmp_path_factory.mktemp("sft"))


def test_trl_sft_preempted_after_step_20_resumes_and_its_model_lands_in_final(
    pods, s3_bucket: Bucket, tiny_sft
):
    """`trl sft` with no launcher flags: SIGTERM after step 20 commits a JIT checkpoint (exit
    143) that a fresh pod restores and resumes from; at the end the model, config and
    tokenizer are in --output_dir and, committed, in s3://.../final/; the termination message
    and the sidecar's last line say where."""
    model, data = tiny_sft

    def trl_pod():
        pod = pods([], command=[])
        out = pod.jdir / "output"  # the user's --output_dir, on the shared volume
        pod.command = sft.command(model, data, out, "--max_steps", str(TOTAL), *SAVE)
        return pod, out

    first, _ = trl_pod()
    first.start()
    sft.wait_for_steps(first.trainer, 20)  # type: ignore[arg-type]
    done = sft.steps_logged(first.trainer)  # type: ignore[arg-type]
    gone = first.terminate()
    assert (gone.trainer, gone.sidecar, gone.sigkilled) == (143, 0, False), first.output()
    step = json.loads((first.jdir / "status" / "jit.json").read_text())["step"]
    assert step == sft.steps_logged(first.trainer) >= max(done, 20)  # type: ignore[arg-type]
    in_s3 = s3_bucket.keys()
    assert f"checkpoint-{step}/jitckpt-manifest.node-0.json" in in_s3
    assert not [k for k in in_s3 if k.startswith("final/")]

    second, out = trl_pod()
    second.start()
    assert resumed_from_log(second) == step
    end = second.finish()
    assert (end.trainer, end.sidecar, end.sigkilled) == (0, 0, False), second.output()
    assert sft.steps_logged(second.trainer) == TOTAL - step  # type: ignore[arg-type]

    local = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= local
    final = {k.split("/", 1)[1]: size for k, size in s3_bucket.keys("final/").items()}
    assert set(final) == local | {"jitckpt-manifest.node-0.json"}
    assert s3_bucket.get("final", "model.safetensors") == (out / "model.safetensors").read_bytes()
    man = json.loads(s3_bucket.get("final", "jitckpt-manifest.node-0.json"))
    assert (man["kind"], man["step"]) == ("output", TOTAL)

    where = f"s3://{s3_bucket.name}/{s3_bucket.prefix}/final/"
    tlog = (second.dir / "termination-log").read_text()
    assert tlog == f"training command exited with code 0; model in {out}, uploading to {where}\n"
    assert f"the final model is in {where}" in second.sidecar.stderr[-1]  # type: ignore[union-attr]


def resumed_from_log(pod) -> int:
    """The step the hook resumed from (TRL's script prints no per-step line of its own)."""
    pattern = re.compile(r"resuming from .*/checkpoint-(\d+)$")

    def found():
        return next((pattern.search(x) for x in pod.trainer.stderr if pattern.search(x)), None)

    return int(wait_for(found, 180, "the resume line").group(1))
