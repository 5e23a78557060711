"""A file's bytes written straight to the disk (O_DIRECT), chunk by chunk, from several threads.

A buffered write copies every byte into the page cache before the disk sees it. Where the
kernel must take page-cache pages from memory never used since boot (a fresh node, a VM that
hands freed memory back to its host) that copy is slower than the disk: on our CI VM 0.23 GB/s
buffered against 1.6-1.8 GB/s with O_DIRECT, fsync included in both. `DirectFile` fills
page-aligned 8 MiB buffers chunk by chunk and writes each with O_DIRECT; it takes no page-cache
pages and leaves the CPU mostly idle (the disk's DMA moves the bytes). The buffers are kept for
the next file (`KEEP` of them: one for a background save's single thread), so periodic saves do
not map and fault in fresh memory each time.

A file is its pieces: (offset, source), where a source is host memory (a memoryview) or a
tensor's bytes on a CUDA device (a flat uint8 tensor). A chunk's CUDA pieces are copied into its
buffer (page-locked with cudaHostRegister, so the copy is DMA), and the chunk is written once
they have landed; with several threads, chunk k+1 copies while chunk k is written. On the CPU
the same code runs and the copy is a memcpy into the buffer. This is how a JIT save of GPU state
streams at disk speed through a few reused host buffers instead of a host copy of everything.

While a chunk is in its buffer, the CRC-32 of the pieces asked for is taken from it (zlib.crc32
releases the GIL); a piece's partial CRCs are combined in order (crc32_combine), so archive
formats that need them (torch_save) get them without reading the bytes twice. `rewrite` then
writes a few blocks again once the caller has patched them (a zip's CRC fields).

A cancellation check runs before every chunk: a background save stops within one buffer.
Where the file system refuses O_DIRECT (tmpfs before Linux 6.6), and for the files of snapshots
in RAM (ram_files.py), the same chunks go through the page cache, written straight from host
memory (no copy into a buffer first), over a retired snapshot's file where there is one. An
EINVAL from an O_DIRECT write on a full disk is reported as ENOSPC, not taken for "O_DIRECT
unsupported". Durability is the commit's (protocol.durable).
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import mmap
import os
import queue
import threading
import zlib
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, ClassVar, Optional, Union

import numpy as np

from jitckpt_entrypoint.hook import ram_files

CHUNK = 8 << 20
"""Bytes one O_DIRECT write takes (a multiple of BLOCK)."""
BLOCK = 4096
"""Alignment of O_DIRECT offsets, lengths and buffers (any logical block size up to a page)."""

KEEP = 2
"""Buffers kept between writes (more are mapped while several threads write, then unmapped)."""

Source = Union[memoryview, Any]
"""Host bytes (a memoryview), or a flat uint8 torch tensor on a CUDA device."""
Piece = tuple[int, Source]
"""(file offset, bytes): the file is its pieces, not overlapping; gaps are zeros."""
Check = Optional[Callable[[], None]]
"""Called before every chunk; raises to stop the write (a cancelled save)."""


def write(path: str, size: int, pieces: Sequence[Piece], threads: int, check: Check = None) -> None:
    """Write `path` (created or truncated) as `size` bytes made of `pieces`."""
    with DirectFile(path, size) as f:
        f.write(pieces, threads, check)


class DirectFile:
    """One file being written: `write` the pieces, maybe `rewrite` some blocks, then close."""

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size
        self.direct = hasattr(os, "O_DIRECT") and not ram_files.in_ram(path)
        self.fd = -1
        # A spare (a retired snapshot's file) is written over, every byte: its pages are kept.
        flags = os.O_WRONLY | os.O_CREAT | (0 if ram_files.take(path) else os.O_TRUNC)
        if self.direct:
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False  # tmpfs and friends
        if self.fd < 0:
            self.fd = os.open(path, flags, 0o644)

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                os.ftruncate(self.fd, self.size)  # the padding of the last chunk
        finally:
            os.close(self.fd)

    def write(
        self,
        pieces: Sequence[Piece],
        threads: int,
        check: Check = None,
        crc_of: Iterable[int] = (),
    ) -> dict[int, int]:
        """Write every chunk of the file; returns the CRC-32 of each piece index in `crc_of`."""
        layout = _Layout(pieces, crc_of)
        try:
            return self._write(layout, threads, check)
        except _NoDirectError:  # the file system takes O_DIRECT opens but not its writes
            os.close(self.fd)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_TRUNC)
            self.direct = False
            return self._write(layout, threads, check)

    def _write(self, layout: _Layout, threads: int, check: Check) -> dict[int, int]:
        starts = range(0, self.size, CHUNK)
        partials: dict[int, list[tuple[int, int, int]]] = {i: [] for i in layout.crc_of}
        lock = threading.Lock()

        def one(buf: _Buffer, start: int) -> None:
            if check is not None:
                check()
            end = min(start + CHUNK, self.size)
            found = None if self.direct else _write_from_host(self.fd, layout, start, end)
            if found is None:
                found = buf.fill(layout, start, end)
                self._pwrite(buf, start, end)
            with lock:
                for index, at, crc, n in found:
                    partials[index].append((at, crc, n))

        _run(one, list(starts), threads)
        return {i: _combined(sorted(p)) for i, p in partials.items()}

    def rewrite(self, pieces: Sequence[Piece], ranges: Iterable[tuple[int, int]]) -> None:
        """Write the blocks that hold the bytes of `ranges` (start, end) again, from `pieces`."""
        layout = _Layout(pieces, ())
        blocks = sorted({b for s, e in ranges for b in range(s // BLOCK, -(-e // BLOCK))})
        runs: list[list[int]] = []
        for b in blocks:  # adjacent blocks in one write
            if runs and runs[-1][1] == b and (runs[-1][1] - runs[-1][0]) * BLOCK < CHUNK:
                runs[-1][1] = b + 1
            else:
                runs.append([b, b + 1])
        buf = _Buffer.take()
        try:
            for first, last in runs:
                start, end = first * BLOCK, min(last * BLOCK, self.size)
                buf.fill(layout, start, end)
                self._pwrite(buf, start, end)
        finally:
            buf.give_back()

    def _pwrite(self, buf: _Buffer, start: int, end: int) -> None:
        length = -(-(end - start) // BLOCK) * BLOCK if self.direct else end - start
        buf.view[end - start : length] = 0
        data = memoryview(buf.mem)[:length]
        offset = start
        while data:
            try:
                n = os.pwrite(self.fd, data, offset)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self.direct:
                    raise self._einval() from exc
                raise
            data, offset = data[n:], offset + n

    def _einval(self) -> Exception:
        """An O_DIRECT write refused with EINVAL: a full disk (some file systems answer so) is
        ENOSPC; with room to spare, the file system does not take O_DIRECT writes."""
        try:
            st = os.statvfs(os.path.dirname(os.path.abspath(self.path)))
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = self.size
        if free < self.size:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        return _NoDirectError()


class _NoDirectError(Exception):
    """O_DIRECT writes refused (EINVAL) with room on the disk: write through the page cache."""


class _Layout:
    """The pieces, sorted by offset, and which of them want a CRC."""

    def __init__(self, pieces: Sequence[Piece], crc_of: Iterable[int]) -> None:
        # Empty pieces hold no bytes (their CRC is 0); kept, one could share its offset with
        # the piece that follows and be found in its place.
        kept = [i for i in range(len(pieces)) if _length(pieces[i][1])]
        order = sorted(kept, key=lambda i: pieces[i][0])
        self.pieces = [pieces[i] for i in order]
        self.index = order  # sorted position -> the caller's index
        self.starts = [offset for offset, _ in self.pieces]
        self.crc_of = set(crc_of)
        self.lengths = [_length(source) for _, source in self.pieces]

    def segments(
        self, start: int, end: int
    ) -> Iterator[tuple[int, int, int, Optional[Source], int]]:
        """The file's bytes from `start` to `end`, in order: (from, to, the caller's piece
        index, its source, where in the piece `from` is); a gap is (from, to, -1, None, 0)."""
        pos, i = start, max(bisect.bisect_right(self.starts, start) - 1, 0)
        while pos < end and i < len(self.pieces):
            offset, source = self.pieces[i]
            stop = offset + self.lengths[i]
            index = self.index[i]
            i += 1
            if stop <= pos:
                continue
            if offset >= end:
                break
            if offset > pos:
                yield pos, offset, -1, None, 0
                pos = offset
            upto = min(stop, end)
            yield pos, upto, index, source, pos - offset
            pos = upto
        if pos < end:
            yield pos, end, -1, None, 0


def _length(source: Source) -> int:
    return len(source) if isinstance(source, memoryview) else int(source.numel())


class _Buffer:
    """A page-aligned CHUNK-sized buffer (page-locked for CUDA copies once one is needed)."""

    _kept: ClassVar[list[_Buffer]] = []
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.mem = mmap.mmap(-1, CHUNK)
        self.view = np.frombuffer(self.mem, dtype=np.uint8)
        self._host: Any = None  # the buffer as a torch tensor (CUDA copies land here)
        self._registered = False
        self._streams: dict[Any, Any] = {}
        """A side stream per GPU this buffer copies from (one process may use several)."""

    @classmethod
    def take(cls) -> _Buffer:
        with cls._lock:
            if cls._kept:
                return cls._kept.pop()
        return cls()

    def give_back(self) -> None:
        with self._lock:
            if len(self._kept) < KEEP:
                self._kept.append(self)
                return
        self.close()

    def close(self) -> None:
        if self._registered:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.view.ctypes.data)
            self._registered = False
        self._host = None
        self.view = np.empty(0, dtype=np.uint8)
        self.mem.close()

    def fill(self, layout: _Layout, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """This buffer = the file's bytes from `start` to `end`; returns the partial CRCs taken
        (caller's piece index, offset in the piece, crc, length)."""
        crcs: list[tuple[int, int, int, int]] = []
        copied: list[tuple[int, int, int, int]] = []  # tensor copies: wait for them, then CRC
        for lo, hi, index, source, at in layout.segments(start, end):
            a, b = lo - start, hi - start
            if source is None:
                self.view[a:b] = 0
            elif isinstance(source, memoryview):
                self.view[a:b] = np.frombuffer(source, np.uint8, b - a, at)
                if index in layout.crc_of:
                    crcs.append((index, at, self._crc(a, b), b - a))
            else:
                self._copy(source, at, at + b - a, a)
                copied.append((index, at, a, b))
        if copied:
            for stream in self._streams.values():
                stream.synchronize()  # the device copies have landed
            for index, at, a, b in copied:
                if index in layout.crc_of:
                    crcs.append((index, at, self._crc(a, b), b - a))
        return crcs

    def _crc(self, a: int, b: int) -> int:
        return zlib.crc32(memoryview(self.mem)[a:b])  # releases the GIL for long buffers

    def _copy(self, source: Any, lo: int, hi: int, at: int) -> None:
        """Queue the copy of `source[lo:hi]` (a flat uint8 tensor) to `at` in this buffer: a
        memcpy for host memory, an asynchronous DMA on this buffer's stream for a GPU's."""
        import torch

        if self._host is None:
            self._host = torch.from_numpy(self.view)
        if source.device.type != "cuda":
            self._host[at : at + hi - lo].copy_(source[lo:hi])
            return
        if not self._registered:
            # Page-locked, the copy is DMA and asynchronous; if registering fails it is a
            # synchronous copy through the driver (slower, as correct).
            err = torch.cuda.cudart().cudaHostRegister(self.view.ctypes.data, CHUNK, 0)
            self._registered = int(err) == 0
        stream = self._streams.get(source.device)
        if stream is None:
            stream = self._streams[source.device] = torch.cuda.Stream(source.device)
            stream.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(stream):
            self._host[at : at + hi - lo].copy_(source[lo:hi], non_blocking=True)


_ZEROS = memoryview(mmap.mmap(-1, CHUNK))  # never written: read, it maps the zero page
_IOV = 512  # buffers per pwritev (the kernel takes up to IOV_MAX, 1024 on Linux)


def _write_from_host(
    fd: int, layout: _Layout, start: int, end: int
) -> Optional[list[tuple[int, int, int, int]]]:
    """Through the page cache, the bytes from `start` to `end` written straight from the
    pieces in host memory (no copy into a buffer first), gaps as zeros; the partial CRCs as
    `_Buffer.fill` returns them. None, with nothing written, when a piece is on a GPU or not
    flat contiguous bytes: the buffer's copy handles it."""
    views: list[memoryview] = []
    wanted: list[tuple[int, int, memoryview]] = []
    for lo, hi, index, source, at in layout.segments(start, end):
        if source is None:
            views.append(_ZEROS[: hi - lo])
            continue
        data = _host_bytes(source)
        if data is None:
            return None
        views.append(data[at : at + hi - lo])
        if index in layout.crc_of:
            wanted.append((index, at, views[-1]))
    crcs = [(index, at, zlib.crc32(view), len(view)) for index, at, view in wanted]
    _pwritev(fd, views, start)
    return crcs


def _host_bytes(source: Source) -> Optional[memoryview]:
    """A piece's bytes as a flat memoryview, when they are flat contiguous host bytes."""
    import torch

    if isinstance(source, memoryview):
        if source.ndim != 1 or source.itemsize != 1 or not source.c_contiguous:
            return None
        return source.cast("B")
    if isinstance(source, torch.Tensor) and source.device.type == "cpu" and source.is_contiguous():
        return memoryview(source.numpy())
    return None


def _pwritev(fd: int, views: list[memoryview], offset: int) -> None:
    """All of `views`, back to back from `offset` (short writes resumed)."""
    while views:
        batch = views[:_IOV]
        n = os.pwritev(fd, batch, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing", fd)
        offset += n
        done = 0
        while done < len(batch) and n >= len(batch[done]):
            n -= len(batch[done])
            done += 1
        views = views[done:]
        if n:
            views[0] = views[0][n:]


def _run(one: Callable[[_Buffer, int], None], starts: list[int], threads: int) -> None:
    """`one(buffer, start)` for every chunk, on up to `threads` threads, each with a buffer."""
    wanted = max(1, min(threads, len(starts)))
    buffers: queue.SimpleQueue[_Buffer] = queue.SimpleQueue()
    own = [_Buffer.take() for _ in range(wanted)]
    for buf in own:
        buf._streams = {}  # a new write: its copies follow the work queued until now
        buffers.put(buf)

    def run(start: int) -> None:
        buf = buffers.get()
        try:
            one(buf, start)
        finally:
            buffers.put(buf)

    try:
        if wanted == 1:
            for start in starts:
                run(start)
        else:
            with ThreadPoolExecutor(max_workers=wanted) as pool:
                futures = [pool.submit(run, start) for start in starts]
            for future in futures:
                future.result()
    finally:
        for buf in own:
            buf.give_back()


def _combined(partials: list[tuple[int, int, int]]) -> int:
    """The CRC-32 of a piece from its partial CRCs (offset, crc, length), in order."""
    crc, pos = 0, 0
    for at, part, n in partials:
        if at != pos:
            raise ValueError(f"partial CRCs leave a gap at {pos}")
        crc = crc32_combine(crc, part, n) if pos else part
        pos += n
    return crc


def _libz() -> Any:
    try:
        lib = ctypes.CDLL("libz.so.1")
        lib.crc32_combine.restype = ctypes.c_ulong
        lib.crc32_combine.argtypes = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_long]
    except (OSError, AttributeError):
        return None
    return lib


_LIBZ = _libz()
_POLY = 0xEDB88320
_X2N: list[int] = []


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from CRC-32(A), CRC-32(B) and len(B): zlib's crc32_combine (libz when it
    loads; else the same algorithm in Python: crc1 times x^(8*len2) modulo the polynomial)."""
    if _LIBZ is not None:
        return int(_LIBZ.crc32_combine(crc1, crc2, len2))
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order, as zlib's multmodp)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x8nmodp(n: int) -> int:
    """x^(8n) modulo the polynomial (zlib's x2nmodp(n, 3))."""
    if not _X2N:
        p = 1 << 30  # x^1
        for _ in range(32):
            _X2N.append(p)
            p = _multmodp(p, p)
    k, p = 3, 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p
