"""Periodic saves written by the training processes vs by the RAM writer (issue 36, item 2).

Same script (tests/integration/children/train_hf.py), same model, 2 CPU ranks under
jitckpt-entrypoint + torchrun, `save_steps` 5, three modes per trial in a rotated order:

- none: no periodic saves (the anchor for CPU time and step time);
- trainer: async periodic saves, the training processes' background writer writes the volume
  (JITCKPT_MEMORY_DIR unset: what every release so far did);
- ram-writer: JITCKPT_MEMORY_DIR on /dev/shm; a periodic save is a snapshot in RAM (the host
  copy and the tmpfs write in the training process) that the entrypoint's RAM writer copies to
  the volume.

Per mode: the training processes' CPU seconds per save beyond `none` (user + system, sampled
every 50 ms from /proc, the last sample of each rank), the RAM writer's CPU seconds per save,
the training thread's time held per save (the median step that saved, less the median step),
the median step time and steps/s; for ram-writer, the writer's MB/s against the floor (the
disk's buffered + fsync bandwidth for the same bytes, measured in the same run).

`--loop`: the plain PyTorch loop (tests/integration/children/train_loop.py, `--width` sized
to about the same state) with `jitckpt.save(state, step)`, synchronous: `trainer` writes DCP to
the volume on the training thread, `ram-writer` writes DCP into RAM there and the RAM writer
copies it to the volume.

    .venv/bin/python bench/bench_ram_writer.py [TRIALS] [--loop]    # default 3; medians
"""

from __future__ import annotations

import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_jit import write_bandwidth
from bench_periodic import TreeSampler
from harness.procs import Proc, clean_env
from harness.training import TRAIN_HF, TRAIN_LOOP, entrypoint, torchrun

MODEL = ["--hidden", "512", "--layers", "4", "--vocab", "8192"]
LOOP_MODEL = ["--width", "1000000"]
"""18M parameters and Adam's two states: about the HF model's 214 MB."""
LOOP = "--loop" in sys.argv
STEPS, SAVE_STEPS, FIRST_TIMED = 70, 5, 10
WRITTEN = re.compile(r"committed checkpoint-\d+ from RAM \(([\d.]+) MB in ([\d.]+) s")
MODES = ("none", "trainer", "ram-writer")


class CpuSeconds(TreeSampler):
    """The last user + system seconds of every process of a tree, by role (the processes are
    gone by the end)."""

    def __init__(self, pid: int) -> None:
        self.last: dict[int, tuple[str, float]] = {}
        super().__init__(pid, every=0.05)

    def sample(self, proc: psutil.Process) -> None:
        role = _role(" ".join(proc.cmdline()))
        if role:
            times = proc.cpu_times()
            self.last[proc.pid] = (role, times.user + times.system)

    def stop(self) -> dict[str, float]:  # type: ignore[override]
        super().stop()
        out: dict[str, float] = {}
        for role, seconds in self.last.values():
            out[role] = out.get(role, 0.0) + seconds
        return out


def _role(cmd: str) -> str:
    if "jitckpt_entrypoint.ram_writer" in cmd:
        return "writer"
    if ("train_hf.py" in cmd or "train_loop.py" in cmd) and "torchrun" not in cmd:
        return "ranks"
    return ""


def train(mode: str, tmp: Path) -> dict:
    jdir, memory = tmp / "jitckpt", Path(tempfile.mkdtemp(prefix="bench-ram-", dir="/dev/shm"))
    jdir.mkdir()
    env = {**clean_env(checkout=True), "JITCKPT_DIR": str(jdir), "JITCKPT_TERMINATION_LOG": ""}
    env["JITCKPT_SAVE_TOTAL_LIMIT"] = "2"
    if mode == "ram-writer":
        env["JITCKPT_MEMORY_DIR"] = str(memory)
        env["JITCKPT_SNAPSHOT_INTERVAL"] = "100000steps"  # the periodic saves only
    every = "100000" if mode == "none" else str(SAVE_STEPS)
    if LOOP:
        args = ("--steps", str(STEPS), "--save-every", every, *LOOP_MODEL)
        command = torchrun(TRAIN_LOOP, *args, nproc=2)
    else:
        args = ("--max-steps", str(STEPS), "--save-steps", every, "--logging-steps", "1000")
        command = torchrun(TRAIN_HF, *args, *MODEL, nproc=2)
    proc = Proc(entrypoint(command), env=env)
    cpu = CpuSeconds(proc.pid)
    try:
        code = proc.wait(timeout=1800)
    finally:
        seconds = cpu.stop()
        proc.kill_tree()
        shutil.rmtree(jdir, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    if code != 0:
        raise SystemExit(f"training failed ({code}):\n{proc.output()[-3000:]}")
    times = {
        int(line.split()[1]): t
        for t, line in proc.stamped
        if line.startswith("step ") and line.endswith("rank=0")
    }
    last = max(times)
    gap = {
        s: times[s + 1] - times[s]
        for s in range(FIRST_TIMED, last)
        if s in times and s + 1 in times
    }
    gaps = list(gap.values())
    saving = [g for s, g in gap.items() if s % SAVE_STEPS == 0]
    written = [WRITTEN.search(line) for line in proc.stderr]
    rates = [float(w.group(1)) / float(w.group(2)) for w in written if w]
    if mode == "ram-writer" and not rates:
        raise SystemExit(f"the RAM writer wrote nothing:\n{proc.output()[-3000:]}")
    saves = 0 if mode == "none" else STEPS // SAVE_STEPS - 1  # the last step's save is final
    return {
        "ranks": seconds.get("ranks", 0.0),
        "writer": seconds.get("writer", 0.0),
        "step": statistics.median(gaps),
        "held": statistics.median(saving) - statistics.median(gaps)
        if saving and mode != "none"
        else 0.0,
        "sps": (last - FIRST_TIMED) / (times[last] - times[FIRST_TIMED]),
        "saves": saves,
        "mbps": statistics.median(rates) if rates else 0.0,
        "mb": max((float(w.group(1)) for w in written if w), default=0.0),
    }


def main() -> None:
    trials = int(next((a for a in sys.argv[1:] if a.isdigit()), "3"))
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-ram-writer-") as name:
        tmp = Path(name)
        for trial in range(trials):
            order = MODES[trial % 3 :] + MODES[: trial % 3]
            for mode in order:
                runs[mode].append(train(mode, tmp))
        mb = max(r["mb"] for r in runs["ram-writer"])
        floor = write_bandwidth(int(mb * 1e6), tmp, durable=True) / 1e6
    none = runs["none"]
    print(
        "mode         training CPU s/save  writer CPU s/save  held s/save  step s  steps/s  vs none"
        "  writer MB/s  floor MB/s  vs floor"
    )
    for mode in MODES:
        rows = runs[mode]
        extra = [(r["ranks"] - n["ranks"]) / r["saves"] for r, n in zip(rows, none) if r["saves"]]
        writer = [r["writer"] / r["saves"] for r in rows if r["saves"]]
        sps = statistics.median(r["sps"] for r in rows)
        mbps = statistics.median(r["mbps"] for r in rows)
        print(
            f"{mode:12} {statistics.median(extra) if extra else 0.0:19.3f}"
            f" {statistics.median(writer) if writer else 0.0:18.3f}"
            f" {statistics.median(r['held'] for r in rows):12.3f}"
            f" {statistics.median(r['step'] for r in rows):7.3f} {sps:8.2f}"
            f" {sps / statistics.median(n['sps'] for n in none):8.2f}"
            + (f" {mbps:12.0f} {floor:11.0f} {mbps / floor:9.2f}" if mbps else ""),
            flush=True,
        )
    print(
        f"\n{'plain loop, ' if LOOP else ''}{mb:.0f} MB per checkpoint, 2 ranks,"
        f" save every {SAVE_STEPS} steps, {STEPS} steps;"
        f" medians of {trials} trials (modes in a rotated order); training CPU = both ranks'"
        " user + system seconds beyond the same trial's run without saves, per save; floor ="
        " the disk's buffered write + fsync bandwidth for the same bytes"
    )


if __name__ == "__main__":
    main()
