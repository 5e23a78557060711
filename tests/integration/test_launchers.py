"""SIGTERM reaches every training process whatever launches it: the launcher matrix.

Each launcher runs the same tiny Trainer script under jitckpt-entrypoint and gets SIGTERM
mid-training. Whether the launcher forwards SIGTERM (torchrun, accelerate --multi_gpu), dies of
it (accelerate's simple launcher, `sh -c` without exec, `python -m accelerate.commands.launch`)
or ignores it, the training processes save a JIT checkpoint at the step they were at (no step
lost), the entrypoint waits for them and exits JITCKPT_EXIT_CODE, and says in its SIGTERM line
what the shutdown path is.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from harness import sft
from harness.launchers import BIN, BY_LABEL, MATRIX, PY, TRAIN
from harness.procs import (
    ENTRYPOINT,
    UNSHARE_PID,
    Proc,
    children_of,
    descendants,
    state_of,
    wait_for,
)
from harness.training import (
    CHILDREN,
    checkpoint_steps,
    entrypoint,
    hook_lines,
    jit_record,
    manifest,
    steps_seen,
    wait_for_step,
)

pytestmark = pytest.mark.integration
JIT_EXIT = 143
SIGTERM_AT = 10
COMMIT_WITHIN = 20.0
"""Seconds from SIGTERM to the committed JIT checkpoint (a few steps, one save; CI is slow)."""


def sigterm_and_wait(proc: Proc, target: int, jdir: Path) -> tuple[int, float, float]:
    """SIGTERM `target` once rank 0 finished step SIGTERM_AT: (exit code, SIGTERM to commit,
    SIGTERM to exit) in seconds."""
    wait_for_step(proc, SIGTERM_AT)
    sent_wall, sent = time.time(), time.monotonic()
    os.kill(target, signal.SIGTERM)
    code = proc.wait(timeout=120)
    exited = time.monotonic() - sent
    record = jit_record(jdir)
    assert record is not None, proc.output()
    return code, record["committed_at"] - sent_wall, exited


def assert_one_jit_checkpoint_at_the_last_step(proc: Proc, jdir: Path, ranks: int) -> int:
    """One JIT checkpoint, committed once, at the last step every rank finished: 0 steps lost."""
    step = jit_record(jdir)["step"]  # type: ignore[index]
    for rank in range(ranks):
        assert max(steps_seen(proc, rank)) == step, proc.output()
    assert len(hook_lines(proc, f"committed checkpoint-{step} (jit")) == 1, proc.output()
    assert manifest(jdir, step)["world_size"] == ranks
    return step


def sigterm_line(proc: Proc) -> str:
    lines = [line for line in proc.stderr if "jitckpt-entrypoint" in line and "SIGTERM:" in line]
    assert len(lines) == 1, proc.output()
    return lines[0]


@pytest.mark.parametrize("label", [x.label for x in MATRIX if x.label != "python train.py"])
def test_every_launcher_gets_its_jit_checkpoint(spawn, base_env, jdir, label):
    """SIGTERM to the entrypoint mid-training: the training processes commit the step they
    were at, whatever the launcher does with the signal; exit 143; the SIGTERM line names the
    real shutdown path (torchrun's worker timeout only where torchrun runs)."""
    launcher = BY_LABEL[label]
    proc = spawn(entrypoint(launcher.command), env=base_env)
    code, commit_s, _ = sigterm_and_wait(proc, proc.pid, jdir)
    assert code == JIT_EXIT, proc.output()
    assert commit_s < COMMIT_WITHIN
    assert_one_jit_checkpoint_at_the_last_step(proc, jdir, launcher.ranks)
    assert (jdir / "termination-log").read_text().startswith("JIT checkpoint checkpoint-")

    line = sigterm_line(proc)
    assert "Kubernetes SIGKILLs the pod 30 s after SIGTERM" in line
    torchrun_said = re.search(r"torchrun \(pid \d+\) SIGKILLs its workers 22 s after", line)
    assert bool(torchrun_said) == launcher.elastic
    if not launcher.elastic:  # the launcher passes nothing on: the entrypoint sent it
        assert re.search(r"sent to its training processes \d+;", line), line
    assert "exiting 143" in proc.stderr[-1]


def test_pid1_waits_for_a_trainer_still_saving_after_its_launcher_died(spawn, base_env, jdir):
    """accelerate's simple launcher dies of SIGTERM at once; its trainer's save takes 3 s more:
    the entrypoint waits for it (not for the launcher) and exits 143 once it committed."""
    command = [str(BIN / "accelerate"), "launch", "--cpu", *TRAIN, "--slow-save", "3"]
    proc = spawn(entrypoint(command), env=base_env)
    code, commit_s, exited = sigterm_and_wait(proc, proc.pid, jdir)
    assert code == JIT_EXIT, proc.output()
    assert 3 <= commit_s <= exited
    waiting = [line for line in proc.stderr if "waiting for training processes" in line]
    assert len(waiting) == 1, proc.output()
    assert "the training command ended (killed by SIGTERM)" in waiting[0]
    assert_one_jit_checkpoint_at_the_last_step(proc, jdir, 1)


def test_plain_python_is_its_own_training_process(spawn, base_env, jdir):
    """python train.py: the child is the training process; the line says so, no torchrun."""
    proc = spawn(entrypoint([PY, *TRAIN]), env=base_env)
    code, _, _ = sigterm_and_wait(proc, proc.pid, jdir)
    assert code == JIT_EXIT, proc.output()
    assert_one_jit_checkpoint_at_the_last_step(proc, jdir, 1)
    line = sigterm_line(proc)
    assert "which is the training process" in line
    assert "torchrun" not in line


def test_a_launcher_that_ignores_sigterm_and_lingers_does_not_hold_pid1(spawn, base_env, jdir):
    """A launcher that ignores SIGTERM and stays after its command ended: the trainer still
    gets SIGTERM and commits; PID 1 waits LINGER_SECONDS (5) for the launcher, then exits 143
    and the namespace (the launcher with it) ends, long before the launcher would have."""
    deaf = [PY, str(CHILDREN / "deaf_launcher.py"), "600", PY, *TRAIN]
    proc = spawn([*UNSHARE_PID, *ENTRYPOINT, "--", *deaf], env=base_env)
    (pid1,) = wait_for(lambda: children_of(proc.pid), 30, "the entrypoint as PID 1")
    code, commit_s, exited = sigterm_and_wait(proc, pid1, jdir)
    assert code == JIT_EXIT, proc.output()
    assert commit_s < COMMIT_WITHIN
    assert commit_s + 4 < exited < commit_s + 15, (commit_s, exited)
    assert_one_jit_checkpoint_at_the_last_step(proc, jdir, 1)
    assert any("it ignores SIGTERM" in line for line in proc.stderr), proc.output()
    assert state_of(pid1) is None


def test_sigterm_before_training_reaches_a_trainer_that_registers_later(spawn, base_env, jdir):
    """SIGTERM while the trainer still loads, under a launcher that ignores SIGTERM: the trainer
    gets SIGTERM as soon as it registers (training starts), commits its first steps and the
    run ends with the JIT exit code instead of training on until the pod's SIGKILL."""
    env = {**base_env, "JITCKPT_EXIT_CODE": "99"}
    deaf = [PY, str(CHILDREN / "deaf_launcher.py"), "0", PY, *TRAIN]
    proc = spawn(entrypoint(deaf), env=env)
    wait_for(lambda: len(descendants(proc.pid)) >= 2, 30, "the launcher's child")
    proc.send(signal.SIGTERM)
    assert proc.wait(timeout=120) == 99, proc.output()
    record = jit_record(jdir)
    assert record is not None
    # Steps take ~10 ms and PID 1 polls the registry every 0.1 s: a few dozen steps on a
    # loaded 2-core runner, against the 3000 it would train until the pod's SIGKILL.
    assert record["step"] <= 100, record
    assert "no process is training under jitckpt" in sigterm_line(proc)


def test_sigterm_before_training_under_a_launcher_that_dies_exits_promptly(spawn, base_env, jdir):
    """SIGTERM while accelerate's simple launcher still starts its child: the launcher dies,
    nothing trains yet, so PID 1 exits at once (its namespace, the child with it, ends)."""
    env = {**base_env, "JITCKPT_EXIT_CODE": "99"}
    command = [str(BIN / "accelerate"), "launch", "--cpu", *TRAIN]
    proc = spawn([*UNSHARE_PID, *ENTRYPOINT, "--", *command], env=env)
    (pid1,) = wait_for(lambda: children_of(proc.pid), 30, "the entrypoint as PID 1")
    wait_for(lambda: any("accelerate" in line for line in proc.stderr), 60, "accelerate")
    started = time.monotonic()
    os.kill(pid1, signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, proc.output()
    assert time.monotonic() - started < 10
    assert jit_record(jdir) is None
    assert not [line for line in proc.stdout if line.startswith("step ")]


@pytest.fixture(scope="module")
def tiny_sft(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return sft.build(tmp_path_factory.mktemp("sft"))


def test_trl_sft_jit_saves_resumes_and_leaves_the_model_in_its_output_dir(
    spawn, base_env, jdir, tiny_sft, tmp_path
):
    """`trl sft` with no launcher flags: SIGTERM after step 20 commits the step it was at
    (exit 143); a rerun resumes there and finishes; the model, config and tokenizer are in
    --output_dir (checkpoints only in JITCKPT_DIR/checkpoints), and the termination message
    says where."""
    model, data = tiny_sft
    out = tmp_path / "sft-out"
    save = ("--save_steps", "100000")
    proc = spawn(entrypoint(sft.command(model, data, out, "--max_steps", "3000", *save)), base_env)
    sft.wait_for_steps(proc, 20)
    proc.send(signal.SIGTERM)
    assert proc.wait(timeout=120) == JIT_EXIT, proc.output()
    step = jit_record(jdir)["step"]  # type: ignore[index]
    assert step == sft.steps_logged(proc) >= 20  # 0 steps lost
    assert "sent to its training processes" in sigterm_line(proc)

    total = step + 10
    rerun = spawn(
        entrypoint(sft.command(model, data, out, "--max_steps", str(total), *save)), base_env
    )
    assert rerun.wait(timeout=300) == 0, rerun.output()
    assert any(f"resuming from {jdir}/checkpoints/checkpoint-{step}" in x for x in rerun.stderr)
    assert sft.steps_logged(rerun) == 10
    assert checkpoint_steps(jdir) == [step, total]
    files = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md"} <= files
    assert not [name for name in files if name.startswith("checkpoint-")]
    assert (jdir / "termination-log").read_text() == (
        f"training command exited with code 0; model in {out}\n"
    )
