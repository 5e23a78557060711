"""Steady-state cost of the hook: optimizer steps/s with and without it, alternating A/B runs.

A = plain `torchrun --standalone --nproc-per-node 2 train_hf.py` (no hook on PYTHONPATH);
B = the same under jitckpt-entrypoint (hook active: the per-step stop agreement). Both
runs skip periodic saves; throughput is measured over a window of steps that excludes start-up
and the end of training. Goal (issue 3): <= 1% slower.

    .venv/bin/python bench/bench_overhead.py [PAIRS]      # default 6 A/B pairs per model
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness.procs import Proc, clean_env
from harness.training import TRAIN_HF, entrypoint, torchrun

# model -> (args, first step of the window, last step of the window, total steps)
MODELS = {
    "tiny (test model)": (["--hidden", "32", "--layers", "2", "--vocab", "128"], 50, 450, 460),
    "18M params": (["--hidden", "512", "--layers", "4", "--vocab", "8192"], 10, 90, 95),
}


def steps_per_second(hooked: bool, args: list[str], first: int, last: int, total: int) -> float:
    """One run's throughput; a run that crashes at exit is run again (plain torchrun + HF
    sometimes aborts with "terminate called without an active exception" after training, with
    or without the hook: a gloo teardown race upstream)."""
    for _ in range(3):
        rate = _one_run(hooked, args, first, last, total)
        if rate is not None:
            return rate
    raise SystemExit("three runs in a row failed")


def _one_run(hooked: bool, args: list[str], first: int, last: int, total: int) -> Optional[float]:
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        env = clean_env(Path(tmp) if hooked else None)
        command = torchrun(TRAIN_HF, "--max-steps", str(total), "--save-steps", "100000", *args)
        if hooked:
            command = entrypoint(command)
        else:
            command += ["--output-dir", tmp]
        proc = Proc(command, env=env)
        try:
            code = proc.wait(timeout=900)
        finally:
            proc.kill_tree()
    if code != 0:
        tail = "\n".join(proc.stderr[-5:])
        print(
            f"run failed ({code}, hook {hooked}); again. Its last lines:\n{tail}", file=sys.stderr
        )
        return None
    at = {line: t for t, line in proc.stamped}
    return (last - first) / (at[f"step {last} rank=0"] - at[f"step {first} rank=0"])


def main() -> None:
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    print(f"steady-state steps/s, 2 CPU ranks (gloo), {pairs} alternating A/B pairs per model")
    print(f"{'model':20}{'without hook':>14}{'with hook':>12}{'overhead':>10}   per-pair overheads")
    for label, (args, first, last, total) in MODELS.items():
        without, with_hook = [], []
        for _ in range(pairs):
            without.append(steps_per_second(False, args, first, last, total))
            with_hook.append(steps_per_second(True, args, first, last, total))
        a, b = statistics.median(without), statistics.median(with_hook)
        per_pair = " ".join(f"{(x - y) / x * 100:+.1f}%" for x, y in zip(without, with_hook))
        print(f"{label:20}{a:14.2f}{b:12.2f}{(a - b) / a * 100:9.2f}%   {per_pair}")
    print("overhead = (without - with) / without; goal <= 1%")


if __name__ == "__main__":
    main()
