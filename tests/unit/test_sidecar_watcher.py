"""The inotify watcher: a wake-up per change, and nothing left running when it cannot start."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from jitckpt_entrypoint.protocol import status, trainer_lock
from jitckpt_entrypoint.protocol.layout import Layout
from jitckpt_sidecar.watcher import Watcher

LOG = logging.getLogger("test")


@contextlib.contextmanager
def watching(root: Path) -> Iterator[tuple[Layout, threading.Event]]:
    """A started watcher of a fresh layout under `root`, and the event its wake() sets."""
    layout = Layout(str(root))
    layout.ensure()
    woken = threading.Event()
    watcher = Watcher(layout, woken.set, LOG)
    watcher.start()
    try:
        yield layout, woken
    finally:
        watcher.stop()


def test_a_file_in_staging_wakes_the_loop(tmp_path):
    """Creating a file under staging/ calls wake()."""
    with watching(tmp_path) as (_, woken):
        (tmp_path / "staging" / "x").write_bytes(b"1")
        assert woken.wait(10)


def test_the_trainers_progress_record_wakes_nothing_but_other_status_files_do(tmp_path):
    """progress.json is rewritten every second (read at scrape time): no wake-up for it."""
    with watching(tmp_path) as (layout, woken):
        for step in range(3):
            status.PROGRESS.write(layout.status, status.Progress("run", step, time.time()))
        assert not woken.wait(1)
        status.SAVING.write(layout.status, status.SaveStart("run", 3, time.time()))
        assert woken.wait(10)


def test_a_look_at_the_trainers_lock_wakes_nothing(tmp_path):
    """The drain looks at status/trainer.lock each time round: a look must not wake the loop
    again (it would spin for the whole drain)."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    held = trainer_lock.hold(layout.status, 0.0, lambda: None)  # a live trainer's
    assert held is not None
    with watching(tmp_path) as (_, woken):
        for _ in range(3):
            assert trainer_lock.take_if_gone(layout.status) is None
        assert not woken.wait(1)
        os.close(held)
        gone = trainer_lock.take_if_gone(layout.status)
        assert gone is not None
        os.close(gone)
        assert not woken.wait(1)


def test_a_watch_that_fails_partway_leaves_no_thread_running(tmp_path, caplog):
    """status/ missing: the watch on staging/ had started; it is stopped again, the failure is
    one warning, and the rescan carries on alone."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    os.rmdir(layout.status)
    before = set(threading.enumerate())
    watcher = Watcher(layout, lambda: None, LOG)
    with caplog.at_level(logging.WARNING):
        watcher.start()
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(threading.enumerate()) - before == set()
    assert "relying on the periodic rescan" in caplog.text
    watcher.stop()


def test_watchdogs_stop_race_is_not_logged_but_its_other_errors_are(tmp_path, caplog):
    """watchdog logs an ERROR when its emitter wakes while the observer stops; that line must
    not become the sidecar's last line (it did, after the final summary). Other watchdog
    errors still reach stderr."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    watcher = Watcher(layout, lambda: None, LOG)
    watcher.start()
    watcher.stop()
    inotify_log = logging.getLogger("watchdog.observers.inotify")
    with caplog.at_level(logging.ERROR):
        inotify_log.error("InotifyEmitter.queue_events() called when the thread is inactive")
        inotify_log.error("some other watchdog failure")
    assert [r.getMessage() for r in caplog.records] == ["some other watchdog failure"]
