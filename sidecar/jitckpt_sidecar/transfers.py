"""Bulk transfers through boto3's TransferManager: tuning, progress logs, waiting, cancelling.

One TransferManager per checkpoint (upload or restore): its thread pool bounds the requests in
flight, leaving the context cancels whatever is still running (s3transfer aborts the
multipart uploads it started), and a `Batch` waits for every file with a progress line every
10 s and a cancellation check (a newer checkpoint during the drain, the drain deadline).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from jitckpt_sidecar.config import Config
from jitckpt_sidecar.errors import SidecarError

PROGRESS_EVERY = 10.0
MB = 1e6


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

    def subscriber(
        self,
        size: Optional[int] = None,
        after: Optional[Callable[[], None]] = None,
        etag: Optional[str] = None,
    ) -> _Subscriber:
        """A subscriber for one transfer; `after` runs (in a transfer thread) once it is done.
        A download given the object's `size` and `etag` (from the listing) sends no HeadObject,
        and its ranged GETs ask for exactly that object (If-Match)."""
        with self._cond:
            self._pending += 1
        return _Subscriber(self, size, after, etag)

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

    def wait(self, cancel: Callable[[], Optional[str]], poll: float = 0.2) -> None:
        """Until every transfer is done; raise the first error, or TransferCancelledError when
        `cancel` returns a reason (leaving the TransferManager's context cancels the rest)."""
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
    ) -> None:
        self.batch, self.size, self.after, self.etag = batch, size, after, etag

    def on_queued(self, future: Any, **_: Any) -> None:
        # A download sends a HeadObject unless it knows both (s3transfer >= 0.11 wants the ETag).
        if self.size is not None:
            future.meta.provide_transfer_size(self.size)
        if self.etag and hasattr(future.meta, "provide_object_etag"):  # s3transfer >= 0.11
            future.meta.provide_object_etag(self.etag)

    def on_progress(self, bytes_transferred: int, **_: Any) -> None:
        self.batch.progress.add(bytes_transferred)

    def on_done(self, future: Any, **_: Any) -> None:
        error: Optional[BaseException] = None
        try:
            future.result()
            if self.after is not None:
                self.after()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, re-raised there
            error = exc
        self.batch._finished(error)
