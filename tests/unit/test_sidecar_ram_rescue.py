"""A trainer container that died whole, as the sidecar tells it (protocol/trainer_lock.py) and
what it then does (ram_rescue.py): the newest snapshot in RAM written out, once, never for a
trainer that lives, exited or never said it holds the lock."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from jitckpt_entrypoint import cli
from jitckpt_entrypoint.config import Config
from jitckpt_entrypoint.protocol import commit, status, trainer_lock, validity
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.layout import Layout
from jitckpt_sidecar.ram_rescue import RamRescue


def committed_save(layout: Layout, step: int, *, save_id: str) -> str:
    """A committed checkpoint of `step` under `layout` (the volume, or the memory directory)."""
    path = layout.checkpoint_dir(step)
    os.makedirs(path)
    Path(path, "model.safetensors").write_bytes(bytes([step]) * 100)
    commit.commit_node(
        layout,
        path,
        {0: m.list_files(path)},
        node=0,
        nodes=1,
        world_size=2,
        step=step,
        kind="periodic",
        started_at=time.time(),
        run_id="run-1",
        stage_for_upload=False,
        save_id=save_id,
        lineage="lineage-1",
        record=False,
    )
    return path


def started(layout: Layout, **fields: object) -> status.TrainerStatus:
    record = status.TrainerStatus("run-1", 1, ("torchrun",), started_at=time.time(), locked=True)
    record = dataclasses.replace(record, **fields)  # type: ignore[arg-type]
    status.TRAINER.write(layout.status, record)
    return record


def finished(rescue: RamRescue) -> None:
    deadline = time.monotonic() + 10
    while rescue.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not rescue.pending()


def test_the_lock_tells_a_live_trainer_from_one_gone_and_a_start_waits_for_the_sidecar(tmp_path):
    where = str(tmp_path)
    assert trainer_lock.take_if_gone(where) is None  # no entrypoint ever ran here
    held = trainer_lock.hold(where, 0.0, lambda: None)
    assert held is not None
    assert trainer_lock.take_if_gone(where) is None  # it lives
    os.close(held)  # it died (the kernel drops the lock however it ends)
    sidecar = trainer_lock.take_if_gone(where)
    assert sidecar is not None
    waited = []
    begun = time.monotonic()
    assert trainer_lock.hold(where, 0.3, lambda: waited.append(1)) is None  # patience spent
    assert waited == [1]
    assert time.monotonic() - begun >= 0.3
    begun = time.monotonic()
    assert trainer_lock.hold(where, 30.0, lambda: None, give_up=lambda: True) is None  # SIGTERM
    assert time.monotonic() - begun < 5
    os.close(sidecar)
    again = trainer_lock.hold(where, 0.0, lambda: None)
    assert again is not None
    os.close(again)


def test_a_process_that_registers_with_the_entrypoint_holds_the_lock_for_life(tmp_path):
    where = str(tmp_path)
    code = (
        "import sys, time; from jitckpt_entrypoint.protocol import registry; "
        "registry.register(sys.argv[1], 'run-1', 'trainer'); print('in', flush=True); "
        "time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code, where], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "in"
        assert trainer_lock.take_if_gone(where) is None  # a training process lives
    finally:
        child.kill()
        child.wait()
    gone = trainer_lock.take_if_gone(where)
    assert gone is not None
    os.close(gone)


def test_a_record_with_the_lock_reads_back_and_an_older_one_never_says_locked(tmp_path):
    record = status.TrainerStatus("r", 1, ("x",), started_at=1.0, locked=True)
    status.TRAINER.write(str(tmp_path), record)
    assert status.TRAINER.read(str(tmp_path)) == record
    Path(tmp_path, "trainer.json").write_text(
        '{"run_id": "r", "pid": 1, "command": ["x"], "started_at": 1.0}'
    )
    read = status.TRAINER.read(str(tmp_path))
    assert read is not None
    assert not read.locked


def test_a_dead_trainers_newest_snapshot_is_written_out_once_over_a_save_cut_short(tmp_path):
    volume, memory = Layout(str(tmp_path / "volume")), Layout(str(tmp_path / "memory"))
    volume.ensure()
    committed_save(volume, 10, save_id="volume-10")
    committed_save(memory, 10, save_id="volume-10")
    committed_save(memory, 12, save_id="ram-12")
    torn = Path(volume.checkpoint_dir(12))  # the periodic save of 12, killed mid-write
    torn.mkdir()
    (torn / "optimizer.pt").write_bytes(b"torn")
    rescue = RamRescue(memory.root, volume, logging.getLogger("jitckpt.test"), lambda: None)

    alive = trainer_lock.hold(volume.status, 0.0, lambda: None)
    record = started(volume)
    assert not rescue.dead(record)  # the entrypoint holds the lock
    assert alive is not None
    os.close(alive)
    assert not rescue.dead(dataclasses.replace(record, locked=False))  # not told: not trusted
    assert rescue.dead(record)
    finished(rescue)

    written = validity.committed(str(torn))
    assert written is not None
    assert written[0].save_id == "ram-12"
    assert not (torn / "optimizer.pt").exists()  # only the snapshot's files
    assert (torn / "model.safetensors").read_bytes() == bytes([12]) * 100
    assert validity.staged(volume.staged_dir(12)) is not None  # for the upload
    assert trainer_lock.take_if_gone(volume.status) is not None  # let go after the write
    assert rescue.dead(record)  # the same run stays dead, and is not written out again
    assert not rescue.pending()


def test_a_trainer_that_exited_meanwhile_or_without_a_memory_directory(tmp_path):
    volume = Layout(str(tmp_path / "volume"))
    volume.ensure()
    lock = trainer_lock.hold(volume.status, 0.0, lambda: None)
    assert lock is not None
    os.close(lock)  # the lock file is there, nobody holds it
    logger = logging.getLogger("jitckpt.test")
    record = started(volume)
    started(volume, exited_at=time.time(), exit_code=0)  # it exited after we read it
    rescue = RamRescue(str(tmp_path / "memory"), volume, logger, lambda: None)
    assert not rescue.dead(record)
    assert not rescue.dead(status.TRAINER.read(volume.status))
    record = started(volume, run_id="run-2")
    plain = RamRescue("", volume, logger, lambda: None)  # no JITCKPT_MEMORY_DIR: nothing to write
    assert plain.dead(record)
    assert not plain.pending()


def test_an_entrypoint_waiting_for_the_sidecar_stops_at_sigterm(tmp_path):
    """PID 1 would drop a SIGTERM that has no handler: while it waits for the lock, it has one,
    and it gives up starting the training command."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    created = trainer_lock.hold(layout.status, 0.0, lambda: None)  # the lock file
    assert created is not None
    os.close(created)
    sidecar = trainer_lock.take_if_gone(layout.status)
    assert sidecar is not None
    cfg = Config(dir=str(tmp_path), grace_seconds=30)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    before = signal.getsignal(signal.SIGTERM)
    timer.start()
    try:
        begun = time.monotonic()
        lock, stopped = cli.hold_trainer_lock(cfg, layout, logging.getLogger("jitckpt.test"))
    finally:
        timer.join()
        os.close(sidecar)
    assert (lock, stopped) == (None, True)
    assert time.monotonic() - begun < 10
    assert signal.getsignal(signal.SIGTERM) == before  # restored
    lock, stopped = cli.hold_trainer_lock(cfg, layout, logging.getLogger("jitckpt.test"))
    assert lock is not None
    assert not stopped
    os.close(lock)


def test_a_restore_keeps_the_record_of_a_trainer_that_holds_its_lock(tmp_path):
    """`jitckpt-sidecar restore` (an init container: before every container of its pod) removes
    an earlier pod's trainer.json, never the record of a trainer alive beside it."""
    from jitckpt_sidecar.cli import _forget_earlier_trainer

    layout = Layout(str(tmp_path))
    layout.ensure()
    started(layout)
    held = trainer_lock.hold(layout.status, 5.0, lambda: None)
    assert held is not None
    _forget_earlier_trainer(layout, logging.getLogger("test"))
    assert status.TRAINER.read(layout.status) is not None
    os.close(held)
    _forget_earlier_trainer(layout, logging.getLogger("test"))
    assert status.TRAINER.read(layout.status) is None
    again = trainer_lock.take_if_gone(layout.status)  # let go again
    assert again is not None
    os.close(again)
    started(layout, locked=False)  # an older entrypoint's, which may live: not ours to judge
    _forget_earlier_trainer(layout, logging.getLogger("test"))
    assert status.TRAINER.read(layout.status) is not None
