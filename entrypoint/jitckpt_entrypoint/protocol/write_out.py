"""Periodic saves written out from RAM by another process: the files the hook (memory_tier.py)
and the entrypoint's writer (ram_writer.py) share, in `<JITCKPT_MEMORY_DIR>/write-out/`.

- `writer.json` {pid, start, run_id}: written by the writer when it starts (an earlier
  container's request and answer go then). The hook hands a save to it only while that process
  lives (the same pid and start time: a pid alone is reused) and belongs to the hook's run (the
  entrypoint's run id).
- `request.json` {id, step, started_at, run_id, fresh}: rank 0 asks for the committed snapshot of
  `step` to be written to the volume (and staged for upload). One at a time: the hook asks
  again only after the answer.
- `done.json` {id, step, ok, bytes, seconds, error}: the writer's answer to request `id`,
  written before the request is removed (and only that request), so that no request is gone
  without its answer and an answer is never taken for another request's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Optional

from jitckpt_entrypoint.protocol import atomic

DIR = "write-out"
WRITER, REQUEST, DONE = "writer.json", "request.json", "done.json"
STOPPED = "stopped by SIGTERM"
"""The error of a save the writer stopped writing out: the JIT save follows."""


@dataclasses.dataclass(frozen=True)
class Request:
    id: str
    step: int
    started_at: float
    run_id: str
    fresh: bool = False
    """Training has failed: no hook made the checkpoint's directory, and what an uncommitted
    one holds is a save cut short."""


@dataclasses.dataclass(frozen=True)
class Answer:
    id: str
    step: int
    ok: bool
    bytes: int = 0
    seconds: float = 0.0
    error: str = ""


def directory(memory_dir: str) -> str:
    return os.path.join(memory_dir, DIR)


def new_id() -> str:
    return os.urandom(8).hex()


def announce(memory_dir: str, run_id: str) -> None:
    """The writer, at start: it serves `run_id` from now on; what an earlier one left goes."""
    where = directory(memory_dir)
    os.makedirs(where, exist_ok=True)
    for name in (REQUEST, DONE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(where, name))
    pid = os.getpid()
    record = {"pid": pid, "start": start_time(pid), "run_id": run_id}
    atomic.write_json(os.path.join(where, WRITER), record, durable=False)


def writer(memory_dir: str, run_id: str) -> Optional[int]:
    """The pid of the live writer serving `run_id`, else None. OSError: cannot tell now (too
    many open files...): the caller must not take the writer for dead."""
    record = atomic.read_json(os.path.join(directory(memory_dir), WRITER))
    if not isinstance(record, dict) or not run_id or record.get("run_id") != run_id:
        return None
    pid, start = record.get("pid"), record.get("start")
    if not isinstance(pid, int) or pid <= 0 or not isinstance(start, int):
        return None
    if start_time(pid) != start:  # exited (None), or its pid reused
        return None
    return pid


def start_time(pid: int) -> Optional[int]:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat), or None when
    there is no such process or it has exited (a zombie not reaped yet). OSError: cannot tell
    now."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: parse after the last ')';
    # state is field 3, starttime field 22.
    try:
        fields = stat[stat.rindex(b")") + 2 :].split()
        return None if fields[0] in (b"Z", b"X") else int(fields[19])
    except (ValueError, IndexError):
        return None


def ask(memory_dir: str, request: Request) -> None:
    """Rank 0: the request (an earlier answer goes first: it answers no request now)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(memory_dir, DONE))
    atomic.write_json(_path(memory_dir, REQUEST), dataclasses.asdict(request), durable=False)


def request(memory_dir: str) -> Optional[Request]:
    """The request waiting for an answer, if any."""
    found = _parsed(Request, atomic.read_json(_path(memory_dir, REQUEST)))
    return found if isinstance(found, Request) else None


def withdraw(memory_dir: str, request_id: str) -> None:
    """Remove request `request_id`, if it is still the one waiting."""
    waiting = request(memory_dir)
    if waiting is not None and waiting.id == request_id:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_path(memory_dir, REQUEST))


def answer(memory_dir: str, done: Answer) -> None:
    """The writer: its answer, then its request goes."""
    atomic.write_json(_path(memory_dir, DONE), dataclasses.asdict(done), durable=False)
    withdraw(memory_dir, done.id)


def answered(memory_dir: str, request_id: str) -> Optional[Answer]:
    """The answer to request `request_id`, if there is one."""
    found = _parsed(Answer, atomic.read_json(_path(memory_dir, DONE)))
    return found if isinstance(found, Answer) and found.id == request_id else None


def _path(memory_dir: str, name: str) -> str:
    return os.path.join(directory(memory_dir), name)


def _parsed(cls: Any, obj: Any) -> Any:
    if not isinstance(obj, dict):
        return None
    try:
        return cls(**obj)
    except TypeError:
        return None
