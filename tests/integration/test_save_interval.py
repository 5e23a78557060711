"""Time-based periodic saves under real torchrun (2 CPU ranks, gloo): JITCKPT_SAVE_INTERVAL and
the JITCKPT_SAVE_OVERHEAD budget, in the plain loop and the Trainer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.training import TRAIN_HF, TRAIN_LOOP, entrypoint, hook_lines, manifest, torchrun

pytestmark = pytest.mark.integration


def saves_began(jdir: Path) -> dict[int, float]:
    """Step -> when its committed periodic save began (status/save-<step>.json)."""
    events = (json.loads(p.read_text()) for p in (jdir / "status").glob("save-*.json"))
    return {e["step"]: e["started_at"] for e in events if e["kind"] == "periodic"}


def gaps(began: dict[int, float]) -> list[float]:
    times = [began[step] for step in sorted(began)]
    return [b - a for a, b in zip(times, times[1:])]


def test_the_interval_holds_when_steps_slow_down_and_every_rank_saves_the_same_steps(
    spawn, base_env, jdir
):
    """Steps of ~20 ms, then of ~100 ms from step 150: a save every second either way."""
    env = {**base_env, "JITCKPT_SAVE_INTERVAL": "1s"}
    args = ["--steps", "190", "--save-every", "100000", "--step-sleep", "0.02"]
    command = torchrun(TRAIN_LOOP, *args, "--slow-from", "150", "--slow-sleep", "0.1")
    proc = spawn(entrypoint(command), env=env)
    assert proc.wait(timeout=300) == 0, proc.output()

    timed = [
        [
            int(m.group(1))
            for line in proc.stdout
            if (m := re.match(rf"timed save at step (\d+) rank={r}$", line))
        ]
        for r in (0, 1)
    ]
    assert timed[0] == timed[1], timed  # every rank, the same steps
    began = saves_began(jdir)
    assert sorted(began) == [s for s in timed[0] if s < 190]  # each committed (all ranks wrote)
    fast = [s for s in timed[0] if s < 150]
    slow = [s for s in timed[0] if s > 155]
    assert len(fast) >= 2, timed
    assert len(slow) >= 2, timed
    # The interval holds in time, while the steps between saves fall about five-fold.
    assert all(0.95 <= gap <= 1.8 for gap in gaps(began)), gaps(began)
    fast_steps = [b - a for a, b in zip(fast, fast[1:])]
    slow_steps = [b - a for a, b in zip(slow, slow[1:])]
    assert min(fast_steps) > 2 * max(slow_steps), (fast_steps, slow_steps)
    assert {f["path"] for f in manifest(jdir, timed[0][0])["files"]} >= {".metadata"}


def test_the_trainer_saves_at_whichever_comes_first_and_the_budget_picks_the_interval(
    spawn, base_env, jdir
):
    """The Trainer (async saves) with save_steps=40, a 2 s cap and a 10% budget: the budget's
    measured interval (under the cap) between the step-based saves, all committed."""
    env = {**base_env, "JITCKPT_SAVE_INTERVAL": "2", "JITCKPT_SAVE_OVERHEAD": "10%"}
    args = ["--max-steps", "120", "--save-steps", "40", "--step-sleep", "0.04"]
    proc = spawn(entrypoint(torchrun(TRAIN_HF, *args)), env=env)
    assert proc.wait(timeout=300) == 0, proc.output()

    began = saves_began(jdir)
    assert {40, 80} <= set(began), began  # save_steps' own
    assert len(began) >= 4, began  # and time-based ones between
    assert all(gap <= 2.0 + 0.8 for gap in gaps(began)), gaps(began)
    chosen = hook_lines(proc, "save interval ")
    assert chosen, proc.stderr
    assert all("budget 10%, at most 2 s" in line for line in chosen), chosen
    seconds = [float(re.search(r"save interval ([\d.]+) s", line).group(1)) for line in chosen]
    assert all(1.0 <= s <= 2.0 for s in seconds), chosen
    assert manifest(jdir, 120)["kind"] == "final"
