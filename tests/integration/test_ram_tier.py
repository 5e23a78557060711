"""The RAM tier (JITCKPT_MEMORY_DIR on a tmpfs) under real torchrun, 2 CPU ranks, the Trainer:
a trainer whose processes are SIGKILLed (the memory volume stays) resumes from its newest
snapshot, bitwise equal to an uninterrupted run; so do workers torchrun restarts after one was
SIGKILLed, and a new pod after a crash that ended the trainer (the RAM writer wrote the newest
snapshot to the volume); a snapshot cut short is never used; a memory directory that cannot
hold snapshots, or a Trainer whose checkpoints hold files a snapshot would lack, is one line,
and the run goes on as without it."""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harness.pod import final_weights
from harness.procs import Proc, clean_env, wait_for
from harness.training import (
    TRAIN_HF,
    TRAIN_LOOP,
    entrypoint,
    hook_lines,
    torchrun,
    wait_for_step,
)
from jitckpt_entrypoint.protocol import validity

pytestmark = pytest.mark.integration

STEPS = 36
ARGS = ["--max-steps", str(STEPS), "--save-steps", "20", "--step-sleep", "0.1"]
"""A volume checkpoint at step 20 and the final one; snapshots every 3 steps between."""


@pytest.fixture
def memory_dir() -> Iterator[Path]:
    """A directory on a tmpfs (/dev/shm) where there is one, as `medium: Memory` gives."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="jitckpt-memory-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The final weights of the same run, uninterrupted and without snapshots (once for the
    module; without --step-sleep, which changes no weight)."""
    jdir = tmp_path_factory.mktemp("straight")
    proc = Proc(entrypoint(torchrun(TRAIN_HF, *ARGS[:4])), env=clean_env(jdir))
    try:
        assert proc.wait(timeout=300) == 0, proc.output()
    finally:
        proc.kill_tree()
    return final_weights(jdir, STEPS)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def resumed_from_ram(proc) -> int:
    lines = hook_lines(proc, "(a snapshot in RAM)")
    assert lines, proc.output()
    found = re.search(r"checkpoint-(\d+) \(a snapshot in RAM\)", lines[0])
    assert found, lines
    return int(found.group(1))


def test_a_killed_trainer_resumes_from_ram_and_a_cut_short_snapshot_is_never_used(
    spawn, base_env, jdir, memory_dir, straight
):
    env = {**base_env, "JITCKPT_MEMORY_DIR": str(memory_dir), "JITCKPT_SNAPSHOT_INTERVAL": "3steps"}
    first = spawn(entrypoint(torchrun(TRAIN_HF, *ARGS)), env=env)
    wait_for_step(first, 29)
    first.kill_tree()  # the trainer container's processes, SIGKILLed; the tmpfs stays
    assert hook_lines(first, "snapshots to RAM every 3 steps"), first.output()
    snapshots = sorted((memory_dir / "checkpoints").glob("checkpoint-*"))
    assert snapshots, first.output()
    newest = max(int(p.name.split("-")[1]) for p in snapshots)
    assert 24 <= newest <= 27, snapshots
    # A snapshot cut short (a kill while it was written): files, no manifest.
    cut = memory_dir / "checkpoints" / "checkpoint-31"
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(b"torn")

    second = spawn(entrypoint(torchrun(TRAIN_HF, *ARGS)), env=env)
    assert second.wait(timeout=300) == 0, second.output()
    assert resumed_from_ram(second) == newest
    assert not cut.exists()
    assert same(final_weights(jdir, STEPS), straight)
    # The snapshot is not a checkpoint of the volume: nothing of it was staged or recorded.
    assert not (jdir / "checkpoints" / f"checkpoint-{newest}").exists()


def test_workers_torchrun_restarts_after_a_sigkill_resume_from_ram(
    spawn, base_env, jdir, memory_dir, straight, tmp_path
):
    env = {**base_env, "JITCKPT_MEMORY_DIR": str(memory_dir), "JITCKPT_SNAPSHOT_INTERVAL": "3steps"}
    marker = tmp_path / "killed"
    newest = memory_dir / "checkpoints" / "checkpoint-24"  # committed before the kill
    args = [*ARGS, "--kill-at", "26", "--crash-marker", str(marker), "--crash-after", str(newest)]
    command = torchrun(TRAIN_HF, *args)
    command.insert(command.index("--nproc-per-node=2") + 1, "--max-restarts=1")
    proc = spawn(entrypoint(command), env=env)
    assert proc.wait(timeout=300) == 0, proc.output()
    assert marker.exists()
    assert resumed_from_ram(proc) == 24
    assert same(final_weights(jdir, STEPS), straight)


def test_a_crashed_trainer_leaves_its_newest_snapshot_on_the_volume_for_a_new_pod(
    spawn, base_env, jdir, memory_dir, straight, tmp_path
):
    """A worker SIGKILLed and no restart left: before the entrypoint exits, the RAM writer
    writes the newest snapshot to the volume, so a replacement pod (its memory volume new and
    empty) resumes from it, not from the older periodic save."""
    env = {**base_env, "JITCKPT_MEMORY_DIR": str(memory_dir), "JITCKPT_SNAPSHOT_INTERVAL": "3steps"}
    marker = tmp_path / "killed"
    first = spawn(
        entrypoint(torchrun(TRAIN_HF, *ARGS, "--kill-at", "26", "--crash-marker", str(marker))),
        env=env,
    )
    assert first.wait(timeout=300) != 0, first.output()
    assert marker.exists()
    ended = [line for line in first.stderr if "training failed without SIGTERM: writing" in line]
    assert len(ended) == 1, first.output()
    step = int(re.search(r"checkpoint-(\d+) from RAM", ended[0]).group(1))
    assert 21 <= step <= 26, ended
    assert any(f"committed checkpoint-{step} from RAM" in line for line in first.stderr)
    assert validity.committed(str(jdir / "checkpoints" / f"checkpoint-{step}")) is not None

    shutil.rmtree(memory_dir)  # the replacement pod's memory volume
    memory_dir.mkdir()
    second = spawn(entrypoint(torchrun(TRAIN_HF, *ARGS, "--crash-marker", str(marker))), env=env)
    assert second.wait(timeout=300) == 0, second.output()
    resumed = hook_lines(second, "resuming from")
    assert resumed, second.output()
    assert resumed[0].endswith(f"checkpoint-{step}"), resumed
    assert same(final_weights(jdir, STEPS), straight)


def test_a_memory_directory_that_cannot_hold_snapshots_is_one_line(spawn, base_env, jdir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    env = {**base_env, "JITCKPT_MEMORY_DIR": str(blocker / "memory")}
    proc = spawn(entrypoint(torchrun(TRAIN_HF, "--max-steps", "12", "--save-steps", "5")), env=env)
    assert proc.wait(timeout=300) == 0, proc.output()
    lines = hook_lines(proc, "no snapshots to RAM")
    assert len(lines) == 1, proc.output()
    assert "JITCKPT_MEMORY_DIR" in lines[0]
    assert (jdir / "checkpoints" / "checkpoint-12").exists()


def test_a_trainer_that_writes_files_of_its_own_into_checkpoints_takes_no_snapshots(
    spawn, base_env, jdir, memory_dir
):
    """TRL GRPO's adaptive entropy: the subclass's `_save_checkpoint` writes a state of its own
    into each checkpoint after the Trainer's save. A snapshot (the Trainer's save alone) would
    lack it, and a resume from one would start that state afresh: one line, no snapshots; the
    periodic saves hold the file."""
    env = {**base_env, "JITCKPT_MEMORY_DIR": str(memory_dir), "JITCKPT_SNAPSHOT_INTERVAL": "1steps"}
    command = [sys.executable, str(TRAIN_HF), "--max-steps", "6", "--save-steps", "5"]
    proc = spawn(entrypoint([*command, "--trainer", "extra-state"]), env=env)
    assert proc.wait(timeout=300) == 0, proc.output()
    lines = hook_lines(proc, "no snapshots to RAM: ExtraStateTrainer._save_checkpoint also")
    assert len(lines) == 1, proc.output()
    assert "extra_state.json" in lines[0], lines
    assert list(memory_dir.glob("checkpoints/checkpoint-*")) == []
    assert (jdir / "checkpoints" / "checkpoint-5" / "extra_state.json").exists()


def test_a_killed_plain_loop_resumes_from_its_snapshot_in_ram(
    spawn, base_env, jdir, memory_dir, tmp_path
):
    """The plain loop's `should_snapshot()` and `snapshot()` (DCP into the memory directory);
    its periodic `save` of step 20 goes to RAM and the RAM writer writes it to the volume, and a
    run that resumes from that checkpoint ends bitwise equal too."""
    args = ["--steps", "40", "--save-every", "20", "--step-sleep", "0.1"]

    def weights(proc) -> set[str]:
        return {line.split()[1] for line in proc.stdout if line.startswith("weights ")}

    straight_dir = tmp_path / "straight"
    straight_dir.mkdir()
    straight = spawn(
        entrypoint(torchrun(TRAIN_LOOP, *args)), env={**base_env, "JITCKPT_DIR": str(straight_dir)}
    )
    assert straight.wait(timeout=300) == 0, straight.output()
    expected = weights(straight)
    assert len(expected) == 1, straight.output()  # every rank holds the same weights

    env = {**base_env, "JITCKPT_MEMORY_DIR": str(memory_dir), "JITCKPT_SNAPSHOT_INTERVAL": "3steps"}
    first = spawn(entrypoint(torchrun(TRAIN_LOOP, *args)), env=env)
    wait_for_step(first, 29)

    def written() -> bool:
        return any(
            line.startswith("jitckpt-ram-writer:") and "committed checkpoint-20 from RAM" in line
            for line in first.stderr
        )

    wait_for(written, 60, "the RAM writer's commit of checkpoint-20")
    first.kill_tree()
    assert not hook_lines(first, "committed checkpoint-20"), first.output()  # not the trainer
    second = spawn(entrypoint(torchrun(TRAIN_LOOP, *args)), env=env)
    assert second.wait(timeout=300) == 0, second.output()
    assert resumed_from_ram(second) in (24, 27)
    assert weights(second) == expected

    # From the checkpoint the writer wrote (no snapshot, no final save): exact too.
    shutil.rmtree(memory_dir / "checkpoints")
    shutil.rmtree(jdir / "checkpoints" / "checkpoint-40")
    third = spawn(entrypoint(torchrun(TRAIN_LOOP, *args)), env=base_env)
    assert third.wait(timeout=300) == 0, third.output()
    begun = [line for line in third.stdout if line.startswith("begin rank=0 ")]
    assert begun, third.output()
    assert begun[0].endswith(" step=20"), third.output()
    assert weights(third) == expected


def test_periodic_saves_are_written_to_the_volume_by_the_ram_writer_not_the_trainer(
    spawn, base_env, jdir, memory_dir, straight, tmp_path
):
    """The entrypoint's RAM writer writes the save of step 20 from RAM to the volume; a run that
    resumes from that checkpoint ends bitwise equal to an uninterrupted one."""
    env = {**base_env, "JITCKPT_MEMORY_DIR": str(memory_dir), "JITCKPT_SNAPSHOT_INTERVAL": "3steps"}
    first = spawn(entrypoint(torchrun(TRAIN_HF, *ARGS)), env=env)
    assert first.wait(timeout=300) == 0, first.output()
    writer = [line for line in first.stderr if line.startswith("jitckpt-ram-writer:")]
    assert any("committed checkpoint-20 from RAM" in line for line in writer), first.output()
    assert hook_lines(first, "the RAM writer (pid"), first.output()
    # The training processes committed only the final save themselves.
    assert not hook_lines(first, "committed checkpoint-20"), first.output()
    assert validity.committed(str(jdir / "checkpoints" / "checkpoint-20")) is not None

    # Resumed from the written-out checkpoint (no final one, no snapshot): exact.
    shutil.rmtree(jdir / "checkpoints" / f"checkpoint-{STEPS}")
    shutil.rmtree(memory_dir / "checkpoints")
    second = spawn(entrypoint(torchrun(TRAIN_HF, *ARGS)), env=env)
    assert second.wait(timeout=300) == 0, second.output()
    assert hook_lines(second, "resuming from"), second.output()
    assert any("checkpoint-20" in line for line in hook_lines(second, "resuming from"))
    assert same(final_weights(jdir, STEPS), straight)


def test_an_fsdp_trainers_workers_restarted_by_torchrun_resume_from_ram(
    spawn, base_env, jdir, memory_dir, tmp_path
):
    """FSDP2 with a sharded state: a snapshot is the Trainer's own save into the memory
    directory with its DCP saves staged and written by the background writer; a worker
    SIGKILLed, torchrun restarts both, and they resume from it bitwise."""
    steps, args = 12, ["--strategy", "fsdp2-sharded", "--max-steps", "12", "--save-steps", "1000"]
    straight_dir = tmp_path / "straight"
    straight_dir.mkdir()
    straight = spawn(entrypoint(torchrun(TRAIN_HF, *args)), env=clean_env(straight_dir))
    assert straight.wait(timeout=300) == 0, straight.output()

    env = {**base_env, "JITCKPT_MEMORY_DIR": str(memory_dir), "JITCKPT_SNAPSHOT_INTERVAL": "3steps"}
    marker = tmp_path / "killed"
    newest = memory_dir / "checkpoints" / "checkpoint-6"  # committed before the kill
    kill = ["--kill-at", "8", "--crash-marker", str(marker), "--crash-after", str(newest)]
    command = torchrun(TRAIN_HF, *args, *kill)
    command.insert(command.index("--nproc-per-node=2") + 1, "--max-restarts=1")
    proc = spawn(entrypoint(command), env=env)
    assert proc.wait(timeout=300) == 0, proc.output()
    assert marker.exists()
    assert hook_lines(proc, "snapshots to RAM every 3 steps"), proc.output()
    assert resumed_from_ram(proc) == 6
    a, b = final_weights(straight_dir, steps), final_weights(jdir, steps)
    assert a, "no weights"
    assert same(a, b)
