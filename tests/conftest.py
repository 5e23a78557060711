"""Fixtures shared by every test: a fresh JITCKPT_DIR, a clean environment, process teardown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.procs import Proc, clean_env

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
    return clean_env(jdir)


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
