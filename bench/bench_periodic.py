"""Periodic saves: async (JITCKPT_ASYNC_SAVE=1) vs the Trainer's own synchronous save.

Same script (tests/integration/children/train_hf.py), same model, same machine, under
jitckpt-entrypoint + torchrun on CPU, for 2 ranks and for 1 rank (a spare core for the
background writer). Per model, rank count and save_steps it measures:

- blocking: seconds the training thread is held per periodic save (sync: the whole save, begin
  to commit; async: the save call plus any wait for the snapshot before the next optimizer
  step), from the hook's "committed" log lines;
- the wall-time cost of periodic saves, per save: the seconds the steps that overlap a save
  (sync: the step it runs in; async: the steps its background write spans) took beyond the
  median of the nearest steps that overlap none. It is measured inside each run because the
  VM's speed drifts by 20-30 % between runs (and within one), more than a save costs; the
  across-run figure (wall time from step 10 to the end minus that of the same trial's run
  without saves, per save) is printed beside it. Each trial runs every mode, in an order
  rotated from trial to trial. Also steps/s with and without saves;
- peak host memory: the largest RSS sum of the training processes (sampled every 20 ms);
- SIGTERM -> committed JIT checkpoint with async saves on, SIGTERM right after a periodic save
  started (a background write in flight), against the floor: checkpoint bytes / disk write
  bandwidth (the faster of buffered + fsync and O_DIRECT + fsync) + one optimizer step.

    .venv/bin/python bench/bench_periodic.py [TRIALS] [--big] [--spare-core]   # default 3; medians

`--big` measures the ~120M model instead of the 18M one (a trial takes ~15 min on 2 cores);
`--spare-core` only the 1-rank runs.
"""

from __future__ import annotations

import json
import math
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_jit import direct_bandwidth, write_bandwidth
from harness.procs import Proc, clean_env
from harness.training import TRAIN_HF, entrypoint, torchrun

MODELS = {
    "18M params": (["--hidden", "512", "--layers", "4", "--vocab", "8192"], 90),
    "~120M params": (["--hidden", "768", "--layers", "12", "--vocab", "32000"], 45),
}
NO_SAVES = "100000"
SAVE_STEPS = ("5", "20")
FIRST_TIMED = 10
COMMITTED = re.compile(r"committed checkpoint-(\d+) \(periodic, [\d.]+ MB, ([\d.]+) s(.*)\)")
BLOCKED = re.compile(r"training blocked ([\d.]+) s")


class TreeSampler:
    """Samples every process under `pid` on a thread (`sample`, then `sampled` per round)
    until `stop`."""

    def __init__(self, pid: int, every: float = 0.02) -> None:
        self._root = psutil.Process(pid)
        self._every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self, proc: psutil.Process) -> None:
        """One process of the tree (psutil.Error: it is gone; skipped)."""

    def sampled(self) -> None:
        """A round over the tree is done."""

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                children = self._root.children(recursive=True)
            except psutil.Error:
                return
            for proc in children:
                try:
                    self.sample(proc)
                except psutil.Error:
                    continue
            self.sampled()
            time.sleep(self._every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class PeakRss(TreeSampler):
    """The largest RSS sum of a process tree's python processes."""

    def __init__(self, pid: int) -> None:
        self.peak, self._total = 0, 0
        super().__init__(pid)

    def sample(self, proc: psutil.Process) -> None:
        if "python" in proc.name():
            self._total += proc.memory_info().rss

    def sampled(self) -> None:
        self.peak, self._total = max(self.peak, self._total), 0

    def stop(self) -> int:  # type: ignore[override]
        super().stop()
        return self.peak


def step_times(proc: Proc) -> dict[int, float]:
    out = {}
    for t, line in proc.stamped:
        if line.startswith("step ") and line.endswith("rank=0"):
            out[int(line.split()[1])] = t
    return out


def train(model: list[str], steps: int, save_steps: str, mode: str, nproc: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-periodic-") as tmp:
        jdir = Path(tmp) / "jitckpt"
        jdir.mkdir()
        env = {
            **clean_env(checkout=True),
            "JITCKPT_DIR": str(jdir),
            "JITCKPT_TERMINATION_LOG": "",
            "JITCKPT_ASYNC_SAVE": "1" if mode == "async" else "0",
            "JITCKPT_SAVE_TOTAL_LIMIT": "2",
        }
        args = ("--max-steps", str(steps), "--save-steps", save_steps, "--logging-steps", "1000")
        proc = Proc(entrypoint(torchrun(TRAIN_HF, *args, *model, nproc=nproc)), env=env)
        rss = PeakRss(proc.pid)
        try:
            code = proc.wait(timeout=1800)
        finally:
            peak = rss.stop()
            proc.kill_tree()
        if code != 0:
            raise SystemExit(f"training failed ({code}):\n{proc.output()[-3000:]}")
    times = step_times(proc)
    blocking, writes = [], []
    for t, line in proc.stamped_err:
        found = COMMITTED.search(line)
        if found:
            blocked = BLOCKED.search(found.group(3))
            blocking.append(float(blocked.group(1)) if blocked else float(found.group(2)))
            writes.append((t - float(found.group(2)), t))  # the save, begin to commit
    last = max(times)
    gaps = [times[s + 1] - times[s] for s in range(FIRST_TIMED, last) if s + 1 in times]
    return {
        "wall": times[last] - times[FIRST_TIMED],
        "steps": last - FIRST_TIMED,
        "step": statistics.median(gaps),
        "blocking": statistics.median(blocking) if blocking else 0.0,
        "saves": len(blocking),
        "excess": save_excess(times, writes),
        "null": save_excess(
            times, [(times[s], times[s + 3]) for s in range(FIRST_TIMED, last - 3, 5)]
        )
        / len(range(FIRST_TIMED, last - 3, 5)),
        "peak": peak,
    }


def sigterm_during_write(model: list[str], nproc: int, save_steps: int = 5) -> dict:
    """Async saves on; SIGTERM as the save of step 2*save_steps starts."""
    with tempfile.TemporaryDirectory(prefix="bench-periodic-") as tmp:
        jdir = Path(tmp) / "jitckpt"
        jdir.mkdir()
        env = {**clean_env(checkout=True), "JITCKPT_DIR": str(jdir), "JITCKPT_TERMINATION_LOG": ""}
        env["JITCKPT_ASYNC_SAVE"] = "1"
        args = ("--max-steps", "100000", "--save-steps", str(save_steps))
        proc = Proc(entrypoint(torchrun(TRAIN_HF, *args, *model, nproc=nproc)), env=env)
        try:
            proc.expect(rf"^step {2 * save_steps} rank=0$", timeout=600)
            t0_wall = time.time()
            proc.send(signal.SIGTERM)
            code = proc.wait(timeout=600)
        finally:
            proc.kill_tree()
        record = json.loads((jdir / "status" / "jit.json").read_text())
        man = json.loads(
            (
                jdir / "checkpoints" / record["checkpoint"] / "jitckpt-manifest.node-0.json"
            ).read_text()
        )
        nbytes = sum(f["size"] for f in man["files"])
        size = max(nbytes, 64 << 20)
        disk = max(write_bandwidth(size, jdir, durable=True), direct_bandwidth(size, jdir))
    times = step_times(proc)
    gaps = [times[s + 1] - times[s] for s in sorted(times) if s + 1 in times][3:]
    step = statistics.median(gaps)
    return {
        "commit": record["committed_at"] - t0_wall,
        "floor": nbytes / disk + step,
        "bytes": nbytes,
        "disk": disk,
        "rc": code,
    }


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def paired_cost(runs: list[dict], base: list[dict]) -> float:
    """Median over trials of (wall time - the same trial's no-save wall time) / saves."""
    return statistics.median(
        (r["wall"] - b["wall"]) / max(1, r["saves"]) for r in runs for b in [base[r["trial"]]]
    )


def save_excess(times: dict[int, float], writes: list[tuple[float, float]]) -> float:
    """Seconds the steps that overlap a save (sync: the step it runs in; async: the steps its
    background write spans) took beyond the median of the 10 nearest steps that overlap none:
    the saves' wall-time cost measured inside one run, immune to the drift between runs."""
    span = {s: (times[s - 1], times[s]) for s in times if s > FIRST_TIMED and s - 1 in times}
    hit = {s for s, (a, b) in span.items() if any(w0 < b and w1 > a for w0, w1 in writes)}
    clean = sorted(set(span) - hit)
    if not clean:
        return math.nan  # every step overlaps a save (the writer never catches up)
    total = 0.0
    for s in hit:
        near = sorted(clean, key=lambda c: abs(c - s))[:10]
        total += span[s][1] - span[s][0] - statistics.median(span[c][1] - span[c][0] for c in near)
    return total


def trial_runs(model: list[str], steps: int, nproc: int, trial: int) -> dict[str, dict]:
    """One trial: a run without periodic saves and, per save_steps, a sync and an async run,
    in an order rotated from trial to trial (drift in the machine's speed, which on a shared
    VM moves step times by 30 % within a minute, then hits every mode alike)."""
    cases = [("none", NO_SAVES, "sync")] + [
        (f"{mode} {every}", every, mode) for every in SAVE_STEPS for mode in ("sync", "async")
    ]
    shift = trial % len(cases)
    out = {}
    for name, every, mode in cases[shift:] + cases[:shift]:
        out[name] = {**train(model, steps, every, mode, nproc), "trial": trial}
    return out


def main() -> None:
    trials = int(next((a for a in sys.argv[1:] if a.isdigit()), "3"))
    label = "~120M params" if "--big" in sys.argv else "18M params"
    models = {label: MODELS[label]}
    print(
        "model          ranks save_steps  block sync s  block async s  async/sync"
        "  cost/save sync s  async s  async/sync  steps/s none  sync  async"
        "  peak MB none  sync  async"
    )
    for label, (model, steps) in models.items():
        for nproc in (1,) if "--spare-core" in sys.argv else (2, 1):
            runs = [trial_runs(model, steps, nproc, t) for t in range(trials)]
            none = [r["none"] for r in runs]
            for every in SAVE_STEPS:
                sync = [r[f"sync {every}"] for r in runs]
                asyn = [r[f"async {every}"] for r in runs]
                row = {
                    "block_sync": med(sync, "blocking"),
                    "block_async": med(asyn, "blocking"),
                    "cost_sync": paired_cost(sync, none),
                    "cost_async": paired_cost(asyn, none),
                    "excess_sync": statistics.median(
                        r["excess"] / max(1, r["saves"]) for r in sync
                    ),
                    "excess_async": statistics.median(
                        r["excess"] / max(1, r["saves"]) for r in asyn
                    ),
                    "sps_none": med(none, "steps") / med(none, "wall"),
                    "sps_sync": med(sync, "steps") / med(sync, "wall"),
                    "sps_async": med(asyn, "steps") / med(asyn, "wall"),
                    "peak_none": med(none, "peak") / 1e6,
                    "peak_sync": med(sync, "peak") / 1e6,
                    "peak_async": med(asyn, "peak") / 1e6,
                }
                ratio = row["excess_async"] / row["excess_sync"]
                print(
                    f"{label:14} {nproc:5} {every:>10} {row['block_sync']:13.3f}"
                    f" {row['block_async']:14.3f} {row['block_async'] / row['block_sync']:11.3f}"
                    f" {row['excess_sync']:17.3f} {row['excess_async']:8.3f} {ratio:11.2f}"
                    f" {row['sps_none']:13.2f} {row['sps_sync']:5.2f} {row['sps_async']:6.2f}"
                    f" {row['peak_none']:13.0f} {row['peak_sync']:5.0f} {row['peak_async']:6.0f}",
                    flush=True,
                )
                pairs = ", ".join(
                    f"{a['excess'] / max(1, a['saves']):.3f}/{s['excess'] / max(1, s['saves']):.3f}"
                    for s, a in zip(sync, asyn)
                )
                print(
                    f"    cost/save async/sync per trial: {pairs} s; across runs (wall time -"
                    f" the same trial's run without saves, per save): async {row['cost_async']:.3f}"
                    f" s, sync {row['cost_sync']:.3f} s; the same measure in the runs without"
                    f" saves, pretending a 3-step write every 5 steps (its noise):"
                    f" {statistics.median(n['null'] for n in none):.3f} s",
                    flush=True,
                )
            if nproc != 2:
                continue
            jit = [sigterm_during_write(model, 2) for _ in range(trials)]
            print(
                f"{label}: SIGTERM -> JIT commit with async saves on (2 ranks): "
                f"{med(jit, 'commit'):.3f} s, floor {med(jit, 'floor'):.3f} s "
                f"({med(jit, 'bytes') / 1e6:.1f} MB at {med(jit, 'disk') / 1e9:.2f} GB/s + one step),"
                f" ratio {med(jit, 'commit') / med(jit, 'floor'):.2f}, exit codes "
                f"{sorted({r['rc'] for r in jit})}",
                flush=True,
            )
    print(
        "\nblock = training-thread seconds per periodic save (median); cost/save = the seconds the"
        " steps overlapping a save (sync: its step; async: the steps its background write spans)"
        " took beyond the median of the 10 nearest steps overlapping none, per save;"
        f" medians of {trials} trials (each trial runs every mode, in a rotated order)"
    )


if __name__ == "__main__":
    main()
