"""Status files under JITCKPT_DIR/status/: how the trainer side tells the sidecar what happened.

- `trainer.json` (entrypoint): started_at, sigterm_at, exited_at, exit_code. The sidecar drains
  until `exited_at` is set.
- `jit.json` (hook, one per node): the JIT checkpoint committed after SIGTERM in run `run_id`,
  for the sidecar; the same record in the run's own directory (`run-<run id>/jit.json`, see
  registry.py) decides whether the entrypoint exits with JITCKPT_EXIT_CODE (two pods sharing a
  PVC write the shared file at the same moment; the run's file is theirs alone).
- `run-<run id>/output.json` (hook, world rank 0): the output_dir of the Trainer whose training
  ended; after the command exits 0 the entrypoint stages what it holds as the final model.
- `save-<step>.json` (hook): one per committed save (kind, step, start/end, bytes), for metrics.

Every file is written atomically (temp file, rename); times are Unix epoch seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import time
from typing import Any, Optional

from jitckpt_entrypoint import atomic, registry

TRAINER = "trainer.json"
JIT = "jit.json"
OUTPUT = "output.json"
SAVE_PREFIX = "save-"
KEEP_SAVE_EVENTS = 100
RUN_ID_ENV = "JITCKPT_RUN_ID"


def new_run_id() -> str:
    return f"{int(time.time())}-{secrets.token_hex(4)}"


@dataclasses.dataclass(frozen=True)
class TrainerStatus:
    run_id: str
    pid: int
    command: tuple[str, ...]
    started_at: float
    sigterm_at: Optional[float] = None
    exited_at: Optional[float] = None
    exit_code: Optional[int] = None
    summary: Optional[str] = None

    def to_json(self) -> dict[str, Any]:
        obj = dataclasses.asdict(self)
        obj["command"] = list(self.command)
        obj["version"] = 1
        return obj


@dataclasses.dataclass(frozen=True)
class JitRecord:
    run_id: str
    step: int
    checkpoint: str
    committed_at: float
    sigterm_at: Optional[float]
    """When this process saw SIGTERM; None when another rank's signal stopped it."""
    save_seconds: float
    """0 when the step was already committed (a periodic save at the same step)."""

    @property
    def trigger_to_commit(self) -> Optional[float]:
        return None if self.sigterm_at is None else self.committed_at - self.sigterm_at


@dataclasses.dataclass(frozen=True)
class SaveEvent:
    kind: str
    step: int
    started_at: float
    committed_at: float
    bytes: int
    run_id: str = ""
    node: int = 0

    @property
    def seconds(self) -> float:
        return self.committed_at - self.started_at


def write_trainer(status_dir: str, status: TrainerStatus) -> None:
    atomic.write_json(os.path.join(status_dir, TRAINER), status.to_json(), durable=False)


def read_trainer(status_dir: str) -> Optional[TrainerStatus]:
    obj = atomic.read_json(os.path.join(status_dir, TRAINER))
    try:
        return TrainerStatus(
            run_id=str(obj["run_id"]),
            pid=int(obj["pid"]),
            command=tuple(obj["command"]),
            started_at=float(obj["started_at"]),
            sigterm_at=_opt_float(obj.get("sigterm_at")),
            exited_at=_opt_float(obj.get("exited_at")),
            exit_code=None if obj.get("exit_code") is None else int(obj["exit_code"]),
            summary=obj.get("summary"),
        )
    except (KeyError, TypeError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class OutputRecord:
    """Where the script's Trainer writes its model: its output_dir, when training ended."""

    run_id: str
    output_dir: str
    """Absolute."""
    step: int
    """The last optimizer step of training."""
    finished_at: float


def write_jit(status_dir: str, record: JitRecord) -> None:
    obj = dataclasses.asdict(record)
    mine = registry.run_dir(status_dir, record.run_id)
    os.makedirs(mine, exist_ok=True)
    atomic.write_json(os.path.join(mine, JIT), obj, durable=True)
    atomic.write_json(os.path.join(status_dir, JIT), obj, durable=True)


def read_jit(status_dir: str, run_id: Optional[str] = None) -> Optional[JitRecord]:
    """The shared JIT record; with `run_id`, that run's own record (None when it has none)."""
    directory = status_dir if run_id is None else registry.run_dir(status_dir, run_id)
    obj = atomic.read_json(os.path.join(directory, JIT))
    try:
        record = JitRecord(
            run_id=str(obj["run_id"]),
            step=int(obj["step"]),
            checkpoint=str(obj["checkpoint"]),
            committed_at=float(obj["committed_at"]),
            sigterm_at=_opt_float(obj.get("sigterm_at")),
            save_seconds=float(obj["save_seconds"]),
        )
    except (KeyError, TypeError, ValueError):
        return None
    if run_id is not None and record.run_id != run_id:
        return None
    return record


def write_output(status_dir: str, record: OutputRecord) -> None:
    mine = registry.run_dir(status_dir, record.run_id)
    os.makedirs(mine, exist_ok=True)
    atomic.write_json(os.path.join(mine, OUTPUT), dataclasses.asdict(record), durable=False)


def read_output(status_dir: str, run_id: str) -> Optional[OutputRecord]:
    obj = atomic.read_json(os.path.join(registry.run_dir(status_dir, run_id), OUTPUT))
    try:
        return OutputRecord(
            run_id=str(obj["run_id"]),
            output_dir=str(obj["output_dir"]),
            step=int(obj["step"]),
            finished_at=float(obj["finished_at"]),
        )
    except (KeyError, TypeError, ValueError):
        return None


def write_save_event(status_dir: str, event: SaveEvent) -> None:
    name = f"{SAVE_PREFIX}{event.step:012d}.json"
    atomic.write_json(os.path.join(status_dir, name), dataclasses.asdict(event), durable=False)
    old = sorted(n for n in os.listdir(status_dir) if _is_save_event(n))[:-KEEP_SAVE_EVENTS]
    for stale in old:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(status_dir, stale))


def read_save_event(path: str) -> Optional[SaveEvent]:
    obj = atomic.read_json(path)
    try:
        return SaveEvent(
            kind=str(obj["kind"]),
            step=int(obj["step"]),
            started_at=float(obj["started_at"]),
            committed_at=float(obj["committed_at"]),
            bytes=int(obj["bytes"]),
            run_id=str(obj.get("run_id", "")),
            node=int(obj.get("node", 0)),
        )
    except (KeyError, TypeError, ValueError):
        return None


def save_event_names(status_dir: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(status_dir) if _is_save_event(n))
    except FileNotFoundError:
        return []


def _is_save_event(name: str) -> bool:
    return name.startswith(SAVE_PREFIX) and name.endswith(".json")


def _opt_float(value: Any) -> Optional[float]:
    return None if value is None else float(value)
