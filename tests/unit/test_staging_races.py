"""The trainer stages a step again while the sidecar removes the save of it it uploaded: the
newer staging is never the one removed (both hold the staging lock, commit.staging_lock)."""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from harness.checkpoints import commit, hf_files
from jitckpt_entrypoint.protocol import commit as commit_module
from jitckpt_entrypoint.protocol import locks, validity
from jitckpt_entrypoint.protocol.commit import STAGING_LOCK, remove_checkpoint, staging_lock
from jitckpt_entrypoint.protocol.layout import Layout
from jitckpt_sidecar import staging


def save(root: Path, save_id: str) -> None:
    """Checkpoint-50 saved (again) as `save_id`: the earlier save's files are removed first,
    as a re-save does; its staged links keep their bytes."""
    remove_checkpoint(Layout(str(root)).checkpoint_dir(50))
    commit([root], 50, [hf_files(50, big=4096)], save_id=save_id)


def staged_save(root: Path) -> str:
    found = staging.read(Layout(str(root)).staged_dir(50))
    return found.manifest.save_id if found else ""


def test_a_save_staged_while_the_sidecar_removes_the_uploaded_one_stays_staged(
    tmp_path, monkeypatch
):
    """The trainer's staging of B starts right after the sidecar found A still staged: it
    waits for the lock, so the sidecar removes A, not B (unlocked, it removed B)."""
    save(tmp_path, "save-A")
    uploaded = staging.read(Layout(str(tmp_path)).staged_dir(50))
    assert uploaded is not None
    assert uploaded.manifest.save_id == "save-A"
    real = validity.staged
    trainer: list[threading.Thread] = []
    waiting = threading.Event()

    class Flock:  # fcntl as locks.py sees it: notes when a staging waits for the lock
        def __getattr__(self, name: str) -> Any:
            return getattr(fcntl, name)

        def flock(self, fd: int, op: int) -> None:
            try:
                fcntl.flock(fd, op)
            except BlockingIOError:
                waiting.set()
                raise

    def check_then_restage(path: str, **kwargs: Any) -> Any:
        result = real(path, **kwargs)
        if not trainer:
            trainer.append(threading.Thread(target=save, args=(tmp_path, "save-B")))
            trainer[0].start()
            # Locked, B's staging waits for the lock; unlocked, it is done within these 10 s.
            waiting.wait(timeout=10)
        return result

    monkeypatch.setattr(locks, "fcntl", Flock())
    monkeypatch.setattr(validity, "staged", check_then_restage)
    assert staging.remove(uploaded)
    assert waiting.is_set()
    trainer[0].join(timeout=30)
    monkeypatch.undo()
    assert staged_save(tmp_path) == "save-B"


def test_a_trainer_stuck_on_the_lock_stages_unlocked_and_a_sidecar_leaves_the_directory(
    tmp_path, monkeypatch
):
    """A lock held longer than the trainer waits (a sidecar stuck in its removal) does not
    stop the save: it stages unlocked. A sidecar that cannot get the lock removes nothing."""
    save(tmp_path, "save-A")
    layout = Layout(str(tmp_path))
    uploaded = staging.read(layout.staged_dir(50))
    assert uploaded is not None
    monkeypatch.setattr(commit_module, "STAGE_LOCK_WAIT", 0.05)
    monkeypatch.setattr(staging, "REMOVE_LOCK_WAIT", 0.05)
    fd = os.open(os.path.join(layout.staging, STAGING_LOCK), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process's hold (its own open file)
        assert not staging.remove(uploaded)
        assert staged_save(tmp_path) == "save-A"
        save(tmp_path, "save-B")
        assert staged_save(tmp_path) == "save-B"
    finally:
        os.close(fd)
    again = staging.read(layout.staged_dir(50))
    assert again is not None
    assert staging.remove(again)
    assert staged_save(tmp_path) == ""


def test_without_a_lock_file_the_callers_go_on_as_before(tmp_path):
    with staging_lock(str(tmp_path / "no-such-directory"), 0.01) as held:
        assert held is None
    with staging_lock(str(tmp_path), 0.01) as held:
        assert held is True
        with staging_lock(str(tmp_path), 0.01) as inner:
            assert inner is False  # another open file of the same lock: busy
    with staging_lock(str(tmp_path), 0.01) as held:
        assert held is True


def test_a_child_forked_while_the_lock_is_held_does_not_keep_it(tmp_path):
    """A DataLoader worker forked while the background writer stages shares the lock's open
    file: the lock is released explicitly, not by the close alone."""
    with staging_lock(str(tmp_path), 1.0) as held:
        assert held is True
        child = os.fork()
        if child == 0:  # pragma: no cover - the child only sleeps
            time.sleep(5)
            os._exit(0)
    try:
        with staging_lock(str(tmp_path), 0.5) as again:
            assert again is True
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
