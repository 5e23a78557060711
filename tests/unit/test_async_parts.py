"""The async save's parts in one process: host snapshots, the background writer, memory budget."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from jitckpt_entrypoint.hook import room, torch_save
from jitckpt_entrypoint.hook.snapshot import (
    Stager,
    UnsupportedStateError,
    keep_location,
    storage_key,
)
from jitckpt_entrypoint.hook.writer import BackgroundWriter, write_files
from jitckpt_entrypoint.protocol import validity
from jitckpt_entrypoint.protocol.durable import sync_tree


def test_a_snapshot_is_the_state_at_the_save_and_keeps_views_and_shared_storages():
    """Copies finish before the update; views, offsets and tied tensors stay as they were."""
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"w": weight, "tied": weight, "row": weight[1], "t": weight.t(), "step": 7}
    stager = Stager()
    host, staging = stager.plan(state)
    staging.start()
    threading.Thread(target=staging.run).start()  # the writer thread's part
    staging.before_update()
    weight.add_(100)  # the optimizer step after the save
    staging.wait()
    assert torch.equal(host["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert host["tied"].untyped_storage().data_ptr() == host["w"].untyped_storage().data_ptr()
    assert torch.equal(host["row"], host["w"][1])
    assert host["row"].storage_offset() == 4
    assert host["t"].stride() == (1, 4)
    assert host["step"] == 7
    assert staging.nbytes == 48


def test_buffers_are_reused_from_one_save_to_the_next():
    weight = torch.zeros(1000)
    stager = Stager()
    first, staging = stager.plan({"w": weight})
    staging.run()
    second, staging = stager.plan({"w": weight})
    staging.run()
    assert first["w"].untyped_storage().data_ptr() == second["w"].untyped_storage().data_ptr()
    assert stager.nbytes == 4000
    # A save of none of the tensors between (a rank that writes them in a node's snapshot
    # only) keeps the buffers while snapshots are taken (`keep`); else they go.
    stager.plan({"step": 3}, keep=True)
    third, _ = stager.plan({"w": weight})
    assert third["w"].untyped_storage().data_ptr() == first["w"].untyped_storage().data_ptr()
    stager.plan({"v": torch.zeros(10)}, keep=True)  # a plan that uses buffers frees the rest
    assert stager.nbytes == 40
    stager.plan({"step": 4})
    assert stager.nbytes == 0


def test_a_tensor_it_cannot_copy_exactly_is_refused():
    with pytest.raises(UnsupportedStateError):
        Stager().plan({"m": torch.empty(3, device="meta")})


def test_a_host_copy_of_gpu_state_is_saved_with_the_gpus_location(tmp_path: Path):
    """A snapshot's optimizer.pt names the device its state came from ("cuda:0"), as the
    Trainer's own torch.save of the live state does (make test-gpu compares the bytes); other
    storages keep theirs, and the tag goes with the buffer."""
    buf = torch.arange(8, dtype=torch.float32).view(torch.uint8).clone()
    keep_location(buf, "cuda:0")
    state = {"exp_avg": torch.empty(0).set_(buf.untyped_storage(), 2, (4,), (1,))}
    state["plain"] = torch.ones(3)
    (tmp_path / "ours").mkdir()
    torch.save(state, tmp_path / "optimizer.pt")
    torch_save.save(state, str(tmp_path / "ours" / "optimizer.pt"), 2)
    ours = (tmp_path / "ours" / "optimizer.pt").read_bytes()
    assert ours == (tmp_path / "optimizer.pt").read_bytes()
    assert b"cuda:0" in ours
    assert b"cpu" in ours
    loaded = torch.load(tmp_path / "optimizer.pt", map_location="cpu")
    assert torch.equal(loaded["exp_avg"], torch.arange(2, 6, dtype=torch.float32))
    del state, buf
    torch.save({"later": torch.zeros(2)}, tmp_path / "later.pt")
    assert b"cuda" not in (tmp_path / "later.pt").read_bytes()


def test_the_writer_runs_jobs_in_order_and_keeps_errors_for_the_caller(tmp_path: Path):
    writer = BackgroundWriter("test-writer")
    seen: list[int] = []

    def failing(job: object) -> None:
        raise OSError("disk full")

    jobs = [writer.submit(lambda _job, i=i: seen.append(i), f"job {i}") for i in range(3)]
    bad = writer.submit(failing, "bad")
    assert all(job.wait(10) for job in [*jobs, bad])
    writer.close()
    assert seen == [0, 1, 2]
    assert isinstance(bad.error, OSError)


def test_parallel_writes_then_one_fsync_pass(tmp_path: Path):
    paths = [tmp_path / "a" / f"f{i}" for i in range(5)]
    (tmp_path / "a").mkdir()
    write_files([lambda p=p: p.write_bytes(b"x" * 100) for p in paths])
    assert sync_tree(str(tmp_path)) == 500


def test_the_memory_budget_is_the_smaller_of_the_node_and_the_cgroup(tmp_path: Path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n")
    assert room.budget(str(tmp_path)) == room.Budget(4_096_000_000, None)
    cg = tmp_path / "sys" / "fs" / "cgroup"
    cg.mkdir(parents=True)
    (cg / "memory.max").write_text("2000000000\n")
    (cg / "memory.current").write_text("1500000000\n")
    (cg / "memory.stat").write_text("anon 1\ninactive_file 500000000\n")
    budget = room.budget(str(tmp_path))
    assert budget == room.Budget(1_000_000_000, 2_000_000_000)  # page cache is reclaimable
    assert budget.fits(750_000_000)
    assert not budget.fits(750_000_001)
    assert budget.describe() == "1.00 GB available (cgroup limit 2.00 GB)"
    (cg / "memory.max").write_text("max\n")
    assert room.budget(str(tmp_path)).limit is None


def manager_with_async(root: Path):
    from jitckpt_entrypoint.config import Config
    from jitckpt_entrypoint.hook.manager import CheckpointManager
    from jitckpt_entrypoint.hook.session import Session
    from jitckpt_entrypoint.hook.topology import Topology

    session = Session(Config(dir=str(root)), Topology(), "run-1")
    session.layout.ensure()
    manager = CheckpointManager(session)
    assert manager.enable_async(1000, None)
    return manager


def async_save(manager, step: int, weight: torch.Tensor, gate: threading.Event) -> None:
    """An async save of {"w": weight} whose big file waits for `gate`, checking for a cancel
    every 10 ms as direct_write does before every chunk."""
    from jitckpt_entrypoint.hook.saves import SaveParts

    def writers(path: str, host: dict, threads: int, check) -> list:
        def write() -> None:
            deadline = time.monotonic() + 10
            while not gate.wait(0.01) and time.monotonic() < deadline:
                check()
            torch.save(host["w"], Path(path, "w.pt"))

        return [write]

    def write_small(path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        Path(path, "small.json").write_text("{}")

    pending = manager.saver.begin_save(step)
    manager.saver.save_async(
        pending, SaveParts(write_small, {"w": weight}, set, writers, lambda: None)
    )


def test_an_async_save_commits_the_state_at_its_step_in_the_background(tmp_path: Path):
    """The snapshot is the step's state, whatever the next update does; the commit comes
    after the files, and the next save drains it (one in flight)."""
    manager = manager_with_async(tmp_path)
    weight = torch.zeros(4)
    gate = threading.Event()
    async_save(manager, 5, weight, gate)
    manager.saved(5)  # the Trainer's on_save: the writer commits, not this call
    manager.before_update()
    weight.add_(1)  # the next optimizer step
    assert validity.committed(manager.checkpoint_dir(5)) is None  # still writing
    gate.set()
    manager.drain()
    assert validity.committed(manager.checkpoint_dir(5)) is not None
    assert torch.equal(torch.load(Path(manager.checkpoint_dir(5), "w.pt")), torch.zeros(4))
    assert manager.is_committed(5)
    assert [step for step, _ in manager.saver.blocking] == [5]


def test_a_failed_training_leaves_a_save_in_flight_to_the_teardown_and_forgets_its_writer(
    tmp_path: Path,
):
    """train() raised while a save is written (its commit may wait for ranks that never
    come): nothing waits for it; the writer and its group are forgotten, so a next training
    builds new ones on every rank, and kept from the garbage collector, whose destructor of a
    group would wait for its work."""
    from jitckpt_entrypoint.hook.control import LEFT_TO_TEARDOWN

    manager = manager_with_async(tmp_path)
    gate = threading.Event()
    async_save(manager, 5, torch.zeros(4), gate)
    inflight = manager.saver.inflight
    save, writer = inflight.save, inflight._writer
    manager.training_started()
    started = time.monotonic()
    manager.training_failed(RuntimeError("a bad batch"))
    assert time.monotonic() - started < 1
    assert (inflight.save, inflight._writer, inflight._control) == (None, None, None)
    assert save in LEFT_TO_TEARDOWN
    assert writer in LEFT_TO_TEARDOWN
    save.job.cancel()  # type: ignore[union-attr]  # this test's clean-up
    gate.set()
    save.ready.set()  # type: ignore[union-attr]
    assert save.job.wait(10)  # type: ignore[union-attr]
    LEFT_TO_TEARDOWN.clear()


def test_a_stop_at_a_newer_step_cancels_the_save_being_written_and_removes_it(tmp_path: Path):
    """The writer stops at its next check (one buffer), not when its file is done; the
    abandoned directory is removed (no rotation slot, no space held)."""
    manager = manager_with_async(tmp_path)
    gate = threading.Event()
    async_save(manager, 5, torch.zeros(4), gate)
    manager.saved(5)
    started = time.monotonic()
    manager.stop_at(7)  # cancels 5, waits for its writer to stop
    assert time.monotonic() - started < 5  # the gate never opened: the check stopped it
    assert not Path(manager.checkpoint_dir(5)).exists()
    assert not manager.is_committed(5)
    assert manager.saver.begin_save(7).kind == "jit"  # type: ignore[union-attr]


def test_a_stop_at_a_newer_step_commits_a_save_that_is_already_written(tmp_path: Path):
    """A save whose files are all written when the stop comes is committed, not thrown away."""
    from jitckpt_entrypoint.hook.saves import SaveParts, State

    manager = manager_with_async(tmp_path)
    written = threading.Event()
    hold = threading.Event()

    def writers(path: str, host: dict, threads: int, check) -> list:
        def write() -> None:
            torch.save(host["w"], Path(path, "w.pt"))
            written.set()
            hold.wait(10)  # written; the commit is still to come

        return [write]

    save = manager.saver.begin_save(5)
    assert save is not None
    manager.saver.save_async(
        save,
        SaveParts(
            lambda p: Path(p).mkdir(parents=True), {"w": torch.ones(2)}, set, writers, lambda: None
        ),
    )
    manager.saved(5)
    assert written.wait(10)
    threading.Timer(0.2, hold.set).start()
    manager.stop_at(7)
    assert save.state is State.COMMITTED
    assert manager.is_committed(5)


def test_a_sigterm_during_an_async_save_that_fails_does_not_claim_a_jit_checkpoint(
    tmp_path: Path,
):
    """SIGTERM arrives during the save of step 5 and its background write fails: step 5 is
    not a JIT checkpoint (no record, no exit); training goes on to stop at the next step."""
    from jitckpt_entrypoint.hook.saves import SaveParts
    from jitckpt_entrypoint.protocol import status

    manager = manager_with_async(tmp_path)
    manager.session.training = True
    manager.session.flag.received_at = time.time()  # what the SIGTERM handler sets

    def writers(path: str, host: dict, threads: int, check) -> list:
        def write() -> None:
            raise OSError(28, "No space left on device")

        return [write]

    pending = manager.saver.begin_save(5)
    manager.saver.save_async(
        pending,
        SaveParts(lambda path: Path(path).mkdir(parents=True), {}, set, writers, lambda: None),
    )
    manager.saved(5)  # would exit the process if it took step 5 for a JIT checkpoint
    assert not manager.is_committed(5)
    assert validity.committed(manager.checkpoint_dir(5)) is None
    assert not Path(manager.session.layout.status, status.JIT.name).exists()
    assert manager.stop_agreed()  # the flag is still set: the next step stops


def test_what_the_next_forward_changes_is_copied_before_the_save_returns():
    """Module buffers (BatchNorm statistics, num_batches_tracked) are copied on the training
    thread; parameters and optimizer state may be copied while the next forward runs."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(4)
    bn.train()
    bn(torch.randn(8, 4))
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    stager = Stager()
    deferrable = {storage_key(p) for p in bn.parameters()}
    host, staging = stager.plan(bn.state_dict(), deferrable)
    staging.start()
    bn(torch.randn(8, 4) * 5)  # the next forward, before the writer thread copies anything
    assert not torch.equal(bn.running_mean, before["running_mean"])
    staging.run()
    for name, value in before.items():
        assert torch.equal(host[name], value), name


def test_an_async_save_of_a_batchnorm_model_holds_the_statistics_of_its_step(tmp_path: Path):
    """The background copy starts late (a busy node): the checkpoint still holds the step's
    running statistics, not the next forward's."""
    from jitckpt_entrypoint.hook.saves import SaveParts
    from jitckpt_entrypoint.hook.snapshot import Staging

    manager = manager_with_async(tmp_path)
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(4)
    bn(torch.randn(8, 4))
    expected = {k: v.clone() for k, v in bn.state_dict().items()}
    go = threading.Event()
    real_run = Staging.run

    def late_run(self, check=None):  # the writer thread gets the CPU only after the forward
        go.wait(10)
        real_run(self, check)

    def writers(path: str, host: dict, threads: int, check) -> list:
        return [lambda: torch.save(host["model"], Path(path, "model.pt"))]

    save = manager.saver.begin_save(5)
    assert save is not None
    Staging.run = late_run  # type: ignore[method-assign]
    try:
        manager.saver.save_async(
            save,
            SaveParts(
                lambda p: Path(p).mkdir(parents=True),
                {"model": bn.state_dict()},
                lambda: {storage_key(p) for p in bn.parameters()},
                writers,
                lambda: None,
            ),
        )
        manager.saved(5)
        bn(torch.randn(8, 4) * 5)  # the next forward
        go.set()
        manager.drain()
    finally:
        Staging.run = real_run  # type: ignore[method-assign]
    saved = torch.load(Path(manager.checkpoint_dir(5), "model.pt"))
    for name, value in expected.items():
        assert torch.equal(saved[name], value), name
