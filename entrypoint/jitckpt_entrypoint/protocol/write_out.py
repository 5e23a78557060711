"""Periodic saves written out from RAM by another process: the files the hook (memory_tier.py)
and the entrypoint's writer (ram_writer.py) share, in `<JITCKPT_MEMORY_DIR>/write-out/`.

- `writer.json` {pid, run_id}: written by the writer when it starts (an earlier container's
  request and answer go then). The hook hands a save to it only while that process lives and
  belongs to the hook's run (the entrypoint's run id): a pid alone may be reused after a
  container restart in the same pod.
- `request.json` {step, started_at, run_id}: rank 0 asks for the committed snapshot of `step`
  to be written to the volume (and staged for upload). One at a time: the hook asks again only
  after the answer.
- `done.json` {step, ok, bytes, seconds, error}: the writer's answer, written before the
  request is removed, so that no request is gone without its answer.
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
    step: int
    started_at: float
    run_id: str


@dataclasses.dataclass(frozen=True)
class Answer:
    step: int
    ok: bool
    bytes: int = 0
    seconds: float = 0.0
    error: str = ""


def directory(memory_dir: str) -> str:
    return os.path.join(memory_dir, DIR)


def announce(memory_dir: str, run_id: str) -> None:
    """The writer, at start: it serves `run_id` from now on; what an earlier one left goes."""
    where = directory(memory_dir)
    os.makedirs(where, exist_ok=True)
    for name in (REQUEST, DONE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(where, name))
    atomic.write_json(os.path.join(where, WRITER), {"pid": os.getpid(), "run_id": run_id})


def writer(memory_dir: str, run_id: str) -> Optional[int]:
    """The pid of the live writer serving `run_id`, else None."""
    record = atomic.read_json(os.path.join(directory(memory_dir), WRITER))
    if not isinstance(record, dict) or record.get("run_id") != run_id or not run_id:
        return None
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        return pid
    return pid


def ask(memory_dir: str, request: Request) -> None:
    atomic.write_json(_path(memory_dir, REQUEST), dataclasses.asdict(request), durable=False)


def request(memory_dir: str) -> Optional[Request]:
    """The request waiting for an answer, if any."""
    found = _parsed(Request, atomic.read_json(_path(memory_dir, REQUEST)))
    return found if isinstance(found, Request) else None


def answer(memory_dir: str, done: Answer) -> None:
    """The writer: its answer, then the request goes."""
    atomic.write_json(_path(memory_dir, DONE), dataclasses.asdict(done), durable=False)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(memory_dir, REQUEST))


def answered(memory_dir: str) -> Optional[Answer]:
    found = _parsed(Answer, atomic.read_json(_path(memory_dir, DONE)))
    return found if isinstance(found, Answer) else None


def _path(memory_dir: str, name: str) -> str:
    return os.path.join(directory(memory_dir), name)


def _parsed(cls: Any, obj: Any) -> Any:
    if not isinstance(obj, dict):
        return None
    try:
        return cls(**obj)
    except TypeError:
        return None
