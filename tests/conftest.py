"""Fixtures shared by every test: a fresh JITCKPT_DIR, a clean environment, process teardown."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.procs import Proc

pytest_plugins = ("harness.s3",)  # moto_server and s3_bucket: a real S3 server on loopback


@pytest.fixture
def jdir(tmp_path: Path) -> Path:
    """A fresh shared-volume root (the emptyDir)."""
    path = tmp_path / "jitckpt"
    path.mkdir()
    return path


@pytest.fixture
def base_env(jdir: Path) -> dict[str, str]:
    """The environment for processes under test: no JITCKPT_* leaking in from outside."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JITCKPT_", "TORCH_ELASTIC_"))}
    env.update(
        JITCKPT_DIR=str(jdir),
        JITCKPT_TERMINATION_LOG=str(jdir / "termination-log"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    env.pop("PYTHONPATH", None)
    return env


@pytest.fixture
def spawn() -> Iterator[type[Proc]]:
    """Start processes with `spawn(argv, env=...)`; every tree is killed at teardown."""
    started: list[Proc] = []

    def start(*args: object, **kwargs: object) -> Proc:
        proc = Proc(*args, **kwargs)  # type: ignore[arg-type]
        started.append(proc)
        return proc

    yield start  # type: ignore[misc]
    for proc in started:
        proc.kill_tree()
