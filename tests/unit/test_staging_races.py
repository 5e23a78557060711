"""The trainer stages a step again while the sidecar removes the save of it it uploaded: the
newer staging is never the one removed (commit.stage builds aside and renames into place;
staging.remove moves the directory aside before it checks whose save it holds)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness.checkpoints import commit, hf_files
from jitckpt_entrypoint.protocol import validity
from jitckpt_entrypoint.protocol.commit import STAGING_TEMP, remove_checkpoint
from jitckpt_entrypoint.protocol.layout import Layout
from jitckpt_sidecar import staging


def save(root: Path, save_id: str) -> None:
    """Checkpoint-50 saved (again) as `save_id`: the earlier save's files are removed first,
    as a re-save does; its staged links keep their bytes."""
    remove_checkpoint(Layout(str(root)).checkpoint_dir(50))
    commit([root], 50, [hf_files(50, big=4096)], save_id=save_id)


def restage_during_checks(monkeypatch: Any, root: Path, save_ids: list[str]) -> None:
    """The trainer saves checkpoint-50 again right after each of the sidecar's next readiness
    checks, one save id per check."""
    real = validity.staged
    pending = list(save_ids)

    def check_then_restage(path: str, **kwargs: Any) -> Any:
        result = real(path, **kwargs)
        if pending:
            save(root, pending.pop(0))
        return result

    monkeypatch.setattr(validity, "staged", check_then_restage)


def staged_now(root: Path) -> tuple[list[str], str]:
    layout = Layout(str(root))
    found = staging.read(layout.staged_dir(50))
    return sorted(os.listdir(layout.staging)), found.manifest.save_id if found else ""


def test_a_save_staged_right_after_the_check_is_not_the_one_removed(tmp_path, monkeypatch):
    save(tmp_path, "save-A")
    uploaded = staging.read(Layout(str(tmp_path)).staged_dir(50))
    assert uploaded is not None
    assert uploaded.manifest.save_id == "save-A"
    restage_during_checks(monkeypatch, tmp_path, ["save-B"])
    staging.remove(uploaded)
    monkeypatch.undo()
    assert staged_now(tmp_path) == (["checkpoint-50"], "save-B")


def test_a_save_moved_aside_by_mistake_goes_back_unless_the_step_was_staged_again(
    tmp_path, monkeypatch
):
    save(tmp_path, "save-A")
    uploaded = staging.read(Layout(str(tmp_path)).staged_dir(50))
    assert uploaded is not None
    # B lands after the sidecar's check, C after it moved B aside: B is older than C, it goes.
    restage_during_checks(monkeypatch, tmp_path, ["save-B"])
    real_swap_out = staging.swap_out

    def swap_out_then_restage(path: str) -> Any:
        aside = real_swap_out(path)
        save(tmp_path, "save-C")
        return aside

    monkeypatch.setattr(staging, "swap_out", swap_out_then_restage)
    staging.remove(uploaded)
    monkeypatch.undo()
    assert staged_now(tmp_path) == (["checkpoint-50"], "save-C")


def test_the_uploaded_save_is_removed_and_leftovers_of_killed_processes_go(tmp_path):
    layout = Layout(str(tmp_path))
    save(tmp_path, "save-A")
    uploaded = staging.read(layout.staged_dir(50))
    assert uploaded is not None
    staging.remove(uploaded)
    assert staged_now(tmp_path) == ([], "")
    for name in ("stage-checkpoint-40", "aside-checkpoint-30-7-1"):  # killed halfway
        Path(layout.staging, STAGING_TEMP + name, "model.safetensors").parent.mkdir(parents=True)
    staging.remove_leftovers(layout)  # the sidecar's start: what it had moved aside
    assert staged_now(tmp_path) == ([f"{STAGING_TEMP}stage-checkpoint-40"], "")
    save(tmp_path, "save-B")  # the trainer's next staging: what it had left
    assert staged_now(tmp_path) == (["checkpoint-50"], "save-B")
