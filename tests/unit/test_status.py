"""Status files: atomic JSON the trainer side leaves for the sidecar and the entrypoint."""

from __future__ import annotations

import time

from jitckpt_entrypoint import status


def test_jit_record_is_only_returned_for_its_own_run(tmp_path):
    """read_jit ignores a record written by another run."""
    rec = status.JitRecord("run-a", 5, "checkpoint-5", time.time(), time.time() - 2, 0.4)
    status.write_jit(str(tmp_path), rec)
    assert status.read_jit(str(tmp_path), "run-a") == rec
    assert status.read_jit(str(tmp_path), "run-b") is None
    assert 1.9 < rec.trigger_to_commit < 2.1  # type: ignore[operator]


def test_save_events_are_pruned_to_the_newest(tmp_path, monkeypatch):
    """Only the newest KEEP_SAVE_EVENTS save events are kept."""
    monkeypatch.setattr(status, "KEEP_SAVE_EVENTS", 3)
    for step in range(1, 6):
        status.write_save_event(str(tmp_path), status.SaveEvent("periodic", step, 1.0, 2.0, 10))
    names = status.save_event_names(str(tmp_path))
    assert names == [f"save-{s:012d}.json" for s in (3, 4, 5)]
    event = status.read_save_event(str(tmp_path / names[-1]))
    assert event is not None
    assert (event.step, event.seconds) == (5, 1.0)


def test_trainer_status_round_trips(tmp_path):
    """trainer.json parses back to the record that was written."""
    rec = status.TrainerStatus("r", 1, ("torchrun", "x.py"), 10.0, sigterm_at=11.0)
    status.write_trainer(str(tmp_path), rec)
    assert status.read_trainer(str(tmp_path)) == rec


def test_missing_or_torn_files_read_as_none(tmp_path):
    """A missing or half-written file is None, never an exception."""
    assert status.read_trainer(str(tmp_path)) is None
    (tmp_path / "jit.json").write_text('{"run_id": ')
    assert status.read_jit(str(tmp_path)) is None


def test_node_status_and_save_start_round_trip(tmp_path):
    """node.json and saving.json parse back to what the hook wrote; unset limits stay None."""
    node = status.NodeStatus("r", 1, 2, None, best_step=40)
    status.write_node(str(tmp_path), node)
    assert status.read_node(str(tmp_path)) == node
    start = status.SaveStart("r", 50, 123.5)
    status.write_save_start(str(tmp_path), start)
    assert status.read_save_start(str(tmp_path)) == start
    (tmp_path / "node.json").write_text('{"run_id": "r", "node": "x"}')
    assert status.read_node(str(tmp_path)) is None
