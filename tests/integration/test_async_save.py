"""Async periodic saves (JITCKPT_ASYNC_SAVE=1) in real torchrun workers (2 CPU ranks, gloo).

What the background writer must never change: the files (byte for byte what the Trainer's own
save writes at that step), resume (bit-identical to resuming from a synchronous save), the
commit rule under SIGKILL mid-write, the JIT step under SIGTERM mid-write, and HF's rotation.
`--slow-write S` (train_hf.py) holds each optimizer.pt written by the background writer S
seconds after its bytes are on disk, so a test can act while a write is in flight.
"""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.training import (
    TRAIN_HF,
    TRAIN_LOOP,
    checkpoint_steps,
    entrypoint,
    hook_lines,
    jit_record,
    manifest,
    steps_seen,
    torchrun,
)
from jitckpt_entrypoint.protocol import validity

pytestmark = pytest.mark.integration
JIT_EXIT = 143
SAME_FILES = (
    "model.safetensors",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state_0.pth",
    "rng_state_1.pth",
    "trainer_state.json",
    "config.json",
    "generation_config.json",
)


def hf(*args: str) -> list[str]:
    return entrypoint(torchrun(TRAIN_HF, *args))


def run(spawn, env, *args: str, async_save: str = "1"):
    proc = spawn(hf(*args), env={**env, "JITCKPT_ASYNC_SAVE": async_save})
    assert proc.wait(timeout=600) == 0, proc.output()  # a bound: some run on idle CPU (.ci/run)
    return proc


def ckpt(jdir: Path, step: int) -> Path:
    return jdir / "checkpoints" / f"checkpoint-{step}"


def assert_committed_and_whole(jdir: Path) -> list[int]:
    """Every committed checkpoint: files as listed, and they load (no torn file)."""
    steps = validity.committed_steps(str(jdir / "checkpoints"))
    for step in steps:
        load_file(str(ckpt(jdir, step) / "model.safetensors"))
        torch.load(ckpt(jdir, step) / "optimizer.pt", weights_only=True)
    return steps


@pytest.mark.untimed
def test_async_saves_write_the_trainers_bytes_and_resume_bit_identically(spawn, base_env, tmp_path):
    """checkpoint-10 written in the background equals the Trainer's own save at step 10 file for
    file; resuming from it ends with the weights of the uninterrupted synchronous run."""
    args = ("--max-steps", "20", "--save-steps", "5")
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    sync_dir.mkdir()
    async_dir.mkdir()
    straight = run(spawn, {**base_env, "JITCKPT_DIR": str(sync_dir)}, *args, async_save="0")
    assert not hook_lines(straight, "async:")

    first = run(spawn, {**base_env, "JITCKPT_DIR": str(async_dir)}, *args)
    assert len(hook_lines(first, "async: training blocked")) == 3  # 5, 10, 15; 20 is final
    for step in (5, 10, 15):
        assert manifest(async_dir, step)["kind"] == "periodic"
        for name in SAME_FILES:
            got = (ckpt(async_dir, step) / name).read_bytes()
            assert got == (ckpt(sync_dir, step) / name).read_bytes(), f"{step}/{name}"

    for step in (15, 20):  # resume from the async-written checkpoint-10
        shutil.rmtree(ckpt(async_dir, step))
    rerun = run(spawn, {**base_env, "JITCKPT_DIR": str(async_dir)}, *args)
    assert min(steps_seen(rerun, 0)) == 11
    expected = load_file(str(ckpt(sync_dir, 20) / "model.safetensors"))
    got = load_file(str(ckpt(async_dir, 20) / "model.safetensors"))
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_sigkill_during_a_background_write_never_commits_torn_files(spawn, base_env, jdir):
    """SIGKILL while checkpoint-10's files are written: it is not committed; what is committed
    loads; the rerun resumes from checkpoint-5 and finishes."""
    env = {**base_env, "JITCKPT_ASYNC_SAVE": "1"}
    proc = spawn(hf("--max-steps", "40", "--save-steps", "5", "--slow-write", "1000"), env=env)
    proc.expect(r"^slow write .*checkpoint-5/optimizer.pt rank=0$", timeout=120)
    proc.kill_tree()
    assert not (ckpt(jdir, 5) / "jitckpt-manifest.node-0.json").exists()
    assert (ckpt(jdir, 5) / "optimizer.pt").exists()  # written, not committed
    assert assert_committed_and_whole(jdir) == []

    proc = spawn(hf("--max-steps", "40", "--save-steps", "5", "--slow-write", "3"), env=env)
    proc.expect(r"^slow write .*checkpoint-10/optimizer.pt rank=0$", timeout=120)
    proc.kill_tree()
    assert assert_committed_and_whole(jdir) == [5]
    assert not (ckpt(jdir, 10) / "jitckpt-manifest.node-0.json").exists()

    rerun = run(spawn, base_env, "--max-steps", "12", "--save-steps", "5")
    assert min(steps_seen(rerun, 0)) == 6
    assert assert_committed_and_whole(jdir) == [5, 10, 12]


def test_sigterm_during_a_background_write_commits_the_agreed_step(spawn, base_env, jdir):
    """SIGTERM while checkpoint-5 is written in the background: every rank stops at one step,
    that step is the JIT checkpoint (written by the same writer), and the older in-flight save
    is not committed half-way."""
    env = {**base_env, "JITCKPT_ASYNC_SAVE": "1"}
    proc = spawn(hf("--max-steps", "2000", "--save-steps", "5", "--slow-write", "2"), env=env)
    proc.expect(r"^slow write .*checkpoint-5/optimizer.pt rank=0$", timeout=120)
    proc.send(signal.SIGTERM)
    assert proc.wait(timeout=120) == JIT_EXIT, proc.output()
    record = jit_record(jdir)
    assert record is not None
    step = record["step"]
    assert step == max(steps_seen(proc, 0)) == max(steps_seen(proc, 1)) >= 5
    assert manifest(jdir, step)["kind"] in ("jit", "periodic")
    if step != 5:  # the JIT save went through the same writer (its big files off the thread)
        assert re.search(rf"slow write \S*checkpoint-{step}/optimizer.pt", proc.output())
    committed = assert_committed_and_whole(jdir)
    assert committed[-1] == step
    assert set(committed) <= {5, step}


def test_rotation_never_deletes_a_checkpoint_being_written(spawn, base_env, jdir):
    """save_total_limit=2 with saves every 2 steps, each held in the background: every save
    commits, rotation leaves the two newest, all whole."""
    env = {**base_env, "JITCKPT_ASYNC_SAVE": "1"}
    proc = run(
        spawn,
        env,
        "--max-steps",
        "13",
        "--save-steps",
        "2",
        "--save-total-limit",
        "2",
        "--slow-write",
        "0.5",
    )
    assert not hook_lines(proc, "failed"), proc.output()
    assert not hook_lines(proc, "abandoned"), proc.output()
    assert not hook_lines(proc, "ERROR"), proc.output()  # rotation after each commit too
    lines = hook_lines(proc, "INFO committed checkpoint-")
    committed = [re.search(r"committed (checkpoint-\d+) ", line).group(1) for line in lines]
    assert committed == [f"checkpoint-{s}" for s in (2, 4, 6, 8, 10, 12, 13)]
    assert checkpoint_steps(jdir) == [12, 13]
    assert assert_committed_and_whole(jdir) == [12, 13]


def test_skip_policy_skips_a_save_due_while_the_last_is_written(spawn, base_env, jdir):
    """JITCKPT_ASYNC_BUSY=skip: a save due while the previous one is still written is skipped
    on every rank with a log line; the others commit."""
    env = {**base_env, "JITCKPT_ASYNC_SAVE": "1", "JITCKPT_ASYNC_BUSY": "skip"}
    proc = run(spawn, env, "--max-steps", "9", "--save-steps", "1", "--slow-write", "2")
    skipped = hook_lines(proc, "skipping the save of step")
    assert skipped, proc.output()
    assert_committed_and_whole(jdir)
    assert 9 in validity.committed_steps(str(jdir / "checkpoints"))
    assert len(validity.committed_steps(str(jdir / "checkpoints"))) + len(skipped) == 9


def test_plain_loop_async_saves_commit_after_dcps_write_and_resume(spawn, base_env, jdir):
    """jitckpt.save(state, step, async_=True): DCP's async_save writes, jitckpt commits; a
    SIGTERM stop still commits its JIT step; a rerun resumes from the newest."""
    command = entrypoint(
        torchrun(TRAIN_LOOP, "--steps", "5000", "--save-every", "5", "--async-save")
    )
    proc = spawn(command, env=base_env)
    proc.expect(r"^step 23 rank=0$", timeout=120)
    proc.send(signal.SIGTERM)
    assert proc.wait(timeout=120) == JIT_EXIT, proc.output()
    step = jit_record(jdir)["step"]  # type: ignore[index]
    committed = validity.committed_steps(str(jdir / "checkpoints"))
    assert committed[-1] == step
    assert {5, 10, 15, 20} <= set(committed)
    assert manifest(jdir, 10)["kind"] == "periodic"
    assert ".metadata" in {f["path"] for f in manifest(jdir, 10)["files"]}
    assert not hook_lines(proc, "failed"), proc.output()

    shutil.rmtree(ckpt(jdir, step))  # resume from an async-written one
    rerun = spawn(entrypoint(torchrun(TRAIN_LOOP, "--steps", "40", "--async-save")), env=base_env)
    assert rerun.wait(timeout=300) == 0, rerun.output()
    assert int(rerun.expect(r"^begin rank=0 pid=\d+ step=(\d+)$").group(1)) == committed[-2]
    assert manifest(jdir, 40)["kind"] == "final"
