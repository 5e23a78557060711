"""The launcher matrix: SIGTERM -> committed JIT checkpoint, SIGTERM -> exit, exit code, steps lost.

Every launcher in tests/harness/launchers.py (plus TRL's `trl sft` CLI on a tiny model built
here) runs the same tiny Trainer under jitckpt-entrypoint; SIGTERM goes to the entrypoint at
step 15. Ratios are against `torchrun --nproc-per-node 2` (the path that always worked) run in
the same script. Steps lost = the last step rank 0 finished minus the JIT checkpoint's step.

    .venv/bin/python bench/bench_launchers.py [TRIALS]    # default 3; medians are reported
"""

from __future__ import annotations

import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness import sft
from harness.launchers import MATRIX
from harness.procs import Proc, clean_env
from harness.training import entrypoint, jit_record, steps_seen, wait_for_step

SIGTERM_AT = 15
ANCHOR = "torchrun --nproc-per-node 2"


def one_run(
    command: list[str], wait: Callable[[Proc], None], last_step: Callable[[Proc], int]
) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-launchers-") as tmp:
        jdir = Path(tmp) / "jitckpt"
        jdir.mkdir()
        proc = Proc(entrypoint(command), env=clean_env(jdir), cwd=Path(tmp))
        try:
            wait(proc)
            sent_wall, sent = time.time(), time.monotonic()
            proc.send(signal.SIGTERM)
            code = proc.wait(timeout=300)
            exited = time.monotonic() - sent
        finally:
            proc.kill_tree()
        record = jit_record(jdir)
    if record is None:
        return {"commit": float("nan"), "exit": exited, "rc": code, "lost": float("nan")}
    return {
        "commit": record["committed_at"] - sent_wall,
        "exit": exited,
        "rc": code,
        "lost": last_step(proc) - record["step"],
    }


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    cases: dict[str, tuple[list[str], Callable[[Proc], None], Callable[[Proc], int]]] = {
        x.label: (
            x.command,
            lambda p: wait_for_step(p, SIGTERM_AT),
            lambda p: max(steps_seen(p, 0)),
        )
        for x in MATRIX
    }
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as tmp:
        model, data = sft.build(Path(tmp))
        out = Path(tmp) / "out"
        cases["trl sft (no launcher flags)"] = (
            sft.command(model, data, out, "--max_steps", "3000", "--save_steps", "100000"),
            lambda p: sft.wait_for_steps(p, SIGTERM_AT),
            sft.steps_logged,
        )
        results: dict[str, list[dict[str, float]]] = {label: [] for label in cases}
        for i in range(trials):  # interleaved: machine noise hits every launcher alike
            for label, (command, wait, last) in cases.items():
                results[label].append(one_run(command, wait, last))
                r = results[label][-1]
                print(
                    f"  #{i + 1} {label}: commit {r['commit']:.3f} s, exit {r['exit']:.3f} s, "
                    f"rc {r['rc']}, lost {r['lost']}",
                    flush=True,
                )

    def med(label: str, key: str) -> float:
        return statistics.median(r[key] for r in results[label])

    anchor_commit, anchor_exit = med(ANCHOR, "commit"), med(ANCHOR, "exit")
    print(f"\nSIGTERM at step {SIGTERM_AT}, tiny model on CPU, median of {trials} trials")
    print(
        f"{'launcher':48}{'commit s':>10}{'/torchrun':>11}{'exit s':>9}{'/torchrun':>11}"
        f"{'exit codes':>13}{'steps lost':>12}"
    )
    for label, runs in results.items():
        codes = ",".join(sorted({str(r["rc"]) for r in runs}))
        lost = max(r["lost"] for r in runs)
        print(
            f"{label:48}{med(label, 'commit'):10.3f}{med(label, 'commit') / anchor_commit:11.2f}"
            f"{med(label, 'exit'):9.3f}{med(label, 'exit') / anchor_exit:11.2f}"
            f"{codes:>13}{lost:12.0f}"
        )


if __name__ == "__main__":
    main()
