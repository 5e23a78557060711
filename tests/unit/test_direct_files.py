"""The checkpoint files we write ourselves are byte for byte what torch and safetensors write."""

from __future__ import annotations

import errno
import os
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


def test_without_o_direct_the_same_bytes_go_through_the_page_cache(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")  # as tmpfs answers
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    tensors = model_tensors()
    safetensors.torch.save_file(tensors, tmp_path / "theirs.safetensors")
    safetensors_save.save_file(tensors, str(tmp_path / "ours.safetensors"), None, 3)
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "theirs.safetensors").read_bytes()


def test_direct_write_fills_gaps_with_zeros_and_ends_at_the_size(tmp_path: Path):
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
    direct_write._kept.clear()
    direct_write.write(str(tmp_path / "a"), len(data), [(0, data)], 6)
    kept = list(direct_write._kept)
    if not kept:
        pytest.skip(f"{tmp_path} refuses O_DIRECT (tmpfs?): no buffers are used")
    assert 0 < len(kept) <= direct_write.KEEP
    direct_write.write(str(tmp_path / "b"), len(data), [(0, data)], 1)
    assert direct_write._kept[-1] in kept
    assert len(direct_write._kept) <= direct_write.KEEP
    assert (tmp_path / "b").read_bytes() == (tmp_path / "a").read_bytes() == bytes(data)
