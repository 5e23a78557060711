"""File checksums: '<algorithm>:<hex>', xxh128 by default, sha256 understood."""

from __future__ import annotations

import hashlib

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
