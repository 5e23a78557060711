"""Commands and checks for real training runs under jitckpt-entrypoint (tests and the demo)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

from harness.procs import ENTRYPOINT, Proc, descendants, wait_for

CHILDREN = Path(__file__).resolve().parents[1] / "integration" / "children"
TRAIN_HF = CHILDREN / "train_hf.py"
TRAIN_LOOP = CHILDREN / "train_loop.py"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
DEEPSPEED = str(Path(sys.executable).parent.parent / "deepspeed")
"""DeepSpeed, apart from the venv's site-packages (make: pip install --target .venv/deepspeed):
accelerate imports it in every training process that can find it. Put it on PYTHONPATH for the
ZeRO runs only (`strategy_env`)."""
TORCH_EXTENSIONS = str(Path(sys.executable).parent.parent / "torch_extensions")
"""Where DeepSpeed's JIT-built CPU op lives: in the venv, built once (make deepspeed-ops), not
in ~/.cache, where every checkout's other source path rebuilt it."""


def strategy_env(strategy: str) -> dict[str, str]:
    """Environment a training run of `strategy` (train_hf.py --strategy) needs."""
    if not strategy.startswith("zero"):
        return {}
    return {"PYTHONPATH": DEEPSPEED, "TORCH_EXTENSIONS_DIR": TORCH_EXTENSIONS}


def torchrun(script: Path, *args: str, nproc: int = 2) -> list[str]:
    return [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", str(script), *args]


def torchrun_node(
    script: Path, *args: str, node: int, nodes: int, port: int, nproc: int = 2
) -> list[str]:
    """One node of a multi-node job: static rendezvous on 127.0.0.1:`port`."""
    return [
        TORCHRUN,
        f"--nnodes={nodes}",
        f"--node-rank={node}",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(script),
        *args,
    ]


def entrypoint(command: list[str], *options: str) -> list[str]:
    return [*ENTRYPOINT, *options, "--", *command]


def steps_seen(proc: Proc, rank: int = 0) -> list[int]:
    """Optimizer steps a rank reported as finished ('step N rank=R' lines)."""
    return [
        int(line.split()[1])
        for line in proc.stdout
        if line.startswith("step ") and line.endswith(f"rank={rank}")
    ]


def wait_for_step(proc: Proc, step: int, timeout: float = 120) -> None:
    try:
        proc.expect(rf"^step {step} rank=0$", timeout=timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- stacks\n{training_stacks(proc)}") from None


def training_stacks(proc: Proc) -> str:
    """For a run that does not get on: the Python stacks of every thread of its training
    processes and their DataLoader workers (train_hf.py's faulthandler on SIGUSR2), from
    their stderr."""
    before = len(proc.stderr)
    for pid in descendants(proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"train_hf.py") for a in argv) and not any(
            a.endswith(b"torchrun") for a in argv
        ):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR2)
    time.sleep(3)  # the dumps reach the pump
    return "\n".join(list(proc.stderr)[before:])


def jit_record(jdir: Path) -> Optional[dict[str, Any]]:
    path = jdir / "status" / "jit.json"
    return json.loads(path.read_text()) if path.exists() else None


def manifest(jdir: Path, step: int, node: int = 0) -> dict[str, Any]:
    path = jdir / "checkpoints" / f"checkpoint-{step}" / f"jitckpt-manifest.node-{node}.json"
    return json.loads(path.read_text())


def checkpoint_steps(jdir: Path) -> list[int]:
    root = jdir / "checkpoints"
    return (
        sorted(int(p.name.split("-")[1]) for p in root.glob("checkpoint-*"))
        if root.exists()
        else []
    )


def hook_lines(proc: Proc, text: str) -> list[str]:
    return [line for line in proc.stderr if "jitckpt-hook" in line and text in line]


def wait_for_sigterm_seen(proc: Proc, ranks: int = 2, timeout: float = 30) -> None:
    wait_for(
        lambda: len(hook_lines(proc, "SIGTERM received")) >= ranks,
        timeout,
        "workers to see SIGTERM",
    )
