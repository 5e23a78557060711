"""The cost of writing one snapshot's files into a tmpfs, per way of writing them (issue 36).

A snapshot's files are written by the training process's background thread from the staged
host copy (hook/direct_write.py). Each trial writes the same bytes (`MB`, one staged buffer, its
CRC-32 taken as torch_save takes it) as the file of snapshot N, then retires snapshot N-1 the
way each mode does, in one process, modes in a rotated order. Reported: the CPU seconds
(process time: user + system, the kernel's page allocation and zeroing included) and wall
seconds per snapshot, medians, and their ratio to the floor: one memcpy of the same bytes into
memory already faulted in (the least a copy into RAM can cost).

- fresh, O_DIRECT: a new file through direct_write's aligned buffers (tmpfs takes O_DIRECT since
  Linux 6.6), the old snapshot deleted (what every release before ram_files.py did);
- fresh, page cache: a new file written straight from the buffer, the old one deleted;
- spare, O_DIRECT: over the retired snapshot's file, through the aligned buffers;
- spare, page cache: over the retired snapshot's file, straight from the buffer (ram_files.py).

    .venv/bin/python bench/bench_ram_files.py [MB] [TRIALS]     # default 256 MB, 9 trials
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from jitckpt_entrypoint.hook import direct_write, ram_files

MODES = ("fresh, O_DIRECT", "fresh, page cache", "spare, O_DIRECT", "spare, page cache")


def main() -> None:
    args = [int(a) for a in sys.argv[1:] if a.isdigit()]
    mb, trials = (args + [256, 9][len(args) :])[:2]
    size = mb << 20
    torch.set_num_threads(1)  # the floor's memcpy on one thread, as the writer's
    source = torch.randint(0, 255, (size,), dtype=torch.uint8)
    floor_dest = torch.empty_like(source)
    floor_dest.copy_(source)  # faulted in
    root = Path(tempfile.mkdtemp(prefix="bench-ram-files-", dir="/dev/shm"))
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in ("floor", *MODES)}
    step = 0
    try:
        for trial in range(trials):
            cpu, wall = time.process_time(), time.perf_counter()
            floor_dest.copy_(source)
            results["floor"].append((time.process_time() - cpu, time.perf_counter() - wall))
            order = MODES[trial % len(MODES) :] + MODES[: trial % len(MODES)]
            for mode in order:
                mode_root = root / mode.replace(", ", "-").replace(" ", "_")
                # two snapshots first: the mode's steady state (a spare to write over)
                for _ in range(3):
                    step += 1
                    seconds = write_snapshot(mode, mode_root, step, source)
                results[mode].append(seconds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    floor_cpu = statistics.median(c for c, _ in results["floor"])
    floor_wall = statistics.median(w for _, w in results["floor"])
    print(f"{'mode':20} {'CPU s':>7} {'wall s':>7} {'CPU vs floor':>13} {'wall vs floor':>14}")
    for mode, rows in results.items():
        c = statistics.median(r[0] for r in rows)
        w = statistics.median(r[1] for r in rows)
        print(f"{mode:20} {c:7.3f} {w:7.3f} {c / floor_cpu:13.2f} {w / floor_wall:14.2f}")
    print(
        f"\n{mb} MB per snapshot, CRC-32 taken, medians of {trials} trials (modes rotated), one"
        f" thread; floor: one memcpy into memory already faulted in ({mb / floor_wall:.0f} MB/s)"
    )


def write_snapshot(mode: str, root: Path, step: int, source: torch.Tensor) -> tuple[float, float]:
    """Write snapshot `step`'s file as `mode` does, then retire the previous snapshot."""
    spare, page_cache = mode.startswith("spare"), mode.endswith("page cache")
    ram_files._roots.clear()
    ram_files.register(str(root))
    # DirectFile asks ram_files whether a file is in RAM (the page cache) and for its spare
    in_ram, take = ram_files.in_ram, ram_files.take
    ram_files.in_ram = in_ram if page_cache else (lambda _path: False)  # type: ignore[assignment]
    ram_files.take = take if spare else (lambda _path: False)  # type: ignore[assignment]
    path = root / f"checkpoint-{step}"
    try:
        cpu, wall = time.process_time(), time.perf_counter()
        path.mkdir(parents=True)
        with direct_write.DirectFile(str(path / "optimizer.pt"), source.numel()) as f:
            assert f.direct != page_cache
            f.write([(0, source)], 1, crc_of=[0])
        previous = root / f"checkpoint-{step - 1}"
        if previous.exists():
            if spare:
                ram_files.retire(str(root), str(previous))
            else:
                shutil.rmtree(previous)
        return time.process_time() - cpu, time.perf_counter() - wall
    finally:
        ram_files.in_ram, ram_files.take = in_ram, take


if __name__ == "__main__":
    main()
