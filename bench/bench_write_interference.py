"""The floor under an async save's wall-time cost: what writing a checkpoint on a spare core
costs the training thread at all, whoever writes it.

One process, one training thread (bench_periodic.py's 18M-parameter Llama and batch, from
tests/integration/children/train_hf.py, AdamW, one CPU thread) and,
every SAVE_EVERY steps, a background thread that writes the model's and optimizer's bytes to
disk while training goes on. What the background thread does per save:

- `raw`: the same number of bytes with O_DIRECT from one ready, page-aligned buffer, then
  fsync: no copy, no serializer, no Python between the writes (the floor of any writer);
- `jitckpt`: jitckpt's own background save of this state: the host snapshot (snapshot.py),
  then model.safetensors (safetensors_save) and optimizer.pt (torch_save), one after another
  on one thread, and fsync (what an async periodic save does after its training-thread part);
- `sync`, for the ratio's denominator: the same jitckpt writes on the training thread itself,
  from the live tensors (a synchronous save).

Cost per save: the seconds the steps that overlap a write took beyond the median of the 10
nearest steps that overlap none (as bench_periodic.py measures it). Trials alternate the modes.

    .venv/bin/python bench/bench_write_interference.py [TRIALS]   # default 3; medians
"""

from __future__ import annotations

import functools
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoint"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration" / "children"))

from train_hf import SEQ_LEN, tiny_llama

from jitckpt_entrypoint.hook import safetensors_save, torch_save
from jitckpt_entrypoint.hook.snapshot import Stager, Staging
from jitckpt_entrypoint.protocol.durable import sync_tree

STEPS = 90
VOCAB = 8192
SAVE_EVERY = 5
FIRST_TIMED = 10


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """bench_periodic.py's 18M model and one rank's batch (train_hf.py: 4 samples)."""
    model = tiny_llama(VOCAB, 512, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    return model, optimizer, torch.randint(0, VOCAB, (4, SEQ_LEN))


def state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def write_jitckpt(tree: dict, directory: Path) -> None:
    directory.mkdir()
    model = {k: v.contiguous() for k, v in tree["model"].items()}
    safetensors_save.save_file(model, str(directory / "model.safetensors"), None, 1)
    torch_save.save(tree["optimizer"], str(directory / "optimizer.pt"), 1)
    sync_tree(str(directory))


def copy_and_write(staged: Staging, host: dict, directory: Path) -> None:
    staged.run()
    write_jitckpt(host, directory)


def write_raw(buf: mmap.mmap, nbytes: int, directory: Path) -> None:
    directory.mkdir()
    fd = os.open(directory / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    try:
        for offset in range(0, nbytes - len(buf) + 1, len(buf)):
            os.pwrite(fd, buf, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def run(mode: str, root: Path, nbytes: int) -> float:
    model, optimizer, batch = build()
    stager = Stager()
    buf = mmap.mmap(-1, 8 << 20)
    buf.write(os.urandom(len(buf)))
    times: dict[int, float] = {}
    writes: list[tuple[float, float]] = []
    pending: list[threading.Thread] = []

    def background(work: Callable[[], None]) -> None:
        start = time.monotonic()
        work()
        writes.append((start, time.monotonic()))

    torch.set_num_threads(1)
    staged = None
    times[0] = time.monotonic()
    for step in range(1, STEPS + 1):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        if staged is not None:
            staged.before_update()  # the snapshot is complete before the update
        optimizer.step()
        optimizer.zero_grad()
        times[step] = time.monotonic()
        if step % SAVE_EVERY or step < FIRST_TIMED:
            continue
        for thread in pending:
            thread.join()  # one save in flight
        pending.clear()
        target = root / f"{mode}-{step}"
        if mode == "sync":
            start = time.monotonic()
            write_jitckpt(state(model, optimizer), target)
            writes.append((start, time.monotonic()))
            continue
        if mode == "jitckpt":
            host, staged = stager.plan(state(model, optimizer))
            staged.start()
            work = functools.partial(copy_and_write, staged, host, target)
        else:
            work = functools.partial(write_raw, buf, nbytes, target)
        thread = threading.Thread(target=background, args=(work,))
        thread.start()
        pending.append(thread)
    for thread in pending:
        thread.join()
    return excess(times, writes) / len(writes)


def excess(times: dict[int, float], writes: list[tuple[float, float]]) -> float:
    """Seconds the steps overlapping a write took beyond the median of the 10 nearest steps
    that overlap none."""
    span = {s: (times[s - 1], times[s]) for s in times if s > FIRST_TIMED}
    hit = {s for s, (a, b) in span.items() if any(w0 < b and w1 > a for w0, w1 in writes)}
    clean = sorted(set(span) - hit)
    total = 0.0
    for s in hit:
        near = sorted(clean, key=lambda c: abs(c - s))[:10]
        total += span[s][1] - span[s][0] - statistics.median(span[c][1] - span[c][0] for c in near)
    return total


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    model, optimizer, batch = build()
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    with tempfile.TemporaryDirectory(prefix="bench-interference-") as tmp:
        write_jitckpt(state(model, optimizer), Path(tmp, "size"))
        nbytes = sum(p.stat().st_size for p in Path(tmp, "size").iterdir())
    results: dict[str, list[float]] = {"sync": [], "jitckpt": [], "raw": []}
    modes = list(results)
    for trial in range(trials):
        for mode in modes[trial % 3 :] + modes[: trial % 3]:
            with tempfile.TemporaryDirectory(prefix="bench-interference-") as tmp:
                results[mode].append(run(mode, Path(tmp), nbytes))
        print(
            f"  trial {trial + 1}: cost per save "
            + ", ".join(f"{m} {results[m][-1]:.3f} s" for m in modes),
            flush=True,
        )
    med = {m: statistics.median(v) for m, v in results.items()}
    print(f"\n{nbytes / 1e6:.0f} MB per save, a save every {SAVE_EVERY} steps, medians of {trials}")
    print("writer on the spare core          cost per save s   / sync save")
    print(f"sync (the training thread writes)  {med['sync']:15.3f}   {1.0:10.2f}")
    print(
        f"jitckpt background save            {med['jitckpt']:15.3f}   {med['jitckpt'] / med['sync']:10.2f}"
    )
    print(
        f"raw O_DIRECT + fsync (the floor)   {med['raw']:15.3f}   {med['raw'] / med['sync']:10.2f}"
    )


if __name__ == "__main__":
    main()
