"""The hook inside real torchrun workers (2 CPU ranks, gloo): JIT on SIGTERM, commits, resume."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.procs import descendants, free_port, wait_for
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
    torchrun_node,
    wait_for_sigterm_seen,
    wait_for_step,
)

pytestmark = pytest.mark.integration
JIT_EXIT = 143


def hf(*args: str) -> list[str]:
    return entrypoint(torchrun(TRAIN_HF, *args))


def sigterm_at(spawn, env, command, step: int):
    """Run `command`, SIGTERM the entrypoint once rank 0 finished `step`, wait for the exit."""
    proc = spawn(command, env=env)
    wait_for_step(proc, step)
    proc.send(signal.SIGTERM)
    code = proc.wait(timeout=120)
    return proc, code


def finish(spawn, env, command):
    proc = spawn(command, env=env)
    assert proc.wait(timeout=300) == 0, proc.output()
    return proc


def resumed_from(proc) -> int:
    return int(proc.expect(r"^begin rank=0 pid=\d+ step=(\d+)$").group(1))


def test_with_long_steps_a_sigterm_stops_at_the_step_in_progress(spawn, base_env, jdir):
    """Steps long enough for a blocking agreement round after each (hook/control.py): SIGTERM
    to one rank during step N stops every rank at N, not one round later."""
    proc = spawn(
        hf("--max-steps", "2000", "--save-steps", "1000", "--step-sleep", "1.0"), env=base_env
    )
    rank1 = int(proc.expect(r"^begin rank=1 pid=(\d+)").group(1))
    wait_for_step(proc, 10)  # calibrated after 8 steps
    # Steps of 1 s: a blocking round may cost 5 ms, which a loaded 2-core runner takes (2.1 ms
    # seen in CI, where 0.3 s steps allowed 1.5 ms and calibration chose async rounds).
    time.sleep(0.3)  # inside step 11 (or, on a slow runner, still at step 10's end)
    os.kill(rank1, signal.SIGTERM)
    assert proc.wait(timeout=120) == JIT_EXIT, proc.output()
    assert hook_lines(proc, "stop agreement after every step"), proc.output()
    step = jit_record(jdir)["step"]  # type: ignore[index]
    assert step in (10, 11), proc.output()  # an async round would stop at 12
    assert max(steps_seen(proc, 0)) == max(steps_seen(proc, 1)) == step


def start_holding_save(spawn, env, release: Path, save_steps: int, hold_at: int):
    """Train until the save at `hold_at` is written but not yet committed, and hold it there
    (the Trainer's own synchronous save: async saves are held in test_async_save.py)."""
    env = {**env, "JITCKPT_ASYNC_SAVE": "0"}
    args = ("--max-steps", "2000", "--save-steps", str(save_steps), "--hold-save-at", str(hold_at))
    proc = spawn(hf(*args, "--release-file", str(release)), env=env)
    proc.expect(rf"^holding save {hold_at} rank=0$", timeout=120)
    return proc


def test_sigterm_during_a_periodic_save_commits_it_once_and_stops_there(
    spawn, base_env, jdir, tmp_path
):
    """SIGTERM while step 10 is saved: that save commits once, no second save, exit 143."""
    release = tmp_path / "release"
    proc = start_holding_save(spawn, base_env, release, save_steps=10, hold_at=10)
    proc.send(signal.SIGTERM)
    wait_for_sigterm_seen(proc)
    release.touch()
    assert proc.wait(timeout=120) == JIT_EXIT, proc.output()
    assert checkpoint_steps(jdir) == [10]
    assert manifest(jdir, 10)["kind"] == "periodic"
    record = jit_record(jdir)
    assert (record["step"], record["save_seconds"]) == (10, 0.0)  # type: ignore[index]
    assert len(hook_lines(proc, "committed checkpoint-10")) == 1
    assert max(steps_seen(proc, 0)) == 10


def test_sigkill_mid_save_leaves_it_uncommitted_and_the_rerun_resumes_from_the_previous(
    spawn, base_env, jdir, tmp_path
):
    """SIGKILL while step 10 is saved: checkpoint-10 never commits; the rerun resumes from 5."""
    proc = start_holding_save(spawn, base_env, tmp_path / "release", save_steps=5, hold_at=10)
    proc.kill_tree()
    assert (jdir / "checkpoints" / "checkpoint-10" / "model.safetensors").exists()
    assert not (jdir / "checkpoints" / "checkpoint-10" / "jitckpt-manifest.node-0.json").exists()

    rerun = finish(spawn, base_env, hf("--max-steps", "12", "--save-steps", "5"))
    assert resumed_from(rerun) == 5
    assert hook_lines(rerun, "past the resume point or uncommitted: checkpoint-10")
    assert manifest(jdir, 10)["kind"] == "periodic"  # saved afresh by the rerun


def final_weights(jdir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(jdir / "checkpoints" / f"checkpoint-{step}" / "model.safetensors"))


def test_two_sigterms_and_resumes_end_with_the_weights_of_an_uninterrupted_run(
    spawn, base_env, jdir, tmp_path
):
    """SIGTERM mid-training: the last completed step is committed, exit 143. The rerun resumes
    there; SIGTERM to rank 1 only (a drained node): both ranks save one step and exit, no hang.
    The next rerun resumes there and ends with the weights of the uninterrupted run."""
    total = 60
    args = ("--max-steps", str(total), "--save-steps", "1000")
    straight = tmp_path / "straight"
    straight.mkdir()
    finish(spawn, {**base_env, "JITCKPT_DIR": str(straight)}, hf(*args))

    first, code = sigterm_at(spawn, base_env, hf(*args), 8)
    assert code == JIT_EXIT, first.output()
    step = jit_record(jdir)["step"]  # type: ignore[index]
    assert step == max(steps_seen(first, 0)) == max(steps_seen(first, 1)) >= 8
    assert checkpoint_steps(jdir) == [step]
    man = manifest(jdir, step)
    assert (man["kind"], man["world_size"], man["nodes"]) == ("jit", 2, 1)
    names = {f["path"] for f in man["files"]}
    assert {"model.safetensors", "optimizer.pt", "rng_state_0.pth", "rng_state_1.pth"} <= names
    summary = (jdir / "termination-log").read_text()
    assert summary.startswith(f"JIT checkpoint checkpoint-{step} committed "), summary
    assert "s after SIGTERM" in summary, summary
    assert "SignalException" not in first.output()  # torchrun's is one line (hook/torchrun.py)

    second = spawn(hf(*args), env=base_env)
    begins = [second.expect(r"^begin rank=(\d) pid=(\d+) step=(\d+)$") for _ in (0, 1)]
    assert {int(b.group(3)) for b in begins} == {step}
    rank1 = next(int(b.group(2)) for b in begins if b.group(1) == "1")
    # Short steps share an agreement round (hook/control.py), so the stop may come a few
    # steps after SIGTERM: the second one is timed from where the first stopped.
    wait_for_step(second, step + 4)
    os.kill(rank1, signal.SIGTERM)
    assert second.wait(timeout=120) == JIT_EXIT, second.output()
    assert min(steps_seen(second, 0)) == step + 1
    step = jit_record(jdir)["step"]  # type: ignore[index]
    assert max(steps_seen(second, 0)) == max(steps_seen(second, 1)) == step
    assert len(hook_lines(second, "SIGTERM received")) == 1
    assert manifest(jdir, step)["kind"] == "jit"

    last = finish(spawn, base_env, hf(*args))
    assert resumed_from(last) == step
    assert manifest(jdir, total)["kind"] == "final"
    expected, got = final_weights(straight, total), final_weights(jdir, total)
    assert expected.keys() == got.keys()
    worst = max((expected[k] - got[k]).abs().max().item() for k in expected)
    assert worst <= 1e-7, f"max abs diff {worst}"


@pytest.mark.parametrize(
    ("label", "args", "stop_after", "total"),
    [
        ("gradient accumulation", ("--grad-accum", "4", "--max-steps", "100"), 6, 100),
        (
            "epoch strategy",
            ("--epochs", "3", "--samples", "256", "--save-strategy", "epoch"),
            11,
            96,
        ),
        ("TRL SFTTrainer", ("--trainer", "sft", "--max-steps", "100"), 6, 100),
        ("DataLoader workers", ("--num-workers", "2", "--max-steps", "100"), 6, 100),
        # HF's own JIT handler is installed in Trainer.__init__; the hook's, at train(),
        # replaces it: one JIT save, at the step the ranks agreed on, not HF's 3 s later.
        ("HF enable_jit_checkpoint on too", ("--hf-jit", "--max-steps", "100"), 6, 100),
    ],
)
def test_variant_jit_saves_and_resumes(spawn, base_env, jdir, label, args, stop_after, total):
    """Each Trainer variant JIT-saves on SIGTERM and a rerun resumes from that step to the end."""
    proc, code = sigterm_at(spawn, base_env, hf(*args), stop_after)
    assert code == JIT_EXIT, proc.output()
    step = jit_record(jdir)["step"]  # type: ignore[index]
    assert step >= stop_after
    assert step == max(steps_seen(proc, 0)) == max(steps_seen(proc, 1))
    assert manifest(jdir, step)["kind"] in ("jit", "periodic")
    assert not list(jdir.rglob("checkpoint-is-incomplete.txt"))  # HF's JIT save never began

    rerun = finish(spawn, base_env, hf(*args))
    assert resumed_from(rerun) == step
    assert max(steps_seen(rerun, 0)) == total
    assert manifest(jdir, total)["kind"] in ("final", "periodic")


def test_plain_pytorch_loop_with_the_public_api_jit_saves_and_resumes(spawn, base_env, jdir):
    """README's plain loop: should_stop() + save(kind='jit') commit and exit; a rerun resumes."""
    command = entrypoint(torchrun(TRAIN_LOOP, "--steps", "5000", "--save-every", "1000"))
    proc, code = sigterm_at(spawn, base_env, command, 20)
    assert code == JIT_EXIT, proc.output()
    step = jit_record(jdir)["step"]  # type: ignore[index]
    assert step == max(steps_seen(proc, 0)) == max(steps_seen(proc, 1))
    man = manifest(jdir, step)
    assert man["kind"] == "jit"
    assert ".metadata" in {f["path"] for f in man["files"]}

    rerun = finish(spawn, base_env, entrypoint(torchrun(TRAIN_LOOP, "--steps", str(step + 10))))
    assert resumed_from(rerun) == step
    assert manifest(jdir, step + 10)["kind"] == "final"


def assert_prompt_plain_exit(proc, jdir: Path) -> None:
    """SIGTERM ends the run within seconds, without the JIT exit code (99 here) or a JIT record."""
    proc.send(signal.SIGTERM)
    started = time.monotonic()
    code = proc.wait(timeout=60)
    assert time.monotonic() - started < 20
    assert code != 99
    assert jit_record(jdir) is None


def test_sigterm_before_training_starts_exits_promptly(spawn, base_env, jdir):
    """SIGTERM while the workers are still importing: everything exits promptly, no JIT record."""
    env = {**base_env, "JITCKPT_EXIT_CODE": "99"}
    proc = spawn(hf("--max-steps", "50"), env=env)
    wait_for(lambda: len(descendants(proc.pid)) >= 3, 30, "torchrun and its two workers")
    assert_prompt_plain_exit(proc, jdir)
    assert not [line for line in proc.stdout if line.startswith("step ")]


def test_sigterm_after_training_ends_exits_promptly(spawn, base_env, jdir, tmp_path):
    """SIGTERM during work after train() returned: the default handler is back, the process ends."""
    release = tmp_path / "never"
    env = {**base_env, "JITCKPT_EXIT_CODE": "99"}
    proc = spawn(
        hf("--max-steps", "5", "--wait-after-train", "--release-file", str(release)), env=env
    )
    both = {"done step=5 rank=0", "done step=5 rank=1"}
    # A substring of the output, not a line: HF writes its metrics line and its newline apart,
    # and the other rank's line can land between them.
    wait_for(lambda: all(s in "\n".join(proc.stdout) for s in both), 120, "both ranks to finish")
    assert_prompt_plain_exit(proc, jdir)
    assert manifest(jdir, 5)["kind"] == "final"


def test_a_plain_loop_that_never_calls_done_ends_by_sigterm_after_its_final_save(
    spawn, base_env, jdir
):
    """The final save ends a plain loop's training as `done()` does: a script that never calls
    `done()` and works on after the loop (and destroy_process_group) ends by SIGTERM there."""
    env = {**base_env, "JITCKPT_EXIT_CODE": "99"}
    args = ("--steps", "5", "--save-every", "1000", "--no-done", "--post-sleep", "120")
    proc = spawn(entrypoint(torchrun(TRAIN_LOOP, *args)), env=env)
    both = [f"post-training work rank={rank}" for rank in (0, 1)]
    wait_for(lambda: all(line in proc.stdout for line in both), 120, "work after training")
    assert_prompt_plain_exit(proc, jdir)
    assert "no process is training under jitckpt" in proc.output()
    assert not [line for line in proc.stdout if line.startswith("post-training work done")]
    assert manifest(jdir, 5)["kind"] == "final"


def two_nodes(spawn, base_env, dirs, *args: str):
    port = free_port()
    return [
        spawn(
            entrypoint(torchrun_node(TRAIN_HF, *args, node=n, nodes=2, port=port)),
            env={**base_env, "JITCKPT_DIR": str(d), "JITCKPT_TERMINATION_LOG": str(d / "tlog")},
        )
        for n, d in enumerate(dirs)
    ]


def test_draining_one_of_two_nodes_stops_both_and_each_commits_its_own_part(
    spawn, base_env, tmp_path
):
    """SIGTERM to node 1 only: all four ranks stop at one step; each node owns what it uploads."""
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for d in dirs:
        d.mkdir()
    args = ("--max-steps", "3000", "--save-steps", "1000")
    node0, node1 = two_nodes(spawn, base_env, dirs, *args)
    wait_for_step(node0, 10)
    node1.send(signal.SIGTERM)
    assert node1.wait(timeout=120) == JIT_EXIT, node1.output()
    assert node0.wait(timeout=120) == JIT_EXIT, node0.output()
    steps = {jit_record(d)["step"] for d in dirs}  # type: ignore[index]
    assert len(steps) == 1
    step = steps.pop()
    owned = {}
    for d in dirs:
        for node in (0, 1):
            man = manifest(d, step, node)
            assert (man["nodes"], man["world_size"], man["kind"]) == (2, 4, "jit")
            owned[node] = {f["path"] for f in man["files"] if f["owner"] == node}
    assert {"model.safetensors", "optimizer.pt", "rng_state_0.pth"} <= owned[0]
    assert owned[1] == {"rng_state_2.pth", "rng_state_3.pth"}

    # Restarted in place, node 1 holds only its own part: training must not silently start over.
    again = two_nodes(spawn, base_env, dirs, *args)
    for proc in again:
        assert proc.wait(timeout=120) != 0
    line = "no node holds every file its ranks load"
    assert any(line in x for p in again for x in p.stderr)

    # With every file of every manifest restored (the sidecar's restore), the job resumes there:
    # tests/system/test_multinode.py.


def test_a_callback_that_acts_on_each_checkpoint_in_on_save_finds_it_in_output_dir(
    spawn, base_env, jdir, tmp_path
):
    """W&B's WANDB_LOG_MODEL=checkpoint (MLflow's, Neptune's, ClearML's uploads alike) reads the
    checkpoint at output_dir/checkpoint-<step> in on_save: there, whole, on every rank, for
    every save (periodic and JIT), through a link to jitckpt's; what the callback adds to it is
    in the commit. Its saves are the Trainer's own (one line), and no link outlives the run."""
    out = tmp_path / "out"
    command = hf("--max-steps", "3000", "--save-steps", "5", "--checkpoint-callback")
    proc, code = sigterm_at(spawn, base_env, [*command, "--output-dir", str(out)], 7)
    assert code == JIT_EXIT, proc.output()
    assert len(hook_lines(proc, "Trainer's own save: CheckpointCallback has an on_save")) == 1
    record = jit_record(jdir)
    assert record is not None, proc.output()
    seen = [x for x in proc.stdout if x.startswith("on_save sees ") and x.endswith(" rank=0")]
    # every 5 steps and the JIT save's (the stop step may be past 10: SIGTERM takes some steps)
    saved = sorted({*range(5, record["step"] + 1, 5), record["step"]})
    assert len(seen) == len(saved), (saved, proc.output())
    assert all("model.safetensors optimizer.pt" in x for x in seen), seen
    for step in saved:
        names = {f["path"] for f in manifest(jdir, step)["files"]}
        assert {"callback_state_0.json", "callback_state_1.json", "model.safetensors"} <= names
    assert list(out.glob("checkpoint-*")) == [], list(out.iterdir())


def test_a_second_trainer_in_the_process_trains_as_without_jitckpt(spawn, base_env, jdir, tmp_path):
    """SFT then DPO in one script: the second stage trains afresh as it would without jitckpt
    (it once resumed from the first stage's last checkpoint and trained one step), one line
    says it is the Trainer's own. A SIGTERM in it ends the command as without jitckpt; the
    rerun's first stage resumes from its own last checkpoint and trains no step past it (HF
    would train one), the second runs again: the weights of a run without jitckpt, bit for
    bit."""
    out = tmp_path / "out"
    args = ("--max-steps", "6", "--save-steps", "3", "--second-stage", "6")
    args = (*args, "--output-dir", str(out), "--step-sleep", "0.3")

    def digests(proc) -> tuple[str, str]:
        first = proc.expect(r"^stage1 digest=(\w+) rank=0$").group(1)
        return first, proc.expect(r"^stage2 done step=6 digest=(\w+) rank=0$").group(1)

    plain = spawn(torchrun(TRAIN_HF, *args), env=base_env)  # no jitckpt
    code = plain.wait(timeout=300)
    expected = digests(plain)
    # torch's own teardown (no jitckpt here) sometimes aborts a rank after all was printed
    aborted = "terminate called without an active exception" in plain.output()
    ended = [line for line in plain.stdout if line.startswith("stage2 done ")]
    assert code == 0 or (aborted and len(ended) == 2), plain.output()

    proc = spawn(hf(*args), env=base_env)
    proc.expect(r"^stage2 step 2 rank=0$", timeout=120)
    proc.send(signal.SIGTERM)
    assert proc.wait(timeout=120) not in (0, None), proc.output()
    assert jit_record(jdir) is None
    assert "no process is training under jitckpt" in proc.output()
    assert len(hook_lines(proc, "a second train() in this process")) == 1
    assert checkpoint_steps(jdir) == [3, 6]  # the first stage's; the second's are its own

    again = finish(spawn, base_env, hf(*args))
    assert len(hook_lines(again, "nothing left to train: checkpoint-6 reaches max_steps 6")) == 1
    assert "done step=6 rank=0" in "\n".join(again.stdout), again.output()
    assert digests(again) == expected
    assert checkpoint_steps(jdir) == [3, 6]
    assert sorted(p.name for p in (out / "stage2").glob("checkpoint-*")) == [
        "checkpoint-3",
        "checkpoint-6",
    ]


def test_a_sigterm_after_a_train_that_raised_ends_the_command_as_without_jitckpt(
    spawn, base_env, jdir, tmp_path
):
    """The first train() raises on every rank (no on_train_end), the script catches it and
    trains on with a second Trainer: a SIGTERM then ends the command at once, as without
    jitckpt (jitckpt's flag once took it, and the workers ran on until torchrun's SIGKILL)."""
    args = ("--max-steps", "6", "--raise-at", "2", "--second-stage", "200", "--step-sleep", "0.2")
    proc = spawn(hf(*args, "--output-dir", str(tmp_path / "out")), env=base_env)
    proc.expect(r"^caught bad batch at step 2 rank=0$", timeout=120)
    proc.expect(r"^stage2 step 2 rank=0$", timeout=60)
    sent = time.monotonic()
    proc.send(signal.SIGTERM)
    assert proc.wait(timeout=120) not in (0, None), proc.output()
    assert time.monotonic() - sent < 10, proc.output()  # torchrun's SIGKILL comes after 22 s
    assert "no process is training under jitckpt" in proc.output()
    assert hook_lines(proc, "SIGTERM received") == [], proc.output()
    assert jit_record(jdir) is None


def test_with_save_only_model_checkpoints_hold_the_whole_state_and_resume_exactly(
    spawn, base_env, jdir, tmp_path
):
    """save_only_model=True leaves the optimizer, scheduler and RNG states out of checkpoints:
    a resume from such a JIT checkpoint once restarted the learning-rate schedule with a fresh
    optimizer. Under jitckpt they are in it (one line), and the resumed run ends with the
    weights of an uninterrupted one."""
    total = 30
    args = ("--max-steps", str(total), "--save-steps", "1000", "--save-only-model")
    straight = tmp_path / "straight"
    straight.mkdir()
    finish(spawn, {**base_env, "JITCKPT_DIR": str(straight)}, hf(*args))

    first, code = sigterm_at(spawn, base_env, hf(*args), 8)
    assert code == JIT_EXIT, first.output()
    assert len(hook_lines(first, "save_only_model=True: checkpoints hold the optimizer")) == 1
    step = jit_record(jdir)["step"]  # type: ignore[index]
    names = {f["path"] for f in manifest(jdir, step)["files"]}
    assert {"optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"} <= names

    last = finish(spawn, base_env, hf(*args))
    assert resumed_from(last) == step
    expected, got = final_weights(straight, total), final_weights(jdir, total)
    worst = max((expected[k] - got[k]).abs().max().item() for k in expected)
    assert worst <= 1e-7, f"max abs diff {worst}"


def test_a_retry_after_an_out_of_memory_error_leaves_the_failed_attempts_saves_behind(
    spawn, base_env, jdir, tmp_path
):
    """auto_find_batch_size: after an out-of-memory error at step 5 (checkpoints 2 and 4 of
    batch 4 committed) the Trainer trains again from step 0 with batch 3. SIGTERM in the retry:
    the JIT checkpoint was the failed attempt's checkpoint-2, skipped as committed, and the
    rerun resumed from its checkpoint-4 (batch 4 again). Now they are left behind: every
    checkpoint is the retry's, and the rerun ends with the weights of an uninterrupted run."""
    total = 30  # the stop comes a few steps after SIGTERM (hook/control.py): room for it
    args = ("--max-steps", str(total), "--save-steps", "2", "--oom-at", "5")
    straight = tmp_path / "straight"
    straight.mkdir()
    finish(spawn, {**base_env, "JITCKPT_DIR": str(straight)}, hf(*args))

    def batch(step: int) -> int:
        state = jdir / "checkpoints" / f"checkpoint-{step}" / "trainer_state.json"
        return int(json.loads(state.read_text())["train_batch_size"])

    first = spawn(hf(*args, "--step-sleep", "0.1"), env=base_env)
    for step in (0, 0):  # the first attempt's begin, the retry's
        assert int(first.expect(r"^begin rank=0 pid=\d+ step=(\d+)$").group(1)) == step
    wait_for_step(first, 3)
    first.send(signal.SIGTERM)
    assert first.wait(timeout=120) == JIT_EXIT, first.output()
    assert len(hook_lines(first, "the Trainer trains again from step 0")) == 1
    step = jit_record(jdir)["step"]  # type: ignore[index]
    assert 3 <= step < total
    assert [batch(s) for s in checkpoint_steps(jdir)] == [3] * len(checkpoint_steps(jdir))
    lineages = {manifest(jdir, s)["lineage"] for s in checkpoint_steps(jdir)}
    assert len(lineages) == 1

    last = finish(spawn, base_env, hf(*args))
    assert resumed_from(last) == step
    expected, got = final_weights(straight, total), final_weights(jdir, total)
    worst = max((expected[k] - got[k]).abs().max().item() for k in expected)
    assert worst <= 1e-7, f"max abs diff {worst}"
