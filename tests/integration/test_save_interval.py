"""Time-based periodic saves under real torchrun (2 CPU ranks, gloo): JITCKPT_SAVE_INTERVAL and
the JITCKPT_SAVE_OVERHEAD budget, in the plain loop and the Trainer."""

from __future__ import annotations

import json
import re
import statistics
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
    # The interval holds in time (a request waits for the next agreement round: a few steps),
    # while the steps between saves fall about four-fold.
    assert all(0.95 <= gap <= 2.5 for gap in gaps(began)), gaps(began)
    fast_steps = statistics.median(b - a for a, b in zip(fast, fast[1:]))
    slow_steps = statistics.median(b - a for a, b in zip(slow, slow[1:]))
    assert fast_steps > 2 * slow_steps, (fast, slow)
    assert {f["path"] for f in manifest(jdir, timed[0][0])["files"]} >= {".metadata"}
    # should_stop(step) feeds the sidecar's recovery time and work at risk
    progress = json.loads((jdir / "status" / "progress.json").read_text())
    assert 150 <= progress["step"] <= 190, progress
    assert json.loads((jdir / "status" / "first-step.json").read_text())["began_at_step"] == 0


def test_the_trainer_saves_at_whichever_comes_first_and_the_budget_picks_the_interval(
    spawn, base_env, jdir
):
    """The Trainer (async saves) with save_steps=40, a 10% budget and a 1.5 s interval (which
    wins over the budget's 30 s floor): time-based saves between the step-based ones, all
    committed, each save measured and the choice logged. Steps sleep 50 ms, so 40 of them take
    at least 2 s, longer than the interval on any machine: a fast one (steps of ~50 ms) had 40
    steps take just the interval, and its due saves fell on save_steps' own."""
    env = {**base_env, "JITCKPT_SAVE_INTERVAL": "1.5", "JITCKPT_SAVE_OVERHEAD": "10%"}
    args = ["--max-steps", "120", "--save-steps", "40", "--step-sleep", "0.05"]
    proc = spawn(entrypoint(torchrun(TRAIN_HF, *args)), env=env)
    assert proc.wait(timeout=300) == 0, proc.output()

    began = saves_began(jdir)
    assert {40, 80} <= set(began), began  # save_steps' own
    assert len(began) >= 4, began  # and time-based ones between
    assert all(gap <= 1.5 + 1.0 for gap in gaps(began)), gaps(began)
    chosen = hook_lines(proc, "save interval ")
    assert chosen, proc.stderr
    assert all("budget 10%, at most 1.5 s" in line for line in chosen), chosen
    seconds = [float(re.search(r"save interval ([\d.]+) s", line).group(1)) for line in chosen]
    assert seconds == [1.5], chosen  # logged once: it does not change
    assert manifest(jdir, 120)["kind"] == "final"
