"""During training the hook moves DataLoader workers (fork) into their own process group, out
of reach of torchrun's killpg(), and nothing else: a child that calls setsid() (a training
script's `subprocess.Popen(preexec_fn=os.setsid)`, a daemon's fork-and-setsid) works as it
does without jitckpt (it failed with EPERM when every fork was moved)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils import worker

from jitckpt_entrypoint.hook import session as session_module


class Groups(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([os.getpgid(0), os.getsid(0)])


@pytest.fixture
def training(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A session in training, shielding workers afresh; torch's worker loop restored after
    (another test's session may have wrapped it: unwrapped here)."""
    loop = worker._worker_loop
    while getattr(loop, "_jitckpt_session", None) is not None:
        loop = loop.__wrapped__
    monkeypatch.setattr(worker, "_worker_loop", loop)
    monkeypatch.setattr(session_module, "_workers_shielded", False)
    fake = types.SimpleNamespace(training=True, log=logging.getLogger("test"))
    session_module._shield_forked_children(fake)  # type: ignore[arg-type]
    return fake


def test_only_dataloader_workers_leave_the_process_group_during_training(training: Any):
    fake = training
    try:
        loader = DataLoader(Groups(), batch_size=1, num_workers=1, multiprocessing_context="fork")
        pgid, sid = next(iter(loader))[0].tolist()
        assert pgid != os.getpgid(0)  # a worker: its own group (killpg spares it)
        assert sid == os.getsid(0)  # still in the session

        # What a training script may run meanwhile: children that start their own session.
        done = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getsid(0) == os.getpid())"],
            preexec_fn=os.setsid,  # the idiom under test
            capture_output=True,
            text=True,
            check=True,
        )
        assert done.stdout.strip() == "True"
        subprocess.run(["true"], start_new_session=True, preexec_fn=lambda: None, check=True)
        pid = os.fork()
        if pid == 0:  # a daemon's first fork: setsid must work
            try:
                os.setsid()
            except OSError:
                os._exit(1)
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        fake.training = False  # the wrapper stays (one per process): idle from now on

    loader = DataLoader(Groups(), batch_size=1, num_workers=1, multiprocessing_context="fork")
    assert next(iter(loader))[0].tolist()[0] == os.getpgid(0)  # outside training: untouched


def test_spawned_workers_unpickle_the_loop_and_stay_in_the_group(training: Any):
    """spawn pickles the worker loop by name: the wrapper must be found under it."""
    loader = DataLoader(Groups(), batch_size=1, num_workers=1, multiprocessing_context="spawn")
    assert next(iter(loader))[0].tolist()[0] == os.getpgid(0)


def test_a_module_with_its_own_worker_loop_is_wrapped_under_its_own_name(training: Any):
    """torchdata's StatefulDataLoader binds its own `_worker_loop` (accelerate's
    use_stateful_dataloader): wrapped in that module, pickled under that module's name."""
    module = types.ModuleType("stateful_like")
    calls: list[int] = []

    def _worker_loop(*args: Any) -> None:
        calls.append(os.getpgid(0))

    module._worker_loop = _worker_loop  # type: ignore[attr-defined]
    session_module._wrap_worker_loop(training, module)
    wrapped = module._worker_loop  # type: ignore[attr-defined]
    assert wrapped is not _worker_loop
    assert (wrapped.__module__, wrapped.__qualname__) == ("stateful_like", "_worker_loop")
    pid = os.fork()
    if pid == 0:
        wrapped()
        os._exit(0 if calls == [os.getpid()] else 1)  # its own group, led by itself
    assert os.waitpid(pid, 0)[1] == 0
    session_module._wrap_worker_loop(training, module)  # once
    assert module._worker_loop is wrapped  # type: ignore[attr-defined]
