"""The first rule with evaluations and a best model: for each strategy, the checkpoint HF picks as
the best (state.best_model_checkpoint) and the weights train() ends with are the same with and
without jitckpt, and every checkpoint jitckpt commits holds exactly its own step's state.

Each case trains the same tiny model twice, plainly (torchrun, no entrypoint: no hook) and under
jitckpt-entrypoint. The eval loss (on training samples) falls every epoch, so "lowest" makes the
last evaluation the best and "highest" the first one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from harness.procs import Proc, clean_env
from harness.training import TRAIN_HF, checkpoint_steps, entrypoint, manifest, torchrun

pytestmark = [pytest.mark.integration, pytest.mark.untimed]
EPOCHS = ("--epochs", "3", "--samples", "64", "--eval-strategy", "epoch")
"""3 epochs of 8 optimizer steps (2 ranks, 4 samples each), an evaluation at each epoch's end."""
STATE_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pth",
               "rng_state_1.pth")  # fmt: skip


@dataclass
class Run:
    best: str
    """basename of state.best_model_checkpoint after train()"""
    final: dict[str, torch.Tensor]
    """the model's weights after train() (trainer.save_model)"""
    checkpoints: Path
    steps: list[int]
    """the checkpoints left: plain, HF's; under jitckpt, committed ones (every one is)"""
    evals: dict[int, float]


def train(env: dict[str, str], where: Path, *args: str, hooked: bool) -> Run:
    """Train to the end, plainly or under jitckpt-entrypoint (JITCKPT_DIR = `where`/jitckpt)."""
    out, jdir = where / "output", where / "jitckpt"
    jdir.mkdir(parents=True)
    command = torchrun(TRAIN_HF, *args, "--save-model", "--output-dir", str(out))
    proc = Proc(entrypoint(command) if hooked else command, env={**env, "JITCKPT_DIR": str(jdir)})
    try:
        assert proc.wait(timeout=600) == 0, proc.output()
    finally:
        proc.kill_tree()
    text = proc.output()
    assert ("jitckpt-hook" in text) == hooked, text  # the plain run really is without jitckpt
    found = re.finditer(r"^eval (\d+) (\S+)$", text, re.MULTILINE)
    checkpoints = jdir / "checkpoints" if hooked else out
    steps = sorted(int(p.name.split("-")[1]) for p in checkpoints.glob("checkpoint-*"))
    if hooked:
        assert steps == checkpoint_steps(jdir)
        for step in steps:
            assert manifest(jdir, step)["step"] == step  # committed
    return Run(
        proc.expect(r"^best (\S+)$").group(1),
        load_file(str(out / "model.safetensors")),
        checkpoints,
        steps,
        {int(m.group(1)): float(m.group(2)) for m in found},
    )


def same(a: Any, b: Any) -> bool:
    """Equal, tensor for tensor (state dicts, RNG states)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


def load(path: Path) -> Any:
    if path.suffix == ".safetensors":
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=False)  # our own test files


def assert_state_of_step(got: Path, want: Path, step: int) -> None:
    """Checkpoint `got` of `step` holds what `want` (HF's own checkpoint of the same step of the
    same training) holds: weights, optimizer, scheduler, RNG states, the step."""
    for name in STATE_FILES:
        assert same(load(got / name), load(want / name)), f"{name} of checkpoint-{step} differs"
    state = json.loads((got / "trainer_state.json").read_text())
    assert state["global_step"] == step


def assert_as_plain(hooked: Run, plain: Run, reference: Run) -> None:
    """jitckpt picks the same best and ends with the same weights as HF alone; each of its
    checkpoints is its step's state in `reference` (HF's checkpoints of every one of its steps)."""
    assert hooked.evals == plain.evals  # the same training and evaluations
    assert hooked.best == plain.best
    assert hooked.final.keys() == plain.final.keys()
    assert all(torch.equal(hooked.final[k], plain.final[k]) for k in plain.final)
    assert set(plain.steps) <= set(hooked.steps)  # and the final step besides, if HF skipped it
    for step in hooked.steps:
        want = reference.checkpoints / f"checkpoint-{step}"
        assert want.is_dir(), f"no reference for checkpoint-{step}"
        assert_state_of_step(hooked.checkpoints / f"checkpoint-{step}", want, step)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], Run]:
    """HF alone, EPOCHS with epoch saves and the last epoch the best: the environment, and HF's
    checkpoints of steps 8, 16 and 24."""
    env = clean_env()
    where = tmp_path_factory.mktemp("reference")
    run = train(env, where, *EPOCHS, "--save-strategy", "epoch", "--load-best", "lowest",
                hooked=False)  # fmt: skip
    assert run.steps == [8, 16, 24]
    assert min(run.evals, key=run.evals.__getitem__) == 24, run.evals  # the last is the best
    return env, run


def test_epoch_saves_last_epoch_best_loads_the_last_epoch(reference, tmp_path):
    """save_strategy=epoch, the last epoch the best: the final save waits for the epoch's
    evaluation, as HF's does, so the best is checkpoint-24 (not checkpoint-16) with jitckpt too."""
    env, plain = reference
    hooked = train(env, tmp_path, *EPOCHS, "--save-strategy", "epoch", "--load-best", "lowest",
                   hooked=True)  # fmt: skip
    assert plain.best == "checkpoint-24"
    assert_as_plain(hooked, plain, plain)
    assert manifest(tmp_path / "jitckpt", 24)["kind"] == "final"


def test_epoch_best_metric_without_loading_it_is_tracked_as_hf_does(reference, tmp_path):
    """load_best_model_at_end=False but metric_for_best_model set: state.best_model_checkpoint
    is the last epoch's, as without jitckpt; train() ends with the last step's weights."""
    env, ref = reference
    args = (*EPOCHS, "--save-strategy", "epoch", "--best-metric", "lowest")
    plain = train(env, tmp_path / "plain", *args, hooked=False)
    hooked = train(env, tmp_path / "hooked", *args, hooked=True)
    assert plain.best == "checkpoint-24"
    assert_as_plain(hooked, plain, ref)


@pytest.mark.parametrize(
    ("args", "steps"),
    [
        # The last evaluation is not a new best: HF does not save the last step; jitckpt does
        # (kind final), before the best model's weights replace the step's own.
        (("--load-best", "highest"), [8, 24]),
        # Early stopping after epoch 2 (no better than epoch 1): the same, at step 16.
        (("--load-best", "highest", "--early-stopping", "1"), [8, 16]),
    ],
    ids=["last-not-best", "early-stop"],
)
def test_save_strategy_best_the_final_save_holds_the_last_step_not_the_best(
    reference, tmp_path, args, steps
):
    """save_strategy=best, load_best_model_at_end, the first epoch the best: HF's best and final
    weights with jitckpt too; jitckpt's final checkpoint holds the last step's own weights,
    optimizer and RNG states, not the best model's weights with the last step's optimizer."""
    env, ref = reference
    args = (*EPOCHS, "--save-strategy", "best", *args)
    plain = train(env, tmp_path / "plain", *args, hooked=False)
    hooked = train(env, tmp_path / "hooked", *args, hooked=True)
    assert plain.best == "checkpoint-8"
    assert hooked.steps == steps
    assert_as_plain(hooked, plain, ref)
    assert manifest(tmp_path / "hooked" / "jitckpt", steps[-1])["kind"] == "final"


def test_max_steps_mid_epoch_picks_as_hf_does(reference, tmp_path):
    """max_steps=20 ends training in the third epoch: HF runs that epoch's end at step 20, its
    evaluation a new best, then saves step 20; jitckpt's final save waits for that evaluation
    too, so the best is checkpoint-20 with jitckpt too (a save before it left checkpoint-16)."""
    env, _ = reference
    args = ("--max-steps", "20", "--samples", "64", "--eval-strategy", "epoch",
            "--save-strategy", "epoch", "--load-best", "lowest")  # fmt: skip
    plain = train(env, tmp_path / "plain", *args, hooked=False)
    hooked = train(env, tmp_path / "hooked", *args, hooked=True)
    assert plain.best == "checkpoint-20"
    assert plain.steps == [8, 16, 20]
    assert_as_plain(hooked, plain, plain)
    assert manifest(tmp_path / "hooked" / "jitckpt", 20)["kind"] == "final"
