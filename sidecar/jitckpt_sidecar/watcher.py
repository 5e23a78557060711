"""inotify (watchdog) on staging/, status/ and checkpoints/: the handler only wakes the loop.

Events are a fast path, not the source of truth: the service rescans on start, on every wake
and periodically, because events can be missed (a sidecar restart, an overflowed inotify
queue, a filesystem without inotify). When watches cannot be set up at all (the inotify
limit), the rescan alone carries on and says so.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

from jitckpt_entrypoint.protocol import status, trainer_lock
from jitckpt_entrypoint.protocol.layout import Layout

# What changes readiness: links and manifests appearing (create, rename of an atomic write),
# staged copies going away, a file finished. Not opens/reads: our own uploads read staging/.
_EVENTS: list[type[FileSystemEvent]] = [
    FileCreatedEvent,
    DirCreatedEvent,
    FileMovedEvent,
    DirMovedEvent,
    FileDeletedEvent,
    DirDeletedEvent,
    FileClosedEvent,
]


class _StopRace(logging.Filter):
    """watchdog (6-7) logs an ERROR when its emitter wakes on one last event while the observer
    stops ("InotifyEmitter.queue_events() called when the thread is inactive"). It is harmless,
    and unfiltered it becomes the sidecar's last line, after its own summary."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()


_STOP_RACE = _StopRace()


_QUIET = (f"/{status.PROGRESS.name}", f"/.{status.PROGRESS.name}.", f"/{trainer_lock.NAME}")
"""status/progress.json is rewritten every second and read at scrape time, and status/trainer.lock
is opened and closed by every look at it (the sidecar's own, ram_rescue.py): they wake nothing."""


class _Wake(FileSystemEventHandler):
    def __init__(self, wake: Callable[[], None]) -> None:
        self.wake = wake

    def on_any_event(self, event: FileSystemEvent) -> None:
        path = event.dest_path or event.src_path
        if isinstance(path, bytes):
            path = path.decode(errors="replace")
        if path.endswith((_QUIET[0], _QUIET[2])) or _QUIET[1] in path:
            return
        self.wake()


class Watcher:
    def __init__(self, layout: Layout, wake: Callable[[], None], logger: logging.Logger) -> None:
        self.layout, self.wake, self.log = layout, wake, logger
        self._observer: Optional[BaseObserver] = None

    def start(self) -> None:
        logging.getLogger("watchdog.observers.inotify").addFilter(_STOP_RACE)  # idempotent
        handler = _Wake(self.wake)
        observer = Observer()
        try:
            observer.schedule(handler, self.layout.staging, recursive=True, event_filter=_EVENTS)
            observer.schedule(handler, self.layout.status, recursive=False, event_filter=_EVENTS)
            observer.schedule(
                handler, self.layout.checkpoints, recursive=False, event_filter=_EVENTS
            )
            observer.start()
        except OSError as exc:
            # A watch that failed partway (the inotify limit reached on the second directory)
            # leaves the emitters that did start running; stop() stops them (unschedule_all),
            # or their threads leak.
            observer.stop()
            self.log.warning(
                "cannot watch %s (%s); relying on the periodic rescan (JITCKPT_RESCAN_SECONDS)",
                self.layout.root,
                exc,
            )
            return
        self._observer = observer

    def stop(self) -> None:
        if self._observer is not None:  # its threads are daemons: no need to wait for them
            self._observer.stop()
            self._observer = None
