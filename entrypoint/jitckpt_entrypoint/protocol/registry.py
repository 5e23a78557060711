"""The run's process registry: how training processes make themselves known to PID 1.

Launchers differ in what they do with SIGTERM: torchrun forwards it to its workers, but
accelerate's simple launcher (also under `trl sft`), `sh -c` without `exec` and other wrappers
die of it, or ignore it, and never pass it on. So each process that starts training registers
here, and jitckpt-entrypoint sends SIGTERM to every registered process itself, whatever sits
in between, and waits for them after its direct child is gone.

`status/run-<run id>/` belongs to one jitckpt-entrypoint run (JITCKPT_RUN_ID):
- `proc-<pid>.json`: a training process while it trains (role `trainer`: registered when
  training starts, not at interpreter start, so other processes pay nothing), or a torchrun
  agent (role `torchrun`, with the worker shutdown timeout it will use);
- `owner.json`: the entrypoint that owns the directory (host, pid, start time).

A process that registers also holds `status/trainer.lock` (shared) for the rest of its life
(trainer_lock.py): the sidecar never takes a run for dead while one of its processes lives.

A process is named by its pid *and* its start time (field 22 of /proc/<pid>/stat, in clock
ticks since boot): a pid is signalled only while the process holding it started at the
registered time, so a reused pid is never signalled. Records of other runs (another container
of the pod, another pod on a shared PVC) live in other run directories and are never read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
from typing import Any, Optional

from jitckpt_entrypoint.protocol import atomic, trainer_lock, write_out

_holding: list[Optional[int]] = []
"""This process's hold on status/trainer.lock, taken when it first registers (trainer_lock.py)."""
RUN_PREFIX = "run-"
PROC_PREFIX = "proc-"
OWNER = "owner.json"
TRAINER = "trainer"
TORCHRUN = "torchrun"


def run_dir(status_dir: str, run_id: str) -> str:
    return os.path.join(status_dir, f"{RUN_PREFIX}{run_id}")


def start_time(pid: int) -> Optional[int]:
    """When `pid` started (clock ticks since boot), or None when it is gone, a zombie, or
    cannot be read now."""
    try:
        return write_out.start_time(pid)
    except OSError:
        return None


@dataclasses.dataclass(frozen=True)
class Entry:
    pid: int
    start_time: int
    role: str
    rank: Optional[int] = None
    shutdown_timeout: Optional[int] = None
    """torchrun agents: seconds between forwarding SIGTERM and SIGKILLing the workers."""

    def alive(self) -> bool:
        """Whether the registered process still runs (not a zombie, not a reused pid)."""
        return start_time(self.pid) == self.start_time

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, obj: Any) -> Optional[Entry]:
        try:
            return cls(
                pid=int(obj["pid"]),
                start_time=int(obj["start_time"]),
                role=str(obj["role"]),
                rank=None if obj.get("rank") is None else int(obj["rank"]),
                shutdown_timeout=(
                    None if obj.get("shutdown_timeout") is None else int(obj["shutdown_timeout"])
                ),
            )
        except (KeyError, TypeError, ValueError):
            return None


def register(status_dir: str, run_id: str, role: str, **fields: Any) -> Optional[str]:
    """Record this process in the run's registry; returns the record's path (None on failure:
    a missing record costs only the direct SIGTERM, never training)."""
    me = os.getpid()
    started = start_time(me)
    if started is None:  # no /proc: nothing the entrypoint could verify either
        return None
    entry = Entry(me, started, role, **fields)
    directory = run_dir(status_dir, run_id)
    path = os.path.join(directory, f"{PROC_PREFIX}{me}.json")
    try:
        os.makedirs(directory, exist_ok=True)
        atomic.write_json(path, entry.to_json(), durable=False)
    except OSError:
        return None
    if not _holding:  # for the rest of its life: the sidecar sees a trainer live while we do
        _holding.append(trainer_lock.hold(status_dir, 0.0, lambda: None))
    return path


def unregister(path: Optional[str]) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)


def entries(status_dir: str, run_id: str) -> list[Entry]:
    """Every process registered in the run, alive or not, by pid."""
    directory = run_dir(status_dir, run_id)
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    found = []
    for name in names:
        if name.startswith(PROC_PREFIX) and name.endswith(".json"):
            entry = Entry.from_json(atomic.read_json(os.path.join(directory, name)))
            if entry is not None:
                found.append(entry)
    return sorted(found, key=lambda e: e.pid)


def open_run(status_dir: str, run_id: str) -> str:
    """Create the run's directory, owned by this process (the entrypoint)."""
    directory = run_dir(status_dir, run_id)
    os.makedirs(directory, exist_ok=True)
    me = os.getpid()
    owner = {"host": socket.gethostname(), "pid": me, "start_time": start_time(me)}
    atomic.write_json(os.path.join(directory, OWNER), owner, durable=False)
    return directory


def close_run(status_dir: str, run_id: str) -> None:
    shutil.rmtree(run_dir(status_dir, run_id), ignore_errors=True)


def remove_stale(status_dir: str) -> list[str]:
    """Remove run directories that entrypoints on this host left behind (killed before their
    clean-up); those of other hosts (pods sharing a PVC) are left alone."""
    host = socket.gethostname()
    removed = []
    try:
        names = os.listdir(status_dir)
    except OSError:
        return []
    for name in names:
        if not name.startswith(RUN_PREFIX):
            continue
        owner = atomic.read_json(os.path.join(status_dir, name, OWNER))
        try:
            if owner["host"] != host or start_time(int(owner["pid"])) == owner["start_time"]:
                continue
        except (KeyError, TypeError, ValueError):
            continue
        shutil.rmtree(os.path.join(status_dir, name), ignore_errors=True)
        removed.append(name)
    return removed
