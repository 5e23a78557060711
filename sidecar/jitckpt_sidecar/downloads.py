"""The restore's downloads: files fetched in GETs of up to `chunk` bytes on a pool of threads,
each thread writing what it reads at its offset (pwrite), and checksummed as they land.

With s3transfer's download pipeline (chunk queues, one IO thread that writes every chunk of
every download) a 1 GiB restore's transfer took 1.4x (Ceph RGW) to 2.2x (moto) the time of
this (docs/benchmarks.md). Each file goes into `<dest>.jitckpt-part` and is renamed to `dest`
once whole: a file under its own name is never partial. Every GET carries the listing's ETag
(If-Match): an object replaced or deleted meanwhile fails the download (412 / 404) instead of
mixing two versions. Given a checksum algorithm, each file is hashed as its bytes land
(checksum.Streamed): its first range is its shortest, so that the hash, which runs in order,
follows the next range live once the first is done. A read that breaks off (reset, timeout,
short body) is resumed from the byte it reached, up to ATTEMPTS times per GET, as s3transfer
does; errors of the request itself are botocore's to retry. The caller's subscriber
(transfers.Batch) hears each file's progress and its end, as from s3transfer; the future it
gets holds the file's checksum (None when none was asked for or it could not be had). Leaving
the context stops every GET at its next read (READ_SIZE) and waits for them; a body's read
stalled on its socket is cut off (urllib3 2.3+'s HTTPResponse.shutdown) rather than waited for
until the client's read timeout (120 s: past a pod's grace period), and what such a read
returned is never written. A request still waiting for its response's headers is not: that
one ends at the read timeout (botocore may retry it).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from botocore.exceptions import IncompleteReadError, ReadTimeoutError, ResponseStreamingError

from jitckpt_sidecar.checksum import Streamed
from jitckpt_sidecar.errors import SidecarError

READ_SIZE = 1024 * 1024
"""Bytes per read and per write (the 256 KiB of botocore's iter_chunks costs more calls)."""
ATTEMPTS = 5
BACKOFF = 0.2
"""Seconds before the second attempt of a GET; doubling, at most 5 s."""
PART_SUFFIX = ".jitckpt-part"
RETRYABLE_READ_ERRORS = (
    socket.timeout,
    ConnectionError,
    ReadTimeoutError,
    IncompleteReadError,
    ResponseStreamingError,
)
"""A body's read that broke off: s3transfer's S3_RETRYABLE_DOWNLOAD_ERRORS (not imported from
there: the one-shot restore does not load s3transfer)."""


class DownloadsStoppedError(SidecarError):
    """The downloads were left (their context exited) before this one finished."""


class Downloads:
    """One restore's downloads (a context manager, like s3transfer's TransferManager)."""

    def __init__(self, client: Any, *, chunk: int, concurrency: int) -> None:
        self.client, self.chunk = client, max(1, chunk)
        self._pool = ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="jitckpt-download")
        self._stop = threading.Event()
        self._files: list[_File] = []
        self._reading: set[Any] = set()
        """The bodies being read now (cut off when the downloads are left)."""
        self._reading_lock = threading.Lock()

    def __enter__(self) -> Downloads:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        with self._reading_lock:
            reading = list(self._reading)
        for body in reading:
            _cut_off(body)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for file in self._files:  # never started, or cut short: ends with an error
            file.abandon()

    def download(
        self,
        bucket: str,
        key: str,
        dest: str,
        *,
        size: int,
        etag: Optional[str],
        subscriber: Any,
        algorithm: Optional[str] = None,
    ) -> None:
        """Fetch object `key` (`size` bytes, `etag` from the listing) into `dest`, hashed with
        `algorithm` (checksum.py's) as it lands; the subscriber's on_progress(bytes_transferred=n)
        and on_done(future) are called, the future's result the checksum."""
        ranges = split(size, self.chunk)
        file = _File(
            bucket, key, etag, dest, ranges=ranges, subscriber=subscriber, algorithm=algorithm
        )
        self._files.append(file)
        for index, (start, end) in enumerate(ranges):
            self._pool.submit(self._fetch, file, index, start, end, start == 0 and end == size)

    def _fetch(self, file: _File, index: int, start: int, end: int, whole: bool) -> None:
        error: Optional[BaseException] = None
        try:
            fd = file.open()
            reached = start
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    reached = self._get(fd, file, index, reached, end, whole=whole)
                    break
                except _ReadError as exc:
                    reached = exc.reached
                    if attempt == ATTEMPTS:  # not transient: the restore must not loop on it
                        raise SidecarError(
                            f"{file.key}: the download broke off {ATTEMPTS} times, the last at "
                            f"byte {reached} ({exc.cause})"
                        ) from None
                    whole = False  # resumed: the rest only
                    if not file.failed:
                        self._stop.wait(min(BACKOFF * 2 ** (attempt - 1), 5.0))
        except BaseException as exc:  # noqa: BLE001 - handed to the subscriber (the Batch)
            error = exc
        file.range_done(error)

    def _get(self, fd: int, file: _File, index: int, start: int, end: int, *, whole: bool) -> int:
        """GET bytes [start, end) of the object into `fd`; returns `end`, or raises _ReadError
        with the offset reached when the body breaks off."""
        if self._stop.is_set() or file.failed:
            raise DownloadsStoppedError("download stopped")
        key = file.key
        args: dict[str, Any] = {"Bucket": file.bucket, "Key": key}
        if file.etag:
            args["IfMatch"] = file.etag
        if not whole:
            args["Range"] = f"bytes={start}-{end - 1}"
        response = self.client.get_object(**args)
        body = response["Body"]
        offset = start
        with self._reading_lock:
            self._reading.add(body)
        try:
            sent = response.get("ContentLength")
            served = response.get("ContentRange", "")
            if sent != end - start or not (whole or served.startswith(f"bytes {start}-")):
                raise SidecarError(  # a Range ignored, a resized object
                    f"{key}: asked for bytes {start}-{end - 1}, the store sent "
                    f"{sent} bytes ({served or 'no Content-Range'})"
                )
            while offset < end:
                if self._stop.is_set() or file.failed:
                    raise DownloadsStoppedError("download stopped")
                try:
                    data = body.read(min(READ_SIZE, end - offset))
                except RETRYABLE_READ_ERRORS as exc:
                    raise _ReadError(offset, exc) from None
                if self._stop.is_set():  # cut off during the read: over TLS, the bytes after
                    raise DownloadsStoppedError("download stopped")  # the cut are ciphertext
                if not data:  # botocore raises this itself when the body is short of its length
                    cause = IncompleteReadError(
                        actual_bytes=offset - start, expected_bytes=end - start
                    )
                    raise _ReadError(offset, cause)
                _write(fd, data, offset)
                file.wrote(index, offset, data)
                offset += len(data)
                file.subscriber.on_progress(bytes_transferred=len(data))
            if whole and body.read(1):  # also where botocore checks a whole object's checksum
                raise SidecarError(f"{key} has more than the {end} bytes listed")
        finally:
            with self._reading_lock:
                self._reading.discard(body)
            body.close()
        return offset


def _cut_off(body: Any) -> None:
    """End a read of `body` blocked on its socket, from another thread: urllib3 2.3+'s
    HTTPResponse.shutdown (under botocore's body) shuts the socket for reading (over TLS it
    drops the TLS state too: the caller must not use what the read returns). A no-op where there
    is none (older urllib3) or the body is done."""
    shutdown = getattr(getattr(body, "_raw_stream", None), "shutdown", None)
    if callable(shutdown):
        with contextlib.suppress(ValueError, RuntimeError, OSError):
            shutdown()


def split(size: int, chunk: int) -> list[tuple[int, int]]:
    """The byte ranges of a `size`-byte object in GETs of up to `chunk`: the first is the
    shortest (what does not divide evenly), the rest `chunk` each; one empty range for 0."""
    first = size % chunk or chunk
    bounds = [0, *range(first, size, chunk), size] if size else [0, 0]
    return list(zip(bounds, bounds[1:]))


def _write(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class _ReadError(Exception):
    def __init__(self, reached: int, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.reached, self.cause = reached, cause


class _File:
    """One file's GETs: opened by the first, renamed into place by the last (when all
    succeeded), then reported to the subscriber once."""

    def __init__(
        self,
        bucket: str,
        key: str,
        etag: Optional[str],
        dest: str,
        *,
        ranges: list[tuple[int, int]],
        subscriber: Any,
        algorithm: Optional[str],
    ) -> None:
        self.bucket, self.key, self.etag = bucket, key, etag
        self.dest, self.subscriber = dest, subscriber
        self.part = dest + PART_SUFFIX
        self.algorithm = algorithm
        self._ranges = ranges
        self._left = len(ranges)
        self._fd: Optional[int] = None
        self._streamed: Optional[Streamed] = None
        self._error: Optional[BaseException] = None
        self._reported = False
        self._lock = threading.Lock()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def open(self) -> int:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                if self.algorithm is not None:
                    self._streamed = Streamed(self.algorithm, self._fd, self._ranges)
            return self._fd

    def wrote(self, index: int, offset: int, data: bytes) -> None:
        if self._streamed is not None:
            self._streamed.wrote(index, offset, memoryview(data))

    def range_done(self, error: Optional[BaseException]) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._left -= 1
            if self._left > 0:
                return
        self._finish()

    def abandon(self) -> None:
        """The downloads were left: a file not reported yet ends with an error."""
        with self._lock:
            if self._reported:
                return
            if self._error is None:
                self._error = DownloadsStoppedError("download stopped")
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            if self._reported:
                return
            self._reported = True
            fd, self._fd, error = self._fd, None, self._error
        digest = None
        try:
            if error is None and self._streamed is not None:
                digest = self._streamed.result()
            self._streamed = None  # its read-back buffer: not for the rest of the restore
            if fd is not None:
                os.close(fd)
            if error is None:
                os.replace(self.part, self.dest)
        except OSError as exc:
            error = exc
        if error is not None and fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.part)
        future: Future[Optional[str]] = Future()
        if error is None:
            future.set_result(digest)
        else:
            future.set_exception(error)
        self.subscriber.on_done(future)
