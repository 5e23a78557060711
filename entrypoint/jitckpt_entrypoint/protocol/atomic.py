"""Crash-safe small-file writes: temp file, fsync, rename, fsync of the directory."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any


def write_bytes(path: str, data: bytes, *, durable: bool = True) -> None:
    """Replace `path` with `data` so that readers see either the old or the new content."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{unique_suffix()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk must not also leave the temp file
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(directory)


def unique_suffix() -> str:
    """pid plus random bits: processes of two pods sharing a volume (a PVC) can have one pid."""
    return f"{os.getpid()}.{os.urandom(4).hex()}"


def write_json(path: str, obj: Any, *, durable: bool = True) -> None:
    write_bytes(path, (json.dumps(obj, sort_keys=True, indent=1) + "\n").encode(), durable=durable)


def read_json(path: str) -> Any:
    """The parsed file, or None when it is missing or not (yet) valid JSON."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_temp_name(name: str) -> bool:
    """Whether `name` is one of our in-flight temp files (never part of a checkpoint)."""
    return name.startswith(".") and name.endswith(".tmp")
