"""Periodic saves: async (JITCKPT_ASYNC_SAVE=1) vs the Trainer's own synchronous save.

Same script (tests/integration/children/train_hf.py), same model, same machine, runs alternating
under jitckpt-entrypoint + torchrun on CPU, for 2 ranks and for 1 rank (a spare core for the
background writer). Per model, rank count and save_steps it measures:

- blocking: seconds the training thread is held per periodic save (sync: the whole save, begin
  to commit; async: the save call plus any wait for the snapshot before the next optimizer
  step), from the hook's "committed" log lines;
- the wall-time cost of periodic saves: the seconds from step 10 to the last step, minus those
  of a run without periodic saves, per save; and steps/s with and without saves;
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

from bench_jit import base_env, direct_bandwidth, write_bandwidth
from harness.procs import Proc
from harness.training import TRAIN_HF, entrypoint, torchrun

MODELS = {
    "18M params": (["--hidden", "512", "--layers", "4", "--vocab", "8192"], 50),
    "~120M params": (["--hidden", "768", "--layers", "12", "--vocab", "32000"], 45),
}
NO_SAVES = "100000"
FIRST_TIMED = 10
COMMITTED = re.compile(r"committed checkpoint-(\d+) \(periodic, [\d.]+ MB, ([\d.]+) s(.*)\)")
BLOCKED = re.compile(r"training blocked ([\d.]+) s")


class PeakRss:
    """The largest RSS sum of a process tree, sampled on a thread."""

    def __init__(self, pid: int) -> None:
        self.peak = 0
        self._root = psutil.Process(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            try:
                for proc in self._root.children(recursive=True):
                    try:
                        if "python" in proc.name() and proc.pid != self._root.pid:
                            total += proc.memory_info().rss
                    except psutil.Error:
                        continue
            except psutil.Error:
                return
            self.peak = max(self.peak, total)
            time.sleep(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=2)
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
            **base_env(),
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
    blocking = []
    for line in proc.stderr:
        found = COMMITTED.search(line)
        if found:
            blocked = BLOCKED.search(found.group(3))
            blocking.append(float(blocked.group(1)) if blocked else float(found.group(2)))
    last = max(times)
    gaps = [times[s + 1] - times[s] for s in range(FIRST_TIMED, last) if s + 1 in times]
    return {
        "wall": times[last] - times[FIRST_TIMED],
        "steps": last - FIRST_TIMED,
        "step": statistics.median(gaps),
        "blocking": statistics.median(blocking) if blocking else 0.0,
        "saves": len(blocking),
        "peak": peak,
    }


def sigterm_during_write(model: list[str], nproc: int, save_steps: int = 5) -> dict:
    """Async saves on; SIGTERM as the save of step 2*save_steps starts."""
    with tempfile.TemporaryDirectory(prefix="bench-periodic-") as tmp:
        jdir = Path(tmp) / "jitckpt"
        jdir.mkdir()
        env = {**base_env(), "JITCKPT_DIR": str(jdir), "JITCKPT_TERMINATION_LOG": ""}
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


def main() -> None:
    trials = int(next((a for a in sys.argv[1:] if a.isdigit()), "3"))
    label = "~120M params" if "--big" in sys.argv else "18M params"
    models = {label: MODELS[label]}
    print(
        "model          ranks save_steps  block sync s  block async s  async/sync"
        "  cost/save sync s  async s  async/sync  steps/s none  sync  async"
        "  peak MB none  sync  async"
    )
    results = []
    for label, (model, steps) in models.items():
        for nproc in (1,) if "--spare-core" in sys.argv else (2, 1):
            none = [train(model, steps, NO_SAVES, "sync", nproc) for _ in range(trials)]
            for save_steps in ("5", "20"):
                sync, asyn = [], []
                for _ in range(trials):  # alternating, so drift in load hits both
                    sync.append(train(model, steps, save_steps, "sync", nproc))
                    asyn.append(train(model, steps, save_steps, "async", nproc))
                base = med(none, "wall")
                row = {
                    "label": label,
                    "nproc": nproc,
                    "save_steps": save_steps,
                    "block_sync": med(sync, "blocking"),
                    "block_async": med(asyn, "blocking"),
                    "cost_sync": (med(sync, "wall") - base) / max(1, med(sync, "saves")),
                    "cost_async": (med(asyn, "wall") - base) / max(1, med(asyn, "saves")),
                    "sps_none": med(none, "steps") / base,
                    "sps_sync": med(sync, "steps") / med(sync, "wall"),
                    "sps_async": med(asyn, "steps") / med(asyn, "wall"),
                    "peak_none": med(none, "peak") / 1e6,
                    "peak_sync": med(sync, "peak") / 1e6,
                    "peak_async": med(asyn, "peak") / 1e6,
                }
                results.append(row)
                print(
                    f"{label:14} {nproc:5} {save_steps:>10} {row['block_sync']:13.3f}"
                    f" {row['block_async']:14.3f} {row['block_async'] / row['block_sync']:11.3f}"
                    f" {row['cost_sync']:17.3f} {row['cost_async']:8.3f}"
                    f" {row['cost_async'] / row['cost_sync'] if row['cost_sync'] > 0 else float('nan'):11.2f}"
                    f" {row['sps_none']:13.2f} {row['sps_sync']:5.2f} {row['sps_async']:6.2f}"
                    f" {row['peak_none']:13.0f} {row['peak_sync']:5.0f} {row['peak_async']:6.0f}",
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
        "\nblock = training-thread seconds per periodic save (median); cost/save = (wall time"
        " from step 10 to the end - that of a run without periodic saves) / saves;"
        f" medians of {trials} alternating trials"
    )


if __name__ == "__main__":
    main()
