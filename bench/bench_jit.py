"""SIGTERM -> committed JIT checkpoint and SIGTERM -> exit: jitckpt vs HF's enable_jit_checkpoint.

Same script (tests/integration/children/train_hf.py), same model, same machine, alternating runs
under `torchrun --standalone --nproc-per-node 2` on CPU. jitckpt runs under jitckpt-entrypoint
(the hook), HF runs under plain torchrun with enable_jit_checkpoint=True. For each model size it
also measures the floor: checkpoint bytes / disk write bandwidth (buffered writes into the same
directory, as torch.save and safetensors write) plus one optimizer step.

    .venv/bin/python bench/bench_jit.py [TRIALS]        # default 5; medians are reported
    .venv/bin/python bench/bench_jit.py [TRIALS] --cuda # one rank on the GPU (make test-gpu)

With --cuda the model trains on the GPU (one rank) and a ~270M-parameter model (3.2 GB of
checkpoint) is added: the JIT save streams the GPU state through page-locked buffers
(hook/direct_write.py), HF's moves it to the host with torch.save and safetensors.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness.procs import Proc, clean_env
from harness.training import TRAIN_HF, entrypoint, torchrun

MODELS = {
    "tiny (test model)": ["--hidden", "32", "--layers", "2", "--vocab", "128"],
    "18M params": ["--hidden", "512", "--layers", "4", "--vocab", "8192"],
}
GPU_MODELS = {
    **MODELS,
    "270M params": ["--hidden", "1024", "--layers", "16", "--vocab", "32000"],
}
WARM_STEP = 15
CUDA = "--cuda" in sys.argv[1:]
"""One rank on the GPU instead of two CPU ranks."""


def launch(*args: str) -> list[str]:
    if CUDA:
        return torchrun(TRAIN_HF, *args, "--cuda", nproc=1)
    return torchrun(TRAIN_HF, *args)


def step_seconds(proc: Proc, until: float) -> float:
    times = [
        t
        for t, line in proc.stamped
        if line.startswith("step ") and line.endswith("rank=0") and t < until
    ]
    gaps = [b - a for a, b in zip(times[3:], times[4:])]
    return statistics.median(gaps)


def wait_step(proc: Proc, step: int) -> None:
    proc.expect(rf"^step {step} rank=0$", timeout=300)


def run_ours(model: list[str], root: Path) -> dict[str, float]:
    jdir = root / "jitckpt"
    jdir.mkdir()
    env = clean_env(jdir, checkout=True)
    proc = Proc(
        entrypoint(launch("--max-steps", "100000", "--save-steps", "100000", *model)),
        env=env,
    )
    try:
        wait_step(proc, WARM_STEP)
        t0_wall, t0 = time.time(), time.monotonic()
        proc.send(signal.SIGTERM)
        code = proc.wait(timeout=300)
        exited = time.monotonic() - t0
    finally:
        proc.kill_tree()
    record = json.loads((jdir / "status" / "jit.json").read_text())
    man = json.loads(
        (jdir / "checkpoints" / record["checkpoint"] / "jitckpt-manifest.node-0.json").read_text()
    )
    after = [
        t
        for t, line in proc.stamped
        if line.startswith("step ") and line.endswith("rank=0") and t > t0
    ]
    return {
        "commit": record["committed_at"] - t0_wall,
        "agreed": (after[-1] - t0) if after else 0.0,
        "steps_after": len(after),
        "exit": exited,
        "rc": code,
        "bytes": sum(f["size"] for f in man["files"]),
        "step": step_seconds(proc, t0),
        "save": record["save_seconds"],
    }


def run_hf(model: list[str], root: Path) -> dict[str, float]:
    out = root / "hf-out"
    command = launch(
        "--max-steps",
        "100000",
        "--save-steps",
        "100000",
        "--hf-jit",
        "--output-dir",
        str(out),
        *model,
    )
    proc = Proc(command, env=clean_env(checkout=True))
    committed: list[float] = []
    stop = threading.Event()

    def watch() -> None:  # HF marks a JIT checkpoint complete by deleting its sentinel file
        while not stop.is_set():
            for ckpt in out.glob("checkpoint-*"):
                if (ckpt / "trainer_state.json").exists() and not (
                    ckpt / "checkpoint-is-incomplete.txt"
                ).exists():
                    committed.append(time.monotonic())
                    return
            time.sleep(0.002)

    try:
        wait_step(proc, WARM_STEP)
        t0 = time.monotonic()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        proc.send(signal.SIGTERM)
        code = proc.wait(timeout=300)
        exited = time.monotonic() - t0
        watcher.join(timeout=2)
    finally:
        stop.set()
        proc.kill_tree()
    return {"commit": committed[0] - t0 if committed else float("nan"), "exit": exited, "rc": code}


def write_bandwidth(
    nbytes: int, directory: Path, durable: bool, fresh: bool = False, reps: int = 5
) -> float:
    """Bytes/s writing `nbytes` into `directory`: to the disk (fsync) or to the page cache.

    `fresh`: every file is kept until all are written, so each write takes page-cache pages
    never used before, as a checkpoint written after hours of training does. On a VM that hands
    freed guest memory back to its host (free page reporting) that is far slower than reusing
    pages just freed, which is what deleting each file before the next measures.
    """
    block = os.urandom(1 << 20)
    rates, paths = [], []
    for i in range(reps):
        path = directory / f"bw-{i}.bin"
        paths.append(path)
        start = time.perf_counter()
        with open(path, "wb") as f:
            left = nbytes
            while left > 0:
                f.write(block[: min(left, len(block))])
                left -= len(block)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        rates.append(nbytes / (time.perf_counter() - start))
        if not fresh:
            path.unlink()
    for path in paths:
        path.unlink(missing_ok=True)
    return statistics.median(rates)


def direct_bandwidth(nbytes: int, directory: Path, reps: int = 5) -> float:
    """Bytes/s writing `nbytes` with O_DIRECT in 8 MiB writes from one aligned buffer, fsync
    included: the disk without the page cache (0 where the file system refuses O_DIRECT)."""
    import mmap

    buf = mmap.mmap(-1, 8 << 20)
    buf.write(os.urandom(len(buf)))
    rates = []
    for i in range(reps):
        path = directory / f"direct-{i}.bin"
        start = time.perf_counter()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        except OSError:
            return 0.0
        try:
            for offset in range(0, nbytes - nbytes % len(buf), len(buf)):
                os.pwrite(fd, buf, offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        rates.append((nbytes - nbytes % len(buf)) / (time.perf_counter() - start))
        path.unlink()
    return statistics.median(rates)


def trial_floor(run: dict[str, float], directory: Path) -> float:
    """This trial's floor, the disk measured right after it (its speed drifts by 2x within
    minutes on a shared VM): bytes / the faster of buffered + fsync and O_DIRECT + fsync
    (3 writes each, median) + one optimizer step."""
    size = max(int(run["bytes"]), 64 << 20)
    disk = max(
        write_bandwidth(size, directory, durable=True, reps=3),
        direct_bandwidth(size, directory, reps=3),
    )
    return run["bytes"] / disk + run["step"]


def _median_seen(values: list[float]) -> float:
    """The median over the trials where it happened (nan: a JIT checkpoint never appeared)."""
    seen = [v for v in values if not math.isnan(v)]
    return statistics.median(seen) if seen else float("nan")


def summarize(label: str, ours: list[dict[str, float]], hf: list[dict[str, float]]) -> dict:
    med = {
        k: statistics.median(r[k] for r in ours)
        for k in ("commit", "exit", "bytes", "step", "save")
    }
    size = max(int(med["bytes"]), 64 << 20)
    with tempfile.TemporaryDirectory(prefix="bench-bw-") as tmp:
        disk = write_bandwidth(size, Path(tmp), durable=True)
        cache = write_bandwidth(size, Path(tmp), durable=False)
        fresh = write_bandwidth(size, Path(tmp), durable=True, fresh=True)
        direct = direct_bandwidth(size, Path(tmp))
    best = max(disk, direct)
    return {
        "label": label,
        **med,
        "hf_commit": _median_seen([r["commit"] for r in hf]),
        "hf_committed": sum(not math.isnan(r["commit"]) for r in hf),
        "hf_exit": statistics.median(r["exit"] for r in hf),
        "disk": disk,
        "cache": cache,
        "fresh": fresh,
        "direct": direct,
        "floor": med["bytes"] / best + med["step"],
        "paired": statistics.median(r["commit"] / r["floor"] for r in ours),
        "floor_fresh": med["bytes"] / fresh + med["step"],
        "rc": (ours[0]["rc"], hf[0]["rc"]),
    }


COLUMNS = [
    ("model", "{label:18}", 18),
    ("ckpt MB", "{mb:9.1f}", 9),
    ("step ms", "{step_ms:9.1f}", 9),
    ("floor s", "{floor:9.3f}", 9),
    ("commit s", "{commit:10.3f}", 10),
    ("HF", "{hf_commit:8.3f}", 8),
    ("HF/ours", "{commit_x:9.1f}", 9),
    ("exit s", "{exit:8.3f}", 8),
    ("HF", "{hf_exit:8.3f}", 8),
    ("HF/ours", "{exit_x:9.1f}", 9),
    ("ours/floor", "{vs_floor:12.2f}", 12),
    ("paired", "{paired:8.2f}", 8),
    ("fresh floor", "{floor_fresh:13.3f}", 13),
    ("ours/fresh", "{vs_fresh:12.2f}", 12),
]


def main() -> None:
    numbers = [a for a in sys.argv[1:] if a.isdigit()]
    trials = int(numbers[0]) if numbers else 5
    rows = []
    for label, model in (GPU_MODELS if CUDA else MODELS).items():
        ours, hf = [], []
        for i in range(trials):
            with tempfile.TemporaryDirectory(prefix="bench-jit-") as tmp:
                ours.append(run_ours(model, Path(tmp)))
                ours[-1]["floor"] = trial_floor(ours[-1], Path(tmp))
            with tempfile.TemporaryDirectory(prefix="bench-jit-") as tmp:
                hf.append(run_hf(model, Path(tmp)))
            print(
                f"  {label} #{i + 1}: ours commit {ours[-1]['commit']:.3f} s"
                f" (floor {ours[-1]['floor']:.3f} s; stop step ended"
                f" {ours[-1]['agreed']:.3f} s after SIGTERM, {ours[-1]['steps_after']} steps;"
                f" save {ours[-1]['save']:.3f} s), exit {ours[-1]['exit']:.3f} s"
                f" | HF commit {hf[-1]['commit']:.3f} s, exit {hf[-1]['exit']:.3f} s",
                flush=True,
            )
        rows.append(summarize(label, ours, hf))

    where = "1 rank on the GPU" if CUDA else "2 CPU ranks (gloo)"
    print(f"\nSIGTERM -> JIT checkpoint, {where}, median of {trials} alternating trials")
    print(
        "".join(
            f"{name:>{width}}" if i else f"{name:{width}}"
            for i, (name, _, width) in enumerate(COLUMNS)
        )
    )
    for row in rows:
        values = {
            **row,
            "mb": row["bytes"] / 1e6,
            "step_ms": row["step"] * 1e3,
            "commit_x": row["hf_commit"] / row["commit"],
            "exit_x": row["hf_exit"] / row["exit"],
            "vs_floor": row["commit"] / row["floor"],
            "vs_fresh": row["commit"] / row["floor_fresh"],
        }
        print("".join(fmt.format(**values) for _, fmt, _ in COLUMNS))
    print(
        "\nfloor = checkpoint bytes / disk write bandwidth (the faster of buffered writes + fsync"
        "\nand O_DIRECT writes + fsync) + one median optimizer step, the disk measured after all"
        "\ntrials; paired: the median of each trial's commit / its own floor, the disk measured"
        "\nright after that trial;"
        "\nfresh floor: the same with the bandwidth of writes into page-cache pages never used before"
    )
    for row in rows:
        print(
            f"  {row['label']}: disk {row['disk'] / 1e9:.2f} GB/s (O_DIRECT {row['direct'] / 1e9:.2f},"
            f" page cache {row['cache'] / 1e9:.2f},"
            f" fresh pages + fsync {row['fresh'] / 1e9:.2f}),"
            f" jitckpt's save (begin to commit) {row['save']:.3f} s ({row['bytes'] / row['save'] / 1e9:.2f} GB/s),"
            f" exit codes ours/HF {row['rc']},"
            f" HF's JIT checkpoint appeared in {row['hf_committed']} of {trials} trials"
        )


if __name__ == "__main__":
    main()
