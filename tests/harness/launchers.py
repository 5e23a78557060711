"""The launcher matrix: the ways users start training, each running the same tiny Trainer
script (train_hf.py), for tests/integration/test_launchers.py and bench/bench_launchers.py."""

from __future__ import annotations

import dataclasses
import shlex
import sys
from pathlib import Path

from harness.training import TRAIN_HF, torchrun

PY = sys.executable
BIN = Path(sys.executable).parent
TRAIN = [str(TRAIN_HF), "--max-steps", "3000", "--save-steps", "100000"]


@dataclasses.dataclass(frozen=True)
class Launcher:
    label: str
    command: list[str]
    ranks: int
    """Training processes (Trainer ranks) it starts."""
    elastic: bool
    """torchrun's agent runs (and forwards SIGTERM itself); the others pass nothing on."""


def accelerate(*args: str) -> list[str]:
    return [str(BIN / "accelerate"), "launch", *args]


MATRIX = [
    Launcher("python train.py", [PY, *TRAIN], 1, elastic=False),
    Launcher("torchrun --nproc-per-node 2", torchrun(TRAIN_HF, *TRAIN[1:]), 2, elastic=True),
    Launcher(
        "accelerate launch --cpu", accelerate("--cpu", "--num_processes", "1", *TRAIN), 1, False
    ),
    # accelerate's simple launcher starts one process on CPU whatever --num_processes says.
    Launcher(
        "accelerate launch --cpu --num_processes 2",
        accelerate("--cpu", "--num_processes", "2", *TRAIN),
        1,
        elastic=False,
    ),
    Launcher(
        "accelerate launch --multi_gpu --num_processes 2",
        accelerate("--multi_gpu", "--num_processes", "2", *TRAIN),
        2,
        elastic=True,
    ),
    Launcher("sh -c (no exec)", ["sh", "-c", f"{shlex.join([PY, *TRAIN])}; exit $?"], 1, False),
    Launcher(
        "python -m accelerate.commands.launch",
        [PY, "-m", "accelerate.commands.launch", "--cpu", *TRAIN],
        1,
        elastic=False,
    ),
]
BY_LABEL = {launcher.label: launcher for launcher in MATRIX}
