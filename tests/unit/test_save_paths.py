"""Every save path's failures, in one process: the manager never lets a fast path's error into
training, removes what it abandons, reports a full disk in one line, and falls back to the
library's own save."""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from jitckpt_entrypoint.config import Config
from jitckpt_entrypoint.hook import gates, room
from jitckpt_entrypoint.hook.manager import CheckpointManager
from jitckpt_entrypoint.hook.saves import SaveParts, State
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.hook.topology import Topology
from jitckpt_entrypoint.protocol import validity

ENOSPC = OSError(errno.ENOSPC, "No space left on device")


class ExitedError(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def manager(root: Path, async_save: bool = True) -> CheckpointManager:
    session = Session(Config(dir=str(root), async_save=async_save), Topology(), "run-1")
    session.layout.ensure()

    def leave(code: int) -> Any:
        raise ExitedError(code)

    session.exit = leave  # type: ignore[method-assign]  # os._exit would end the test run
    made = CheckpointManager(session)
    made.enable_async(1000, None)
    return made


def small(path: str) -> None:
    Path(path).mkdir(parents=True, exist_ok=True)
    Path(path, "trainer_state.json").write_text("{}")


def parts(writers: Any) -> SaveParts:
    return SaveParts(small, {"w": torch.ones(4)}, set, writers, lambda: None)


def async_save(m: CheckpointManager, step: int, writers: Any) -> Any:
    """An async save of `step` written by `writers`, handed over (on_save) and drained."""
    save = m.saver.begin_save(step)
    assert save is not None
    m.saver.save_async(save, parts(writers))
    m.saved(step)
    m.drain()
    return save


def failing(exc: BaseException) -> Any:
    def writers(path: str, host: dict, threads: int, check: Any) -> list:
        def write() -> None:
            Path(path, "optimizer.pt").write_bytes(b"partial")
            raise exc

        return [write]

    return writers


def test_a_trainers_own_save_on_a_full_disk_is_named_and_its_error_stays_its_own(
    tmp_path, hook_log
):
    """ENOSPC from the Trainer's own save: one line (volume, bytes needed, bytes free), then the
    library's own error, as without jitckpt (its collectives may be half done on other ranks);
    the rerun's resume removes the partial directory."""
    m = manager(tmp_path, async_save=False)
    save = m.saver.begin_save(5)
    assert save is not None

    def write() -> None:
        small(save.path)
        raise ENOSPC

    with pytest.raises(OSError, match="No space left"):
        m.saver.write_own(save, write)
    (line,) = [x for x in hook_log if "no space left" in x]
    assert "checkpoint-5 not saved: no space left on /" in line
    assert "free); free space on the volume" in line
    assert Path(m.checkpoint_dir(5)).exists()
    rerun = manager(tmp_path, async_save=False)
    rerun.session.control  # noqa: B018 - one process: no collective
    assert rerun.resume() is None
    assert not Path(m.checkpoint_dir(5)).exists()


def test_any_other_error_of_the_trainers_own_save_is_the_librarys_own(tmp_path, hook_log):
    m = manager(tmp_path, async_save=False)
    save = m.saver.begin_save(5)
    assert save is not None
    with pytest.raises(ValueError, match="the library's"):
        m.saver.write_own(save, lambda: (_ for _ in ()).throw(ValueError("the library's")))
    assert not [x for x in hook_log if "no space left" in x]


def test_an_async_save_that_fails_is_removed_and_the_fast_paths_turn_off(tmp_path, hook_log):
    m = manager(tmp_path)
    save = async_save(m, 5, failing(RuntimeError("a bug in a fast path")))
    assert save.state is State.ABANDONED
    assert not Path(m.checkpoint_dir(5)).exists()
    assert not m.saver.async_on
    err = "\n".join(hook_log)
    assert "checkpoint-5 not saved: a bug in a fast path" in err
    assert "the Trainer's own save from now on: a fast save of checkpoint-5 failed" in err


def test_an_async_save_on_a_full_disk_keeps_the_fast_paths(tmp_path, hook_log):
    m = manager(tmp_path)
    save = async_save(m, 5, failing(ENOSPC))
    assert save.state is State.ABANDONED
    assert not Path(m.checkpoint_dir(5)).exists()
    assert m.saver.async_on
    assert "checkpoint-5 not saved: no space left on" in "\n".join(hook_log)


def test_an_exception_on_the_training_thread_part_of_an_async_save_never_reaches_training(
    tmp_path,
):
    m = manager(tmp_path)
    save = m.saver.begin_save(5)
    assert save is not None

    def broken_small(path: str) -> None:
        raise RuntimeError("cannot write the trainer state")

    m.saver.save_async(
        save, SaveParts(broken_small, {"w": torch.ones(2)}, set, failing(ENOSPC), dict)
    )
    m.saved(5)
    m.drain()
    assert save.state is State.ABANDONED
    assert not m.is_committed(5)


def test_a_jit_save_whose_fast_writer_fails_is_written_by_the_trainers_own_save(tmp_path):
    """The JIT checkpoint must not be lost to a fast path: the Trainer's own save writes it
    again, and the process exits with the JIT code once it is committed."""
    m = manager(tmp_path)
    m.session.training = True
    m.stop_at(7)
    save = m.saver.begin_save(7)
    assert save is not None
    assert save.kind == "jit"
    own_calls = []

    def own() -> None:
        own_calls.append(1)
        small(save.path)
        Path(save.path, "optimizer.pt").write_bytes(b"whole")

    m.saver.save_now(save, parts(failing(RuntimeError("fast writer broke"))), own)
    with pytest.raises(ExitedError) as exited:
        m.saved(7)
    assert exited.value.code == m.session.cfg.exit_code
    assert own_calls == [1]
    assert validity.committed(m.checkpoint_dir(7)) is not None
    assert Path(m.checkpoint_dir(7), "optimizer.pt").read_bytes() == b"whole"


def test_a_jit_save_frees_uncommitted_directories_when_the_disk_is_short(tmp_path, monkeypatch):
    m = manager(tmp_path)
    for step in (3, 4):
        Path(m.checkpoint_dir(step)).mkdir()
        Path(m.checkpoint_dir(step), "optimizer.pt").write_bytes(b"x" * 100)
    monkeypatch.setattr(room, "free_bytes", lambda _path: 10)
    m.saver._expected_bytes = 1000
    m.stop_at(7)
    assert not Path(m.checkpoint_dir(3)).exists()
    assert not Path(m.checkpoint_dir(4)).exists()


class Holder:
    def __init__(self) -> None:
        self.t = torch.ones(1)


def test_a_state_the_fast_paths_do_not_cover_is_named():
    class Quantized(torch.Tensor):
        pass

    plain = {"model": {"w": torch.ones(2)}, "optimizer": {"state": {0: {"step": 3}}}}
    assert gates.state_problem(plain) is None
    sub = {"optimizer": {"state": {0: {"exp_avg": torch.ones(2).as_subclass(Quantized)}}}}
    assert "Quantized" in str(gates.state_problem(sub))
    assert "meta" in str(gates.state_problem({"m": torch.empty(2, device="meta")}))
    assert "holds tensors inside a Holder" in str(gates.state_problem({"o": Holder()}))


def test_versions_outside_the_tested_range_turn_the_fast_paths_off(monkeypatch):
    import sys
    import types

    assert gates.version_problem() is None  # this venv is tested
    fake = types.ModuleType("transformers")
    fake.__version__ = "6.0.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", fake)
    assert "transformers 6.0.0 is newer than the newest tested" in str(gates.version_problem())
    fake.__version__ = "4.40.2"  # type: ignore[attr-defined]
    assert "older than the oldest tested" in str(gates.version_problem())


def test_the_snapshots_of_a_nodes_local_ranks_add_up():
    budget = room.Budget(1_000_000_000, None)
    ranks = [(0, 300_000_000, budget), (0, 300_000_000, budget), (1, 300_000_000, budget)]
    assert room.short_node(ranks) is None
    ranks.append((0, 300_000_000, budget))  # a third rank on node 0: 900 MB > 75% of 1 GB
    assert "node 0's ranks need 900.0 MB" in str(room.short_node(ranks))


def test_the_writer_thread_and_the_training_thread_share_a_save_only_under_the_lock(tmp_path):
    """States move planned -> staged -> written -> committed for an async save."""
    m = manager(tmp_path)
    seen: list[State] = []
    gate = threading.Event()
    save = m.saver.begin_save(5)
    assert save is not None

    def writers(path: str, host: dict, threads: int, check: Any) -> list:
        def write() -> None:
            seen.append(save.state)
            gate.wait(10)
            torch.save(host["w"], Path(path, "w.pt"))

        return [write]

    assert save.state is State.PLANNED
    m.saver.save_async(save, parts(writers))
    m.saved(5)
    gate.set()
    m.drain()
    assert seen == [State.STAGED]
    assert save.state is State.COMMITTED


def test_a_serializers_own_error_on_a_full_disk_counts_as_a_full_disk(tmp_path, monkeypatch):
    """torch's zip writer says "file write failed" and safetensors its own error, no ENOSPC:
    in a fast path, with (almost) no space left on the volume that is a full disk (the fast
    paths stay on); with space left it is a failure (they turn off)."""
    m = manager(tmp_path)
    error = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    monkeypatch.setattr(room, "free_bytes", lambda _path: 4096)
    save = async_save(m, 5, failing(error))
    assert save.outcome == "disk full"
    assert m.saver.async_on
    monkeypatch.undo()
    save = async_save(m, 10, failing(error))
    assert save.outcome == "failed"
    assert not m.saver.async_on


def test_the_last_step_is_saved_and_committed_before_the_best_model_is_loaded(
    tmp_path, monkeypatch
):
    """HF loads the best checkpoint after the training loop, before on_train_end: the last
    step is saved there first, unless committed (training_ending drains the save in flight
    and saves what is not), so no copy of it ever sees the best model's weights."""
    import types

    import transformers

    from jitckpt_entrypoint.hook import manager as manager_module
    from jitckpt_entrypoint.hook import trainer as trainer_hook

    m = manager(tmp_path)
    monkeypatch.setattr(manager_module, "_current", m)
    order: list[str] = []
    monkeypatch.setattr(m, "training_ending", lambda step, _save: order.append(f"end {step}"))

    class Trainer(transformers.Trainer):  # a subclass: the real class stays unpatched
        def _load_best_model(self) -> None:
            order.append("load best")

    trainer_hook.patch(types.SimpleNamespace(Trainer=Trainer, TrainingArguments=None))
    trainer = object.__new__(Trainer)
    trainer.state = types.SimpleNamespace(global_step=7, best_model_checkpoint=None)
    Trainer._load_best_model(trainer)
    assert order == ["end 7", "load best"]


def test_training_ends_once_per_train_on_each_rank(tmp_path):
    """HF calls `_load_best_model` (which ends training first) only on ranks that hold the
    best checkpoint: the rest end at on_train_end, so each rank must end once (the rounds
    match); and a final save that failed there is not tried again once the best model's
    weights replaced the step's own."""
    m = manager(tmp_path)
    m.training_started()
    tries: list[int] = []
    m.training_ending(24, lambda: tries.append(24))  # the save fails: nothing committed
    m.training_ending(24, lambda: tries.append(24))  # on_train_end, after the best is loaded
    assert tries == [24]
    assert not m.is_committed(24)
    m.training_ended()
    m.training_started()  # a second train(): it ends afresh
    m.training_ending(30, lambda: tries.append(30))
    assert tries == [24, 30]


def test_parameters_an_optimizer_swaps_outside_its_step_are_copied_before_the_next_forward():
    """Schedule-free optimizers swap the parameters in `train()`, which the Trainer calls
    before the next forward: those parameters are not deferred to the background copy; the
    optimizer state still is. A plain optimizer's parameters are."""
    import types

    from integration.children.train_hf import tiny_llama
    from jitckpt_entrypoint.hook.snapshot import storage_key
    from jitckpt_entrypoint.hook.trainer_checkpoint import TrainerCheckpoint

    model = tiny_llama(16, 8, 1)
    params = {storage_key(p) for p in model.parameters()}
    moment = torch.zeros(3)

    class ScheduleFree(torch.optim.SGD):
        def train(self) -> None: ...

    for cls, deferred_params in ((torch.optim.SGD, True), (ScheduleFree, False)):
        optimizer = cls(model.parameters(), lr=0.1)
        optimizer.state[next(model.parameters())] = {"z": moment}
        trainer = types.SimpleNamespace(
            model=model, optimizer=optimizer, _get_output_dir=lambda **_: "/nowhere"
        )
        keys = TrainerCheckpoint(trainer).deferrable()
        assert storage_key(moment) in keys
        assert (params <= keys) is deferred_params, cls.__name__


def test_files_written_after_the_save_call_are_in_the_async_commit(tmp_path):
    """A Trainer subclass (TRL's GRPO) or an on_save callback may write into the checkpoint
    after the Trainer's save call returns: the background commit waits for the training
    thread to be done with the directory, so the manifest lists them."""
    import json

    m = manager(tmp_path)
    save = m.saver.begin_save(5)
    assert save is not None
    m.saver.save_async(save, parts(lambda *_: []))
    Path(save.path, "entropy_ctrl_state.json").write_text("{}")  # after the save call
    m.saved(5)
    m.drain()
    assert save.state is State.COMMITTED
    manifest = json.loads(Path(save.path, "jitckpt-manifest.node-0.json").read_text())
    assert "entropy_ctrl_state.json" in {f["path"] for f in manifest["files"]}


def test_a_snapshot_that_cannot_start_abandons_the_save_and_never_holds_training(
    tmp_path, monkeypatch
):
    from jitckpt_entrypoint.hook.snapshot import Staging

    def broken(self: Any) -> None:
        raise RuntimeError("cannot queue the copies")

    monkeypatch.setattr(Staging, "start", broken)
    m = manager(tmp_path)
    save = m.saver.begin_save(5)
    assert save is not None
    m.saver.save_async(save, parts(lambda *_: []))
    m.saved(5)
    m.before_update()  # the next optimizer step: nothing to wait for
    m.drain()
    assert save.state is State.ABANDONED
