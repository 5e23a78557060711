"""The save pipeline's one entry (saver.save_step): what it decides for each request, in one
process, and that every decision ends committed (or the library's own save, as without
jitckpt)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from test_save_paths import ExitedError, manager, small

from jitckpt_entrypoint.hook.manager import CheckpointManager
from jitckpt_entrypoint.hook.saves import SaveParts, SaveRequest, Staged
from jitckpt_entrypoint.protocol import validity


class Calls:
    """What a request's callables were asked to do, in order."""

    def __init__(self, m: CheckpointManager, step: int) -> None:
        self.m, self.step, self.seen = m, step, []
        self.path = m.checkpoint_dir(step)

    def own(self) -> None:
        self.seen.append("own")
        small(self.path)
        Path(self.path, "optimizer.pt").write_bytes(b"own")

    def parts(self, problem: Any = None, raises: bool = False) -> Any:
        def make() -> tuple[SaveParts, Any]:
            self.seen.append("parts")
            if raises:
                raise RuntimeError("the state is not readable")

            def writers(path: str, tensors: dict, threads: int, check: Any) -> list:
                def write() -> None:
                    self.seen.append(f"fast on {threading.current_thread().name}")
                    Path(path, "optimizer.pt").write_bytes(b"fast")

                return [write]

            after = lambda: self.seen.append("after_commit")  # noqa: E731
            return SaveParts(small, {"w": torch.ones(2)}, set, writers, after), problem

        return make


def committed(m: CheckpointManager, step: int) -> bytes:
    assert m.is_committed(step)
    assert validity.committed(m.checkpoint_dir(step)) is not None
    return Path(m.checkpoint_dir(step), "optimizer.pt").read_bytes()


def test_a_periodic_save_with_parts_is_written_in_the_background(tmp_path):
    m = manager(tmp_path)
    calls = Calls(m, 5)
    m.save_step(SaveRequest(5, calls.own, parts=calls.parts()))
    m.saved(5)
    m.drain()
    assert committed(m, 5) == b"fast"
    assert calls.seen == ["parts", "fast on jitckpt-writer", "after_commit"]
    assert [step for step, _ in m.saver.blocking] == [5]


def test_a_final_save_with_parts_is_written_now_on_the_training_thread(tmp_path):
    m = manager(tmp_path)
    assert m.last_step(6)
    calls = Calls(m, 6)
    m.save_step(SaveRequest(6, calls.own, parts=calls.parts()))
    m.saved(6)
    assert committed(m, 6) == b"fast"
    assert calls.seen == ["parts", f"fast on {threading.current_thread().name}", "after_commit"]
    assert m.saver.blocking == []  # not an async save


@pytest.mark.parametrize("why", ["a problem", "unreadable"])
def test_a_state_the_fast_path_cannot_take_is_the_librarys_own_save_from_then_on(
    tmp_path, hook_log, why
):
    m = manager(tmp_path)
    calls = Calls(m, 7)
    parts = calls.parts(raises=True) if why == "unreadable" else calls.parts("a tensor subclass")
    m.save_step(SaveRequest(7, calls.own, parts=parts))
    m.saved(7)
    assert committed(m, 7) == b"own"
    assert calls.seen == ["parts", "own"]
    assert not m.saver.async_on
    said = [line for line in hook_log if "the Trainer's own save from now on" in line]
    assert len(said) == 1
    assert ("cannot read the state" if why == "unreadable" else "a tensor subclass") in said[0]
    later = Calls(m, 8)
    m.save_step(SaveRequest(8, later.own, parts=later.parts()))
    assert later.seen == ["own"]  # no probe: off for the rest of the run


def test_a_committed_step_is_not_written_again(tmp_path):
    m = manager(tmp_path)
    first = Calls(m, 9)
    m.save_step(SaveRequest(9, first.own))
    m.saved(9)
    again = Calls(m, 9)
    m.save_step(SaveRequest(9, again.own, parts=again.parts()))
    m.saved(9)
    assert again.seen == []
    assert committed(m, 9) == b"own"


def test_without_async_saves_every_request_is_the_librarys_own(tmp_path):
    m = manager(tmp_path, async_save=False)
    calls = Calls(m, 3)
    m.save_step(SaveRequest(3, calls.own, parts=calls.parts()))
    m.saved(3)
    assert calls.seen == ["own"]
    assert committed(m, 3) == b"own"


@pytest.mark.parametrize("staged", [True, False])
def test_a_staged_request_is_written_later_or_at_once_when_a_rank_could_not_stage(tmp_path, staged):
    """FSDP's periodic saves: the own save runs with its big writes deferred; they are written
    by the background writer, or at once (and HF's rotation at once, where its own save runs
    it) when any rank could not stage."""
    m = manager(tmp_path)
    calls = Calls(m, 4)

    def stage(write_own: Any) -> Staged:
        write_own()

        def write(group: Any, check: Any) -> None:
            calls.seen.append(f"write on {threading.current_thread().name}")
            check()

        def now() -> None:
            calls.seen.append("write_now")

        return Staged(staged, write, now, lambda: calls.seen.append("after_commit"))

    m.save_step(SaveRequest(4, calls.own, stage=stage))
    m.saved(4)
    m.drain()
    assert committed(m, 4) == b"own"
    if staged:
        assert calls.seen == ["own", "write on jitckpt-writer", "after_commit"]
    else:
        assert calls.seen == ["own", "write_now", "after_commit"]


def test_a_jit_request_whose_fast_write_fails_is_written_by_the_own_save_and_exits(tmp_path):
    m = manager(tmp_path)
    m.session.training = True
    m.stop_at(11)
    calls = Calls(m, 11)

    def broken(path: str, tensors: dict, threads: int, check: Any) -> list:
        def write() -> None:
            raise RuntimeError("fast writer broke")

        return [write]

    def parts() -> tuple[SaveParts, Any]:
        return SaveParts(small, {"w": torch.ones(2)}, set, broken, lambda: None), None

    m.save_step(SaveRequest(11, calls.own, parts=parts))
    with pytest.raises(ExitedError) as exited:
        m.saved(11)
    assert exited.value.code == m.session.cfg.exit_code
    assert calls.seen == ["own"]
    assert committed(m, 11) == b"own"


def test_each_training_starts_from_its_own_estimate_of_a_checkpoints_size(tmp_path):
    """What a JIT save makes room for, and what a full disk's line says is needed: the
    snapshot's size when a training decides its fast paths, then each commit's bytes."""
    m = manager(tmp_path)  # enable_async(1000)
    assert m.saver._expected_bytes == 1000
    calls = Calls(m, 5)
    m.save_step(SaveRequest(5, calls.own))
    m.saved(5)
    assert m.saver._expected_bytes == validity.committed(m.checkpoint_dir(5))[0].total_bytes
    m.training_ended()
    m.enable_async(7000, None)  # a second Trainer, a bigger model
    assert m.saver._expected_bytes == 7000
