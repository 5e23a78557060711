"""Status files: atomic JSON the trainer side leaves for the sidecar and the entrypoint."""

from __future__ import annotations

import time

from jitckpt_entrypoint.protocol import atomic, status


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
    status.TRAINER.write(str(tmp_path), rec)
    assert status.TRAINER.read(str(tmp_path)) == rec


def test_missing_or_torn_files_read_as_none(tmp_path):
    """A missing or half-written file is None, never an exception."""
    assert status.TRAINER.read(str(tmp_path)) is None
    (tmp_path / "jit.json").write_text('{"run_id": ')
    assert status.read_jit(str(tmp_path)) is None


def test_node_status_and_save_start_round_trip(tmp_path):
    """node.json and saving.json parse back to what the hook wrote; unset limits stay None."""
    node = status.NodeStatus("r", 1, 2, None, best_step=40)
    status.NODE.write(str(tmp_path), node)
    assert status.NODE.read(str(tmp_path)) == node
    start = status.SaveStart("r", 50, 123.5)
    status.SAVING.write(str(tmp_path), start)
    assert status.SAVING.read(str(tmp_path)) == start
    (tmp_path / "node.json").write_text('{"run_id": "r", "node": "x"}')
    assert status.NODE.read(str(tmp_path)) is None


def test_a_record_reads_back_with_defaults_for_missing_optional_keys_and_none_otherwise(tmp_path):
    """A key the writer may leave out takes its default (None for Optional fields); a missing
    required key, a value of the wrong type or a file that is not an object reads as None."""
    path = str(tmp_path / "jit.json")
    base = {"run_id": "r", "step": 5, "checkpoint": "checkpoint-5", "committed_at": 2.0}
    atomic.write_json(path, {**base, "save_seconds": 0.5})
    assert status.read_jit(str(tmp_path)) == status.JitRecord(
        "r", 5, "checkpoint-5", 2.0, None, 0.5
    )
    atomic.write_json(path, base)  # save_seconds is required
    assert status.read_jit(str(tmp_path)) is None
    atomic.write_json(path, {**base, "save_seconds": 0.5, "step": "five"})
    assert status.read_jit(str(tmp_path)) is None
    atomic.write_json(path, [1, 2])
    assert status.read_jit(str(tmp_path)) is None
    event = str(tmp_path / status.save_event_name(3))
    atomic.write_json(
        event, {"kind": "jit", "step": 3, "started_at": 1, "committed_at": 2, "bytes": 9}
    )
    assert status.read_save_event(event) == status.SaveEvent("jit", 3, 1.0, 2.0, 9, "", 0)


def test_sidecar_ready_round_trips_and_names_a_rate_only_for_s3_restores(tmp_path):
    """sidecar-ready.json holds restore_bytes_per_second only when the sidecar measured one
    (what the entrypoint's grace estimate reads); removing it makes the sidecar not ready."""
    local = status.SidecarReady(1.0, 7, "local", 10, 0.01, 0)
    status.SIDECAR_READY.write(str(tmp_path), local)
    assert "restore_bytes_per_second" not in (tmp_path / status.SIDECAR_READY.name).read_text()
    assert status.SIDECAR_READY.read(str(tmp_path)) == local
    s3 = status.SidecarReady(1.0, 7, "s3", 10, 2.0, 10**9, 5 * 10**8)
    status.SIDECAR_READY.write(str(tmp_path), s3)
    assert status.SIDECAR_READY.read(str(tmp_path)) == s3
    status.SIDECAR_READY.remove(str(tmp_path))
    status.SIDECAR_READY.remove(str(tmp_path))  # already gone: not an error
    assert status.SIDECAR_READY.read(str(tmp_path)) is None
