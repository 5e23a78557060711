"""Bulk transfers: uploads through boto3's TransferManager (its tuning), and for uploads and
the restore's downloads (downloads.py) progress logs, waiting, cancelling.

One TransferManager per checkpoint upload: its thread pool bounds the requests in flight,
leaving the context cancels whatever is still running (s3transfer aborts the multipart uploads
it started), and a `Batch` waits for every file with a progress line every 10 s and a
cancellation check (a newer checkpoint during the drain, the drain deadline).

What runs once a download is done (the restore's checksum verification, then an fsync of the
file) runs on the Batch's own threads, not on the thread that downloads the next file. The
fsync there starts each file's writeback while the others still download, instead of all of
it at the commit's sync.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from jitckpt_sidecar.config import Config
from jitckpt_sidecar.errors import SidecarError

PROGRESS_EVERY = 10.0
MB = 1e6
AFTER_THREADS = 2
"""Threads that run what follows a download (verification, fsync): both mostly wait on the
disk or hash outside the GIL."""


class TransferCancelledError(SidecarError):
    """A transfer stopped on purpose (preempted by a newer checkpoint, or out of time)."""


def upload_config(cfg: Config) -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=cfg.multipart_chunk,
        multipart_chunksize=cfg.multipart_chunk,
        max_concurrency=cfg.upload_concurrency,
        use_threads=True,
        preferred_transfer_client="classic",
    )


def manager(client: Any, config: Any) -> Any:
    """A TransferManager (a context manager) over `client`."""
    from boto3.s3.transfer import create_transfer_manager

    return create_transfer_manager(client, config)


def rate(nbytes: float, seconds: float) -> str:
    per_second = nbytes / MB / max(seconds, 1e-6)
    return f"{per_second:.1f} MB/s" if per_second < 10 else f"{per_second:.0f} MB/s"


class Progress:
    """Bytes moved by one job; `tick` logs a progress line at most every PROGRESS_EVERY s."""

    def __init__(
        self,
        what: str,
        total: int,
        logger: logging.Logger,
        *,
        every: float = PROGRESS_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.total, self.log, self.every, self.clock = what, total, logger, every, clock
        self.started = clock()
        self._last_log = self.started
        self._moved = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._moved += nbytes

    @property
    def moved(self) -> int:
        with self._lock:
            return self._moved

    def elapsed(self) -> float:
        return self.clock() - self.started

    def tick(self) -> None:
        now = self.clock()
        if now - self._last_log < self.every:
            return
        self._last_log = now
        moved = self.moved
        pct = 100.0 * moved / self.total if self.total else 100.0
        self.log.info(
            "%s: %.0f/%.0f MB (%.0f%%), %s",
            self.what,
            moved / MB,
            self.total / MB,
            pct,
            rate(moved, now - self.started),
        )


class Batch:
    """The transfer futures of one job: wait for all, fail fast, cancel on request."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self._cond = threading.Condition()
        self._pending = 0
        self._errors: list[BaseException] = []
        self._after: Optional[ThreadPoolExecutor] = None
        self._closed = False

    def subscriber(
        self,
        after: Optional[Callable[[Any], None]] = None,
        fsync: Optional[str] = None,
        excuse: Optional[Callable[[BaseException], bool]] = None,
    ) -> _Subscriber:
        """A subscriber for one transfer; once it is done, `after(result)` runs on the Batch's
        threads (the transfer future's result: downloads.py's checksum), then the file at
        `fsync` is fsynced. A transfer that failed counts as done when `excuse(error)`, run on
        the Batch's threads, says so (a retried write that had landed)."""
        with self._cond:
            self._pending += 1
        return _Subscriber(self, after, fsync, excuse)

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self._errors.append(exc)
            self._cond.notify_all()

    def _finished(self, error: Optional[BaseException]) -> None:
        with self._cond:
            self._pending -= 1
            if error is not None:
                self._errors.append(error)
            self._cond.notify_all()

    def _then(self, job: Callable[[], None]) -> None:
        """Run `job` on the Batch's threads; it ends the transfer (`_finished`) when done."""
        with self._cond:
            if self._closed:  # the job is over (failed or cancelled): nobody waits for this
                return
            if self._after is None:
                self._after = ThreadPoolExecutor(AFTER_THREADS, thread_name_prefix="jitckpt-after")
            pool = self._after
        try:
            pool.submit(job)
        except RuntimeError:  # closed in between
            return

    def close(self) -> None:
        """After the transfers have stopped (their context left): what still runs on the
        Batch's threads finishes (it touches the files), what has not started never does."""
        with self._cond:
            pool, self._after, self._closed = self._after, None, True
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def wait(self, cancel: Callable[[], Optional[str]], poll: float = 0.2) -> None:
        """Until every transfer is done; raise the first error, or TransferCancelledError when
        `cancel` returns a reason (leaving the transfers' context cancels the rest)."""
        while True:
            with self._cond:
                if self._errors:
                    raise self._errors[0]
                if self._pending == 0:
                    return
                self._cond.wait(timeout=poll)
            self.progress.tick()
            reason = cancel()
            if reason:
                raise TransferCancelledError(reason)


class _Subscriber:
    """s3transfer (and downloads.py) call on_progress / on_done (duck-typed, like
    s3transfer's BaseSubscriber)."""

    def __init__(
        self,
        batch: Batch,
        after: Optional[Callable[[Any], None]],
        fsync: Optional[str],
        excuse: Optional[Callable[[BaseException], bool]] = None,
    ) -> None:
        self.batch, self.after, self.fsync, self.excuse = batch, after, fsync, excuse
        self._result: Any = None

    def on_progress(self, bytes_transferred: int, **_: Any) -> None:
        self.batch.progress.add(bytes_transferred)

    def on_done(self, future: Any, **_: Any) -> None:
        try:
            self._result = future.result()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, re-raised there
            if self.excuse is None:
                self.batch._finished(exc)
            else:
                self.batch._then(functools.partial(self._excused, exc))
            return
        if self.after is None and self.fsync is None:
            self.batch._finished(None)
        else:
            self.batch._then(self._then)

    def _excused(self, exc: BaseException) -> None:
        try:
            excused = self.excuse is not None and self.excuse(exc)
        except Exception:  # noqa: BLE001 - no excuse found: the transfer's own error stands
            excused = False
        self.batch._finished(None if excused else exc)

    def _then(self) -> None:
        error: Optional[BaseException] = None
        try:
            if self.after is not None:
                self.after(self._result)
            if self.fsync is not None:
                _fsync(self.fsync)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, re-raised there
            error = exc
        self.batch._finished(error)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
