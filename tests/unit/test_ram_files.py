"""A retired snapshot's large files are written over by the next snapshot, byte for byte."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from jitckpt_entrypoint.hook import direct_write, ram_files, torch_save
from jitckpt_entrypoint.protocol import manifest as m


@pytest.fixture(params=["tmpfs", "disk"])
def root(request, tmp_path: Path, monkeypatch) -> Iterator[Path]:
    """A memory dir on a tmpfs (no O_DIRECT: the page-cache path), or on the test's disk."""
    monkeypatch.setattr(ram_files, "_roots", set())
    monkeypatch.setattr(ram_files, "_written", set())
    if request.param == "disk":
        path = tmp_path
    elif os.path.isdir("/dev/shm"):
        path = Path(tempfile.mkdtemp(prefix="test-ram-files-", dir="/dev/shm"))
    else:
        pytest.skip("no /dev/shm")
    ram_files.register(str(path))
    yield path
    if path != tmp_path:
        shutil.rmtree(path)


def snapshot(root: Path, step: int, files: dict[str, int], *others: str) -> Path:
    """Snapshot `step`: `files` as direct_write wrote them, `others` (1 MB each) as a library
    did."""
    path = root / f"checkpoint-{step}"
    for name, size in [*files.items(), *((name, ram_files.LARGE) for name in others)]:
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(b"\xff" * size)
    ram_files._written.update(files)
    return path


def test_retire_withdraws_the_manifests_keeps_large_files_it_wrote_and_removes_the_rest(root):
    big = ram_files.LARGE
    path = snapshot(
        root, 5, {"optimizer.pt": big, "shard/a.bin": big + 1, "small.json": 10}, "tokenizer.json"
    )
    (path / m.manifest_name(0)).write_text("{}")
    ram_files.retire(str(root), str(path))
    assert not path.exists()
    kept = sorted(
        str(p.relative_to(root / ram_files.SPARE)) for p in root.rglob("*") if p.is_file()
    )
    assert kept == ["optimizer.pt", "shard/a.bin"]


@pytest.mark.parametrize("spare_size", [10, 3 << 20])
def test_a_file_written_over_a_spare_is_exactly_its_bytes(root: Path, spare_size: int):
    """Smaller or larger than the new file and full of old bytes, the spare ends as the file:
    every byte written, gaps as zeros, truncated to the size; its inode is kept."""
    ram_files.retire(str(root), str(snapshot(root, 5, {"f.bin": max(spare_size, ram_files.LARGE)})))
    inode = (root / ram_files.SPARE / "f.bin").stat().st_ino
    target = root / "checkpoint-10"
    target.mkdir()
    size = 2 * direct_write.CHUNK + 99
    pieces = [(3, memoryview(b"abc")), (direct_write.CHUNK + 1, memoryview(b"xyz"))]
    direct_write.write(str(target / "f.bin"), size, pieces, 2)
    expected = bytearray(size)
    for offset, piece in pieces:
        expected[offset : offset + len(piece)] = piece
    assert (target / "f.bin").read_bytes() == bytes(expected)
    assert (target / "f.bin").stat().st_ino == inode
    assert not (root / ram_files.SPARE / "f.bin").exists()


def test_torch_save_over_a_spare_is_the_bytes_torch_save_writes(root: Path):
    state = {"a": torch.randn(600_000), "b": [torch.arange(10)], "step": 3}
    ram_files.retire(str(root), str(snapshot(root, 5, {"optimizer.pt": 5 << 20})))
    (root / "checkpoint-10").mkdir()
    torch_save.save(state, str(root / "checkpoint-10" / "optimizer.pt"), 2)
    torch.save(state, root / "optimizer.pt")  # the same name: the archive's folder
    assert (root / "checkpoint-10" / "optimizer.pt").read_bytes() == (
        root / "optimizer.pt"
    ).read_bytes()


def test_only_files_in_a_snapshot_of_a_named_root_take_spares(root: Path, tmp_path: Path):
    ram_files.retire(str(root), str(snapshot(root, 5, {"f.bin": ram_files.LARGE})))
    assert not ram_files.take(str(root / "f.bin"))  # not in a snapshot directory
    assert not ram_files.take(str(root / ram_files.SPARE / "f.bin"))
    assert not ram_files.take(str(root.parent / "elsewhere" / "f.bin"))
    assert not ram_files.take(str(root / "checkpoint-10" / "g.bin"))  # no spare of that path
    (root / "checkpoint-10").mkdir()
    assert ram_files.take(str(root / "checkpoint-10" / "f.bin"))
    assert not ram_files.take(str(root / "checkpoint-15" / "f.bin"))  # taken once
    ram_files.remove(str(root))
    assert not (root / ram_files.SPARE).exists()
    assert os.listdir(root) == ["checkpoint-10"]


def test_files_in_ram_go_through_the_page_cache_without_a_buffer_copy(root: Path, monkeypatch):
    """O_DIRECT on a tmpfs (Linux >= 6.6 takes it) would only add the copy into a buffer."""
    (root / "checkpoint-10").mkdir()
    monkeypatch.setattr(direct_write._Buffer, "fill", lambda *_: pytest.fail("buffer copy"))
    data = torch.arange(3 * direct_write.CHUNK // 8, dtype=torch.int64)
    flat = data.view(torch.uint8)
    with direct_write.DirectFile(str(root / "checkpoint-10" / "f"), len(flat) + 5) as f:
        assert not f.direct
        f.write([(5, flat)], 2)
    assert (root / "checkpoint-10" / "f").read_bytes() == bytes(5) + flat.numpy().tobytes()


def test_a_file_written_afresh_drops_its_spare(root: Path):
    """A library's own save (a fallback) writes a new file: the spare goes first, so no more
    than two snapshots' bytes are held."""
    ram_files.retire(str(root), str(snapshot(root, 5, {"optimizer.pt": ram_files.LARGE})))
    (root / "checkpoint-10").mkdir()
    ram_files.drop(str(root / "checkpoint-10" / "optimizer.pt"))
    assert not (root / ram_files.SPARE / "optimizer.pt").exists()
