"""Bulk transfers through boto3's TransferManager: tuning, progress logs, waiting, cancelling.

One TransferManager per checkpoint (upload or restore): its thread pool bounds the requests in
flight, leaving the context cancels whatever is still running (s3transfer aborts the
multipart uploads it started), and a `Batch` waits for every file with a progress line every
10 s and a cancellation check (a newer checkpoint during the drain, the drain deadline).

What runs once a download is done (the restore's checksum verification, then an fsync of the
file) runs on the Batch's own threads: s3transfer calls it on its single IO thread, which writes
every download's bytes, and would stall them all meanwhile. The fsync there starts each file's
writeback while the others still download, instead of all of it at the commit's sync.
"""

from __future__ import annotations

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


def download_config(cfg: Config) -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=cfg.download_chunk,
        multipart_chunksize=cfg.download_chunk,
        max_concurrency=cfg.download_concurrency,
        io_chunksize=1024 * 1024,  # fewer, larger writes than the 256 KiB default
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
        self._waited = False

    def subscriber(
        self,
        size: Optional[int] = None,
        after: Optional[Callable[[], None]] = None,
        etag: Optional[str] = None,
        fsync: Optional[str] = None,
    ) -> _Subscriber:
        """A subscriber for one transfer; once it is done, `after` runs (on the Batch's
        threads), then the file at `fsync` is fsynced. A download given the object's `size` and
        `etag` (from the listing) sends no HeadObject, and its ranged GETs ask for exactly that
        object (If-Match)."""
        with self._cond:
            self._pending += 1
        return _Subscriber(self, size, after, etag, fsync)

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
            if self._after is None and not self._waited:
                self._after = ThreadPoolExecutor(AFTER_THREADS, thread_name_prefix="after")
            pool = self._after
        if pool is None:  # the wait already ended (failed or cancelled): as s3transfer would
            job()
            return
        try:
            pool.submit(job)
        except RuntimeError:  # shut down in between
            job()

    def wait(self, cancel: Callable[[], Optional[str]], poll: float = 0.2) -> None:
        """Until every transfer is done; raise the first error, or TransferCancelledError when
        `cancel` returns a reason (leaving the TransferManager's context cancels the rest)."""
        try:
            self._wait(cancel, poll)
        finally:
            with self._cond:
                pool, self._after, self._waited = self._after, None, True
            if pool is not None:  # what runs still touches the files: finish it, drop the rest
                pool.shutdown(wait=True, cancel_futures=True)

    def _wait(self, cancel: Callable[[], Optional[str]], poll: float) -> None:
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
    """s3transfer calls on_queued / on_progress / on_done (duck-typed, like BaseSubscriber)."""

    def __init__(
        self,
        batch: Batch,
        size: Optional[int],
        after: Optional[Callable[[], None]],
        etag: Optional[str] = None,
        fsync: Optional[str] = None,
    ) -> None:
        self.batch, self.size, self.after, self.etag, self.fsync = batch, size, after, etag, fsync

    def on_queued(self, future: Any, **_: Any) -> None:
        # A download sends a HeadObject unless it knows both (s3transfer >= 0.11 wants the ETag).
        if self.size is not None:
            future.meta.provide_transfer_size(self.size)
        if self.etag and hasattr(future.meta, "provide_object_etag"):  # s3transfer >= 0.11
            future.meta.provide_object_etag(self.etag)

    def on_progress(self, bytes_transferred: int, **_: Any) -> None:
        self.batch.progress.add(bytes_transferred)

    def on_done(self, future: Any, **_: Any) -> None:
        try:
            future.result()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, re-raised there
            self.batch._finished(exc)
            return
        if self.after is None and self.fsync is None:
            self.batch._finished(None)
        else:
            self.batch._then(self._then)

    def _then(self) -> None:
        error: Optional[BaseException] = None
        try:
            if self.after is not None:
                self.after()
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
