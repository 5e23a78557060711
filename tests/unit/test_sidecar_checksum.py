"""File checksums: '<algorithm>:<hex>', xxh128 by default, sha256 understood."""

from __future__ import annotations

import hashlib
import os
import random
import threading

from jitckpt_entrypoint.protocol.manifest import CHECKSUM_ALGORITHMS, checksum_supported
from jitckpt_sidecar import checksum


def test_file_and_bytes_checksums_agree_across_block_boundaries(tmp_path):
    """A file larger than the read block hashes like the same bytes in memory."""
    data = bytes(range(256)) * 40_000  # ~10 MB, more than one 8 MiB block
    path = tmp_path / "f"
    path.write_bytes(data)
    assert checksum.file_checksum(str(path)) == checksum.bytes_checksum(data)
    assert checksum.file_checksum(str(path)).startswith("xxh128:")
    assert len(checksum.file_checksum(str(path))) == len("xxh128:") + 32


def test_matches_verifies_xxh128_and_sha256_and_rejects_unknown_algorithms(tmp_path):
    """A flipped byte fails; sha256 from other tools verifies; an unknown algorithm never does."""
    path = tmp_path / "f"
    path.write_bytes(b"checkpoint bytes")
    good = checksum.file_checksum(str(path))
    assert checksum.matches(str(path), good)
    assert checksum.matches(str(path), "sha256:" + hashlib.sha256(b"checkpoint bytes").hexdigest())
    assert not checksum.matches(str(path), "md5:00")
    assert not checksum_supported("xxh128")
    path.write_bytes(b"checkpoint bytez")
    assert not checksum.matches(str(path), good)


def test_the_sidecar_computes_every_algorithm_the_manifest_format_names(tmp_path):
    """protocol.manifest.CHECKSUM_ALGORITHMS (what S3's commit rule accepts) and the sidecar's
    hashers are the same set, the default among them."""
    path = tmp_path / "f"
    path.write_bytes(b"x")
    assert set(checksum._HASHERS) == set(CHECKSUM_ALGORITHMS)
    assert checksum.ALGORITHM in CHECKSUM_ALGORITHMS
    for algorithm in CHECKSUM_ALGORITHMS:
        assert checksum.matches(str(path), checksum.file_checksum(str(path), algorithm))


def _streamed(tmp_path, data: bytes, ranges: list[tuple[int, int]]):
    path = tmp_path / "f"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDWR)
    return fd, checksum.Streamed("xxh128", fd, ranges)


def test_streamed_gives_the_files_checksum_whatever_order_the_ranges_land_in(tmp_path):
    """Writes of 4 ranges in 200 random interleavings (each range in order, as one GET's
    reads): the checksum is the whole file's, from memory at the cursor, read back elsewhere."""
    data = os.urandom(10_000)
    ranges = [(0, 1_000), (1_000, 4_000), (4_000, 7_000), (7_000, 10_000)]
    rng = random.Random(7)
    for _ in range(200):
        fd, streamed = _streamed(tmp_path, data, ranges)
        pieces = {}
        for i, (start, end) in enumerate(ranges):
            cuts = sorted({start, end, *(rng.randrange(start, end) for _ in range(4))})
            pieces[i] = list(zip(cuts, cuts[1:]))
        while pieces:
            i = rng.choice(sorted(pieces))
            start, end = pieces[i].pop(0)
            os.pwrite(fd, data[start:end], start)
            streamed.wrote(i, start, memoryview(data[start:end]))
            if not pieces[i]:
                del pieces[i]
        assert streamed.result() == checksum.bytes_checksum(data)
        os.close(fd)


def test_streamed_from_threads_matches_and_a_failed_read_back_gives_none(tmp_path):
    data = os.urandom(1 << 20)
    ranges = [(0, 100_000)]
    ranges += [(s, min(s + 200_000, len(data))) for s in range(100_000, len(data), 200_000)]
    fd, streamed = _streamed(tmp_path, data, ranges)

    def write(i: int) -> None:
        start, end = ranges[i]
        for o in range(start, end, 4096):
            piece = data[o : min(o + 4096, end)]
            os.pwrite(fd, piece, o)
            streamed.wrote(i, o, memoryview(piece))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(ranges))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert streamed.result() == checksum.bytes_checksum(data)
    os.close(fd)

    fd, streamed = _streamed(tmp_path, data, [(0, 10), (10, 20)])
    streamed.wrote(1, 10, memoryview(data[10:20]))  # not in the file: the read back fails
    streamed.wrote(0, 0, memoryview(data[:10]))
    assert streamed.result() is None  # the caller hashes the file itself
    os.close(fd)
