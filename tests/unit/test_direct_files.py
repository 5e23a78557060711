"""The checkpoint files we write ourselves are byte for byte what torch and safetensors write."""

from __future__ import annotations

import errno
import fcntl
import os
import zlib
from pathlib import Path

import pytest
import safetensors.torch
import torch

from jitckpt_entrypoint.hook import direct_write, safetensors_save, torch_save


def optimizer_state() -> dict:
    """A real AdamW state dict, plus the odd cases: a view sharing a storage, an empty tensor,
    a storage bigger than one direct-write chunk."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32)
    big = torch.nn.Parameter(torch.randn(direct_write.CHUNK // 4 + 1000))
    opt = torch.optim.AdamW([*layer.parameters(), big])
    for _ in range(2):
        opt.zero_grad()
        (layer(torch.randn(4, 64)).sum() + big.sum()).backward()
        opt.step()
    state = opt.state_dict()
    state["view"] = state["state"][0]["exp_avg"][1:]
    state["empty"] = torch.empty(0)
    return state


@pytest.mark.parametrize("threads", [1, 4])
def test_torch_save_writes_the_bytes_torch_save_writes(tmp_path: Path, threads: int):
    state = optimizer_state()
    (tmp_path / "torch").mkdir()
    (tmp_path / "ours").mkdir()
    torch.save(state, tmp_path / "torch" / "optimizer.pt")
    torch_save.save(state, str(tmp_path / "ours" / "optimizer.pt"), threads)
    ours = (tmp_path / "ours" / "optimizer.pt").read_bytes()
    assert ours == (tmp_path / "torch" / "optimizer.pt").read_bytes()
    loaded = torch.load(tmp_path / "ours" / "optimizer.pt", weights_only=True)
    assert torch.equal(loaded["state"][2]["exp_avg_sq"], state["state"][2]["exp_avg_sq"])


def test_torch_save_of_a_state_without_tensors_is_torch_save(tmp_path: Path):
    torch_save.save({"lr": 0.1}, str(tmp_path / "x.pt"), 4)
    assert torch.load(tmp_path / "x.pt") == {"lr": 0.1}


def model_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {
        "embed.weight": torch.randn(direct_write.CHUNK // 4 + 17, dtype=torch.float32),
        "norm.weight": torch.randn(33, dtype=torch.bfloat16),
        "head.bias": torch.randn(7, dtype=torch.float16),
        "positions": torch.arange(5),
        "mask": torch.ones(3, dtype=torch.bool),
        "scale": torch.tensor(2.5),
        "none": torch.empty(0, 3),
    }


@pytest.mark.parametrize("threads", [1, 4])
def test_safetensors_save_writes_the_bytes_safetensors_writes(tmp_path: Path, threads: int):
    tensors = model_tensors()
    safetensors.torch.save_file(tensors, tmp_path / "theirs.safetensors", {"format": "pt"})
    target = str(tmp_path / "ours.safetensors")
    safetensors_save.save_file(tensors, target, {"format": "pt"}, threads)
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "theirs.safetensors").read_bytes()


def test_tensors_safetensors_refuses_are_refused_with_its_own_error(tmp_path: Path):
    base = torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="share memory"):
        safetensors_save.save_file({"a": base, "b": base[0]}, str(tmp_path / "x"), None, 2)
    with pytest.raises(ValueError, match="non contiguous"):
        safetensors_save.save_file({"t": base.t()}, str(tmp_path / "x"), None, 2)


@pytest.fixture
def no_direct(monkeypatch):
    """Opens with O_DIRECT refused, as tmpfs refuses them: the page-cache path."""
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_direct)


@pytest.mark.parametrize("threads", [1, 3])
def test_without_o_direct_the_same_bytes_go_through_the_page_cache(tmp_path, no_direct, threads):
    tensors = model_tensors()
    safetensors.torch.save_file(tensors, tmp_path / "theirs.safetensors")
    safetensors_save.save_file(tensors, str(tmp_path / "ours.safetensors"), None, threads)
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "theirs.safetensors").read_bytes()
    state = optimizer_state()
    (tmp_path / "torch").mkdir()
    torch.save(state, tmp_path / "torch" / "optimizer.pt")
    torch_save.save(state, str(tmp_path / "optimizer.pt"), threads)
    ours = (tmp_path / "optimizer.pt").read_bytes()
    assert ours == (tmp_path / "torch" / "optimizer.pt").read_bytes()


def test_without_o_direct_many_small_pieces_in_one_chunk_are_all_written(tmp_path, no_direct):
    """Host pieces go to the kernel as they are (pwritev, at most _IOV at a time), no copy."""
    pieces = [(7 * i, memoryview(bytes([i % 251]) * 5)) for i in range(3 * direct_write._IOV)]
    size = 7 * 3 * direct_write._IOV + 3
    with direct_write.DirectFile(str(tmp_path / "f"), size) as f:
        crcs = f.write(pieces, 1, crc_of=[0, len(pieces) - 1])
    expected = bytearray(size)
    for offset, piece in pieces:
        expected[offset : offset + len(piece)] = piece
    assert (tmp_path / "f").read_bytes() == bytes(expected)
    assert crcs == {0: zlib.crc32(pieces[0][1]), len(pieces) - 1: zlib.crc32(pieces[-1][1])}


@pytest.mark.parametrize("path", ["o_direct", "page_cache"])
def test_direct_write_fills_gaps_with_zeros_and_ends_at_the_size(tmp_path, request, path):
    if path == "page_cache":
        request.getfixturevalue("no_direct")
    size = 2 * direct_write.CHUNK + 123
    pieces = [
        (5, memoryview(b"abc")),
        (direct_write.CHUNK - 2, memoryview(b"across")),
        (size - 4, memoryview(b"tail")),
    ]
    direct_write.write(str(tmp_path / "f"), size, pieces, 3)
    data = (tmp_path / "f").read_bytes()
    expected = bytearray(size)
    for offset, piece in pieces:
        expected[offset : offset + len(piece)] = piece
    assert data == bytes(expected)


def test_direct_write_keeps_its_buffers_for_the_next_file(tmp_path: Path):
    """A background save writes one file after another: the second reuses the first's
    buffer (no fresh memory mapped and faulted in), and at most KEEP stay mapped."""
    data = memoryview(os.urandom(direct_write.CHUNK + 1))
    kept_now = direct_write._Buffer._kept
    kept_now.clear()
    direct_write.write(str(tmp_path / "a"), len(data), [(0, data)], 6)
    kept = list(kept_now)
    if not kept:
        pytest.skip(f"{tmp_path} refuses O_DIRECT (tmpfs?): no buffers are used")
    assert 0 < len(kept) <= direct_write.KEEP
    direct_write.write(str(tmp_path / "b"), len(data), [(0, data)], 1)
    assert kept_now[-1] in kept
    assert len(kept_now) <= direct_write.KEEP
    assert (tmp_path / "b").read_bytes() == (tmp_path / "a").read_bytes() == bytes(data)


def test_torch_save_binds_each_record_to_its_storage_by_identity_not_by_order():
    """The archive's keys are read from its own pickle: a torch that numbered the storages in
    another order (here: backwards) still gets each record filled from the right storage."""
    import io
    import pickle

    a, b = torch.full((4,), 1.0), torch.full((4,), 2.0)  # same size: order is all that differs
    state = {"exp_avg": a, "exp_avg_sq": b, "view": a[1:]}
    storages = [a.untyped_storage(), b.untyped_storage()]

    class Backwards(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, torch.storage.TypedStorage):
                key = str(1 - [s._cdata for s in storages].index(obj._untyped_storage._cdata))
                storage_type = getattr(torch, obj._pickle_storage_type())
                return ("storage", storage_type, key, "cpu", obj._size())
            return None

    data = io.BytesIO()
    Backwards(data, protocol=2).dump(state)
    keys = torch_save._bind(data.getvalue(), state)
    assert keys["1"]._cdata == a.untyped_storage()._cdata
    assert keys["0"]._cdata == b.untyped_storage()._cdata


class Holder:
    def __init__(self) -> None:
        self.t = torch.arange(6.0)


def test_torch_save_falls_back_to_torch_save_for_a_state_it_cannot_walk(tmp_path: Path):
    """Tensors inside an object (not a dict, list or tuple) cannot be bound to their records:
    plain torch.save writes the file."""
    state = {"holder": Holder(), "t": torch.ones(3)}
    torch_save.save(state, str(tmp_path / "ours.pt"), 2)
    loaded = torch.load(tmp_path / "ours.pt", weights_only=False)
    assert torch.equal(loaded["holder"].t, torch.arange(6.0))


@pytest.mark.parametrize("path", ["o_direct", "page_cache"])
def test_direct_write_streams_tensor_sources_and_takes_their_crcs(tmp_path, request, path):
    """Tensor sources (how GPU state is streamed; on the CPU the copy is a memcpy, or none
    through the page cache) land at their offsets, and each piece's CRC-32 is combined across
    chunks."""
    if path == "page_cache":
        request.getfixturevalue("no_direct")
    big = torch.randint(0, 255, (direct_write.CHUNK * 2 + 777,), dtype=torch.uint8)
    small = torch.arange(100, dtype=torch.uint8)
    header = memoryview(b"HEAD")
    size = 4 + len(small) + len(big) + 10
    pieces = [(0, header), (4, small), (4 + len(small), big)]
    with direct_write.DirectFile(str(tmp_path / "f"), size) as f:
        crcs = f.write(pieces, 3, crc_of=[1, 2])
    data = (tmp_path / "f").read_bytes()
    assert data == b"HEAD" + small.numpy().tobytes() + big.numpy().tobytes() + bytes(10)
    assert crcs == {1: zlib.crc32(small.numpy()), 2: zlib.crc32(big.numpy())}


def test_crc32_combine_in_python_is_zlibs(monkeypatch):
    monkeypatch.setattr(direct_write, "_LIBZ", None)
    a, b = os.urandom(1000), os.urandom(direct_write.CHUNK + 5)
    combined = direct_write.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b))
    assert combined == zlib.crc32(a + b)


def test_a_cancel_stops_a_write_within_one_chunk(tmp_path: Path):
    calls = []

    class CancelledError(Exception):
        pass

    def check() -> None:
        calls.append(1)
        if len(calls) > 2:
            raise CancelledError

    data = memoryview(bytes(direct_write.CHUNK * 6))
    with pytest.raises(CancelledError):
        direct_write.write(str(tmp_path / "f"), len(data), [(0, data)], 1, check)
    assert len(calls) == 3


def test_einval_from_an_o_direct_write_on_a_full_disk_is_enospc(tmp_path: Path, monkeypatch):
    """Some file systems answer a full disk with EINVAL to O_DIRECT writes: not taken for
    "O_DIRECT unsupported" (writing it all again through the page cache), but for ENOSPC."""
    real_pwrite, direct = os.pwrite, []

    def pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            direct.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    class Full:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "statvfs", lambda _path: Full())
    data = memoryview(bytes(direct_write.CHUNK))
    with pytest.raises(OSError, match="No space left") as raised:
        direct_write.write(str(tmp_path / "f"), len(data), [(0, data)], 1)
    if not direct:
        pytest.skip(f"{tmp_path} refuses O_DIRECT (tmpfs?)")
    assert raised.value.errno == errno.ENOSPC


def test_an_empty_storage_next_to_a_header_at_a_chunk_boundary_leaves_the_header_whole(
    tmp_path: Path,
):
    """An empty storage shares its offset with the record that follows it; that record's
    header must not be taken for the empty piece's place and zero-filled."""
    for n in (8387776, direct_write.CHUNK - 64):
        obj = {
            "state": {
                0: {
                    "a": torch.zeros(n, dtype=torch.uint8),
                    "z": torch.empty(0),
                    "b": torch.full((100000,), 7.0),
                }
            },
            "param_groups": [{"params": [0]}],
        }
        for side in ("torch", "ours"):
            (tmp_path / side).mkdir(exist_ok=True)
        torch.save(obj, tmp_path / "torch" / "x.pt")  # the archive is named for the file
        torch_save.save(obj, str(tmp_path / "ours" / "x.pt"), 2)
        ours = (tmp_path / "ours" / "x.pt").read_bytes()
        assert ours == (tmp_path / "torch" / "x.pt").read_bytes(), n


def test_safetensors_names_and_metadata_beyond_ascii_are_written_as_safetensors_does(
    tmp_path: Path,
):
    tensors = {"wörter.ü": torch.ones(3), "del\x7f": torch.zeros(2, dtype=torch.bfloat16)}
    meta = {"note": "ünïcode"}  # one key: safetensors orders several by a hash seeded per process
    safetensors.torch.save_file(tensors, tmp_path / "theirs.safetensors", meta)
    safetensors_save.save_file(tensors, str(tmp_path / "ours.safetensors"), meta, 2)
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "theirs.safetensors").read_bytes()


def test_packed_sub_byte_dtypes_go_to_safetensors_itself(tmp_path: Path):
    packed = torch.zeros(2, 3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    safetensors.torch.save_file({"x": packed}, tmp_path / "theirs.safetensors")
    safetensors_save.save_file({"x": packed}, str(tmp_path / "ours.safetensors"), None, 2)
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "theirs.safetensors").read_bytes()


def test_without_o_direct_a_strided_tensor_source_goes_through_the_buffer(tmp_path, no_direct):
    source = torch.arange(3000, dtype=torch.int32).to(torch.uint8)[::3]
    with direct_write.DirectFile(str(tmp_path / "f"), len(source) + 2) as f:
        crcs = f.write([(2, source)], 1, crc_of=[0])
    assert (tmp_path / "f").read_bytes() == bytes(2) + source.contiguous().numpy().tobytes()
    assert crcs == {0: zlib.crc32(source.contiguous().numpy())}
