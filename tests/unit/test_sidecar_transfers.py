"""transfers.Batch: what follows a finished download (verification, fsync) runs on the batch's
own threads, not on the download thread that reports it, and the wait covers it."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Optional

import pytest

from jitckpt_sidecar import transfers


class _Future:
    def __init__(self, error: Optional[BaseException] = None) -> None:
        self.error = error

    def result(self) -> None:
        if self.error is not None:
            raise self.error


def _batch() -> transfers.Batch:
    return transfers.Batch(transfers.Progress("test", 1, logging.getLogger("test")))


def test_after_and_fsync_run_off_the_reporting_thread_and_the_wait_covers_them(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`after` runs on another thread than the one that reported the transfer done, then the
    file is fsynced, and `wait` returns only after both."""
    path = tmp_path / "f"
    path.write_bytes(b"x")
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(transfers.os, "fsync", fsync)
    release = threading.Event()
    ran_on: list[int] = []

    def after(_result: Any) -> None:
        ran_on.append(threading.get_ident())
        release.wait(5)

    batch = _batch()
    sub = batch.subscriber(after=after, fsync=str(path))
    sub.on_done(_Future())  # returns at once: the verification does not hold this thread
    waiter = threading.Thread(target=batch.wait, args=(lambda: None, 0.01))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "the wait ended before `after` finished"
    release.set()
    waiter.join(5)
    assert not waiter.is_alive()
    assert len(ran_on) == 1
    assert ran_on[0] != threading.get_ident()
    assert synced == [path.stat().st_ino]


def test_an_error_of_after_is_raised_by_the_wait_and_skips_the_fsync(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verification that fails is the batch's error, and its file is not fsynced."""
    synced: list[int] = []
    monkeypatch.setattr(transfers.os, "fsync", synced.append)

    def after(_result: Any) -> None:
        raise ValueError("checksum mismatch")

    batch = _batch()
    batch.subscriber(after=after, fsync=str(tmp_path / "absent")).on_done(_Future())
    with pytest.raises(ValueError, match="checksum mismatch"):
        batch.wait(lambda: None, 0.01)
    assert synced == []


def test_a_failed_transfer_is_raised_without_running_after() -> None:
    """A transfer that failed is reported as it is; its `after` never runs."""
    ran: list[bool] = []
    batch = _batch()
    batch.subscriber(after=lambda _: ran.append(True)).on_done(_Future(OSError("reset")))
    with pytest.raises(OSError, match="reset"):
        batch.wait(lambda: None, 0.01)
    assert ran == []


def test_after_the_batch_is_closed_a_late_transfer_starts_nothing() -> None:
    """Once the job is over (cancelled, its transfers stopped, the batch closed), a late
    transfer's `after` never runs: nobody waits for it (a later restore verifies the file
    again), and no thread is started for it."""
    batch = _batch()
    late = batch.subscriber(after=lambda _: ran.append(True))
    ran: list[bool] = []
    with pytest.raises(transfers.TransferCancelledError):
        batch.wait(lambda: "newer checkpoint", 0.01)
    batch.close()
    threads = threading.active_count()
    late.on_done(_Future())
    assert ran == []
    assert threading.active_count() == threads
