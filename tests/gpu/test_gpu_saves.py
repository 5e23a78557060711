"""The fast save paths with CUDA state (make test-gpu; skipped without a CUDA device).

On the CPU the same code runs with the device copy a memcpy (tests/unit/test_direct_files.py);
here the GPU's own paths: storages streamed from device memory through page-locked chunk
buffers (direct_write), snapshots into exactly-sized page-locked buffers (snapshot.py), and a
real Trainer on the GPU under the entrypoint: async checkpoints equal to the Trainer's own,
a JIT save that streams from the GPU, and a resume equal to the uninterrupted run.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.procs import Proc
from harness.training import TRAIN_HF, entrypoint, hook_lines, torchrun, wait_for_step
from jitckpt_entrypoint.hook import direct_write, safetensors_save, torch_save
from jitckpt_entrypoint.hook.snapshot import Stager, storage_key

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
REPO = Path(__file__).resolve().parents[2]
FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json")


def cuda_optimizer_state() -> dict:
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 128).cuda()
    big = torch.nn.Parameter(torch.randn(direct_write.CHUNK // 2 + 999, device="cuda"))
    opt = torch.optim.AdamW([*layer.parameters(), big])
    for _ in range(2):
        opt.zero_grad()
        (layer(torch.randn(4, 256, device="cuda")).sum() + big.sum()).backward()
        opt.step()
    state = opt.state_dict()
    state["view"] = state["state"][0]["exp_avg"][1:]
    return state


@pytest.mark.parametrize("threads", [1, 4])
def test_optimizer_state_on_the_gpu_is_written_as_torch_save_writes_it(tmp_path, threads):
    state = cuda_optimizer_state()
    torch.save(state, tmp_path / "theirs.pt")
    (tmp_path / "ours").mkdir()
    torch_save.save(state, str(tmp_path / "ours" / "theirs.pt"), threads)
    assert (tmp_path / "ours" / "theirs.pt").read_bytes() == (tmp_path / "theirs.pt").read_bytes()


def test_weights_on_the_gpu_are_written_as_safetensors_writes_them(tmp_path):
    torch.manual_seed(1)
    tensors = {
        "embed": torch.randn(direct_write.CHUNK // 2 + 7, device="cuda"),
        "norm": torch.randn(33, dtype=torch.bfloat16, device="cuda"),
    }
    save_file({k: v.cpu() for k, v in tensors.items()}, tmp_path / "theirs.safetensors")
    safetensors_save.save_file(tensors, str(tmp_path / "ours.safetensors"), None, 4)
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "theirs.safetensors").read_bytes()


def test_a_gpu_snapshot_copies_buffers_before_the_next_forward_into_exact_pinned_memory():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(64).cuda()
    bn(torch.randn(8, 64, device="cuda"))
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    stager = Stager()
    host, staging = stager.plan(bn.state_dict(), {storage_key(p) for p in bn.parameters()})
    staging.start()
    bn(torch.randn(8, 64, device="cuda") * 5)  # the next forward, queued after the copies
    staging.before_update()
    staging.run()
    for name, value in before.items():
        assert torch.equal(host[name], value.cpu()), name
    expected = sum(t.untyped_storage().nbytes() for t in bn.state_dict().values())
    assert stager.nbytes == expected  # no power-of-two rounding
    assert all(t.is_pinned() for t in host.values())


def env_for(jdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITCKPT_")}
    env.update(
        JITCKPT_DIR=str(jdir),
        JITCKPT_TERMINATION_LOG="",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(REPO / "entrypoint"),
    )
    return env


def train(jdir: Path, *args: str, async_save: str = "1") -> Proc:
    jdir.mkdir(exist_ok=True)
    env = {**env_for(jdir), "JITCKPT_ASYNC_SAVE": async_save}
    command = torchrun(TRAIN_HF, "--cuda", "--deterministic", *args, nproc=1)
    return Proc(entrypoint(command), env=env)


def test_async_saves_and_a_jit_save_of_gpu_state_equal_the_trainers_own(tmp_path):
    # One schedule for every run (HF's linear decay spans max_steps): the JIT run stops early.
    args = ("--max-steps", "60", "--save-steps", "5", "--hidden", "256", "--vocab", "4096")
    sync = train(tmp_path / "sync", *args, async_save="0")
    assert sync.wait(timeout=600) == 0, sync.output()
    fast = train(tmp_path / "fast", *args)
    assert fast.wait(timeout=600) == 0, fast.output()
    assert hook_lines(fast, "async: training blocked"), fast.output()
    for step in (5, 10):
        for name in FILES:
            a = tmp_path / "sync" / "checkpoints" / f"checkpoint-{step}" / name
            b = tmp_path / "fast" / "checkpoints" / f"checkpoint-{step}" / name
            assert a.read_bytes() == b.read_bytes(), f"checkpoint-{step}/{name}"

    jit = train(tmp_path / "jit", *args[:2], "--save-steps", "100000", *args[4:])
    try:
        wait_for_step(jit, 12, timeout=300)
        jit.send(signal.SIGTERM)
        assert jit.wait(timeout=300) == 143, jit.output()
    finally:
        jit.kill_tree()
    (line,) = hook_lines(jit, "(jit, ")
    assert re.search(r"big files [\d.]+ s", line), line
    step = int(re.search(r"checkpoint-(\d+)", line).group(1))  # type: ignore[union-attr]
    resumed = train(tmp_path / "jit", *args[:2], "--save-steps", "100000", *args[4:])
    assert resumed.wait(timeout=600) == 0, resumed.output()
    assert f"step={step}" in resumed.output()
    ours = load_file(str(tmp_path / "jit" / "checkpoints" / "checkpoint-60" / "model.safetensors"))
    straight = load_file(
        str(tmp_path / "sync" / "checkpoints" / "checkpoint-60" / "model.safetensors")
    )
    assert ours.keys() == straight.keys()
    assert all(torch.equal(ours[k], straight[k]) for k in ours)
