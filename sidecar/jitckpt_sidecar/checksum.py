"""Per-file checksums, '<algorithm>:<hex>', as the uploader records them in S3 manifests.

The algorithms are the manifest format's (protocol.manifest.CHECKSUM_ALGORITHMS); this module
computes them.

xxh128 (XXH3, 128 bits): the checksum guards against truncated, torn or bit-flipped objects,
not against an adversary, and it runs at memory speed (several GB/s on one core, 30-60x
sha256 on the machines we measured), so hashing a 1 GiB shard costs a fraction of a second of
a transfer that takes several. sha256 is also verified, for manifests written by other tools.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
from typing import Callable, Optional, Protocol

import xxhash

from jitckpt_entrypoint.protocol.manifest import checksum_supported

ALGORITHM = "xxh128"
_BLOCK = 8 * 1024 * 1024


class _Hasher(Protocol):
    def update(self, data: memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


_HASHERS: dict[str, Callable[[], _Hasher]] = {
    "xxh128": xxhash.xxh3_128,
    "sha256": hashlib.sha256,
}


def file_checksum(path: str, algorithm: str = ALGORITHM) -> str:
    """The checksum of the file at `path`, as '<algorithm>:<hex>'."""
    hasher = _HASHERS[algorithm]()
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            hasher.update(view[:n])
    return f"{algorithm}:{hasher.hexdigest()}"


class Streamed:
    """The checksum of a file as it is written in ranges by parallel threads, without reading
    the file again afterwards (the verification that followed every download was the restore's
    tail: a 340 MiB file took 0.07-0.18 s to hash back on two busy cores).

    A hash runs in order, the writes do not: one thread at a time holds the hash and feeds it
    what is written from its cursor on, from memory when the write is the one at the cursor
    (the bytes are still in the CPU's cache), else read back from the file (`fd`, opened for
    reading) up to where the range at the cursor has reached. So the hash follows one range
    live and catches up on the ranges ahead of it while the download goes on. A file of one
    range is hashed all from memory, one of two (its first range the shorter, downloads.py)
    mostly; with more ranges in flight at once, most bytes are read back from the page cache,
    still while the download goes on.
    """

    def __init__(self, algorithm: str, fd: int, ranges: list[tuple[int, int]]) -> None:
        self.algorithm = algorithm
        self._hasher = _HASHERS[algorithm]()
        self._fd = fd
        self._starts = [start for start, _ in ranges]
        self._ends = [end for _, end in ranges]
        self._reached = list(self._starts)
        """Per range: the byte its writes have reached (they are contiguous from its start)."""
        self._cursor = 0
        self._busy = False
        """A thread holds the hash (only that one updates it and moves the cursor)."""
        self._broken = False
        self._buf: Optional[memoryview] = None
        """For reading back (only the thread holding the hash uses it)."""
        self._cond = threading.Condition()

    def wrote(self, index: int, offset: int, data: memoryview) -> None:
        """Range `index` has written `data` at `offset` (right after its earlier writes)."""
        with self._cond:
            self._reached[index] = offset + len(data)
            if self._busy or self._broken:
                return  # the holder reads this back if the cursor gets here
            self._busy = True
        self._advance(data, offset)

    def result(self) -> Optional[str]:
        """Once every range is written: '<algorithm>:<hex>', or None if a read back failed
        (the caller hashes the file instead)."""
        while True:
            with self._cond:
                while self._busy:
                    self._cond.wait()
                if self._broken or (
                    self._cursor < self._ends[-1] and self._frontier() <= self._cursor
                ):  # a read back failed, or not every range was written
                    self._buf = None
                    return None
                if self._cursor >= self._ends[-1]:
                    self._buf = None
                    return f"{self.algorithm}:{self._hasher.hexdigest()}"
                self._busy = True
            self._advance(None, -1)

    def _frontier(self) -> int:
        """How far the bytes from the cursor on are written without a gap."""
        i = max(0, bisect.bisect_right(self._starts, self._cursor) - 1)
        while i < len(self._starts) and self._reached[i] == self._ends[i]:
            i += 1
        return self._ends[-1] if i == len(self._starts) else max(self._cursor, self._reached[i])

    def _advance(self, data: Optional[memoryview], offset: int) -> None:
        """Holding the hash: feed it what is written from the cursor on, then let go. A read
        back that fails leaves no checksum (`result` None), never an error in the download."""
        try:
            while True:
                with self._cond:
                    cursor = self._cursor
                    target = self._frontier()
                    if data is not None and offset != cursor:
                        data = None
                    if data is None and target <= cursor:
                        self._busy = False
                        self._cond.notify_all()
                        return
                if data is not None:
                    self._hasher.update(data)
                    done, data = len(data), None
                else:
                    if self._buf is None:
                        self._buf = memoryview(bytearray(min(_BLOCK, self._ends[-1])))
                    buf = self._buf
                    done = self._read_back(buf[: min(len(buf), target - cursor)], cursor)
                with self._cond:
                    self._cursor = cursor + done
        except OSError:
            with self._cond:
                self._broken, self._busy = True, False
                self._cond.notify_all()
        except BaseException:
            with self._cond:
                self._broken, self._busy = True, False
                self._cond.notify_all()
            raise

    def _read_back(self, buf: memoryview, offset: int) -> int:
        """Hash the file's bytes at `offset` (as many as `buf` holds); how many there were."""
        done = os.preadv(self._fd, [buf], offset)
        if done <= 0:
            raise OSError(f"the file ends at byte {offset}")
        self._hasher.update(buf[:done])
        return done


def bytes_checksum(data: bytes, algorithm: str = ALGORITHM) -> str:
    hasher = _HASHERS[algorithm]()
    hasher.update(memoryview(data))
    return f"{algorithm}:{hasher.hexdigest()}"


def algorithm_of(checksum: str) -> str:
    return checksum.partition(":")[0]


def streamable(checksum: Optional[str]) -> Optional[str]:
    """The algorithm of `checksum` when Streamed can compute it, else None."""
    if checksum is None or not checksum_supported(checksum):
        return None
    return algorithm_of(checksum)


def matches(path: str, checksum: str) -> bool:
    """Whether the file at `path` has `checksum`; False for an unknown algorithm."""
    return checksum_supported(checksum) and file_checksum(path, algorithm_of(checksum)) == checksum
