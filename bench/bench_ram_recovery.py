"""A trainer killed without notice and run again in the same pod: what the RAM tier gets back.

The issue 36 goal: with `JITCKPT_SNAPSHOT_INTERVAL=2s`, a SIGKILL of the trainer's processes
loses at most 2 s of steps plus one, the first step again comes at most 5 s after the trainer's
own start-up, and the resume is bitwise exact.

Same script (tests/integration/children/train_hf.py), same model, under jitckpt-entrypoint +
torchrun on CPU, per rank count (1 and 2) and trial, two variants through the same kill:

- volume: jitckpt's defaults, no memory directory: the run goes back to the newest periodic
  save on the volume (`save_steps` SAVE_STEPS), as every release before the RAM tier did, and
  as HF's own periodic saves do;
- ram: `JITCKPT_MEMORY_DIR` on /dev/shm and `JITCKPT_SNAPSHOT_INTERVAL=2s`.

Each run trains to STEPS; after rank 0 reports the trial's kill step (the same for both
variants), the whole process tree is SIGKILLed (the entrypoint too: a container killed and
restarted in place; the volume and the memory directory stay), and the same command runs
again. Per run: the fresh start to the first step (the trainer's own start-up), the rerun's
start to its first step, the step it resumed from (its `begin` line), steps and seconds lost
(rank 0's last reported step minus the resumed one; seconds at the run's median step time),
and whether the rerun's final weights equal an uninterrupted run's bit for bit (one per rank
count). Medians over the trials; the kill steps are drawn once from a fixed seed.

    .venv/bin/python bench/bench_ram_recovery.py [TRIALS] [--ranks 1 2]   # default 3
        [--strategy fsdp2-sharded]   # FSDP2's sharded state (2 ranks): its snapshots, staged
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness import pod
from harness.procs import Proc, clean_env
from harness.training import TRAIN_HF, entrypoint, torchrun

MODEL = ["--hidden", "512", "--layers", "8", "--vocab", "4000"]
STEPS, SAVE_STEPS = 60, 25
KILL_RANGE = (14, 48)
VARIANTS = ("volume", "ram")
STEP = re.compile(r"^step (\d+) rank=0$")
BEGIN = re.compile(r"^begin rank=0 pid=\d+ step=(\d+)$")


STRATEGY: list[str] = []
"""train_hf.py's --strategy and its value (--strategy here), or nothing: DDP."""


def command(ranks: int) -> list[str]:
    args = ("--max-steps", str(STEPS), "--save-steps", str(SAVE_STEPS), "--logging-steps", "1000")
    return entrypoint(torchrun(TRAIN_HF, *args, *MODEL, *STRATEGY, nproc=ranks))


def env_for(variant: str, jdir: Path, memory: Path) -> dict[str, str]:
    env = {**clean_env(jdir, checkout=True), "JITCKPT_TERMINATION_LOG": ""}
    if variant == "ram":
        env["JITCKPT_MEMORY_DIR"] = str(memory)
        env["JITCKPT_SNAPSHOT_INTERVAL"] = "2s"
    return env


def first_step(proc: Proc, started: float) -> float:
    """Seconds from the start to rank 0's first step line."""
    proc.expect(STEP.pattern, timeout=600)
    return next(t for t, line in proc.stamped if STEP.match(line)) - started


def steps_of(proc: Proc) -> dict[int, float]:
    return {int(m.group(1)): t for t, line in proc.stamped if (m := STEP.match(line))}


def final_weights(jdir: Path) -> dict[str, torch.Tensor]:
    return pod.final_weights(jdir, STEPS)


def straight(ranks: int, tmp: Path) -> dict[str, torch.Tensor]:
    """An uninterrupted run's final weights."""
    jdir = tmp / f"straight-{ranks}"
    proc = Proc(command(ranks), env=env_for("volume", jdir, tmp / "unused"))
    if proc.wait(timeout=1800) != 0:
        raise SystemExit(f"the uninterrupted run failed:\n{proc.output()[-3000:]}")
    weights = final_weights(jdir)
    shutil.rmtree(jdir, ignore_errors=True)
    return weights


def trial(variant: str, ranks: int, kill_at: int, tmp: Path, reference: Any) -> dict[str, Any]:
    jdir, memory = tmp / f"{variant}-{ranks}", Path(tempfile.mkdtemp(dir="/dev/shm"))
    env = env_for(variant, jdir, memory)
    procs: list[Proc] = []
    try:
        began = time.monotonic()
        first = Proc(command(ranks), env=env)
        procs.append(first)
        fresh = first_step(first, began)
        first.expect(rf"^step {kill_at} rank=0$", timeout=600)
        first.kill_tree()  # SIGKILL, the whole tree
        seen = steps_of(first)
        killed_after = max(seen)
        gaps = [seen[s + 1] - seen[s] for s in sorted(seen) if s + 1 in seen and s >= 3]
        step_s = statistics.median(gaps)

        began = time.monotonic()
        rerun = Proc(command(ranks), env=env)
        procs.append(rerun)
        again = first_step(rerun, began)
        resumed = next(int(m.group(1)) for line in rerun.stdout if (m := BEGIN.match(line)))
        if rerun.wait(timeout=1800) != 0:
            raise SystemExit(f"{variant}: the rerun failed:\n{rerun.output()[-3000:]}")
        got = final_weights(jdir)
        exact = got.keys() == reference.keys() and all(
            torch.equal(got[k], reference[k]) for k in reference
        )
        from_ram = any("(a snapshot in RAM)" in line for line in rerun.stderr)
    finally:
        for proc in procs:  # a failed trial leaves no trainer running into the next
            proc.kill_tree()
        shutil.rmtree(jdir, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    lost = killed_after - resumed
    return {
        "fresh": fresh,
        "again": again,
        "killed_after": killed_after,
        "resumed": resumed,
        "lost": lost,
        "lost_s": lost * step_s,
        "step_s": step_s,
        "exact": exact,
        "from_ram": from_ram,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trials", nargs="?", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--strategy", default="", help="train_hf.py's, e.g. fsdp2-sharded")
    opts = parser.parse_args()
    if opts.strategy:
        STRATEGY.extend(["--strategy", opts.strategy])
    rng = random.Random(36)
    kills = [rng.randint(*KILL_RANGE) for _ in range(opts.trials)]
    rows: dict[tuple[int, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ram-recovery-") as name:
        tmp = Path(name)
        for ranks in opts.ranks:
            reference = straight(ranks, tmp)
            for n, kill_at in enumerate(kills):
                order = VARIANTS if n % 2 == 0 else VARIANTS[::-1]
                for variant in order:
                    row = trial(variant, ranks, kill_at, tmp, reference)
                    rows.setdefault((ranks, variant), []).append(row)
                    print(f"ranks {ranks} {variant:6} kill after step {kill_at}: {row}", flush=True)
    print(
        "\nranks  variant  resumed from / killed after  steps lost  s lost  step s"
        "  start to first step: fresh  after the kill  extra  exact"
    )
    for (ranks, variant), runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("lost", "lost_s", "step_s")}
        fresh = statistics.median(r["fresh"] for r in runs)
        again = statistics.median(r["again"] for r in runs)
        pairs = ", ".join(f"{r['resumed']}/{r['killed_after']}" for r in runs)
        exact = sum(r["exact"] for r in runs)
        ram = sum(r["from_ram"] for r in runs)
        print(
            f"{ranks:5}  {variant:7}  {pairs:27}  {med['lost']:10.1f}  {med['lost_s']:6.1f}"
            f"  {med['step_s']:6.3f}  {fresh:26.1f}  {again:14.1f}  {again - fresh:5.1f}"
            f"  {exact}/{len(runs)}"
            + (f" (from RAM: {ram}/{len(runs)})" if variant == "ram" else "")
        )
    print(
        f"\n{STEPS} steps, save_steps {SAVE_STEPS}, model {' '.join(MODEL)}"
        f" {opts.strategy or 'ddp'}; kill steps {kills}"
        f" (the same for both variants); medians of {opts.trials} trials; extra = the rerun's"
        " start to first step minus the fresh run's (the goal: <= 5 s)"
    )


if __name__ == "__main__":
    main()
