"""Restorer.run's patience: transient failures are ridden out for RESTORE_PATIENCE seconds from
the last bytes moved, and for at most MAX_FRUITLESS attempts in a row that move bytes but land
no file (the store-level test, a range that fails every time, is in
test_sidecar_consistency.py)."""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest
from botocore.exceptions import ClientError

from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.layout import Layout
from jitckpt_sidecar import restore
from jitckpt_sidecar.config import Config

URI = "s3://bucket/prefix"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def restorer(tmp_path: Any, clock: Clock) -> restore.Restorer:
    cfg = Config(storage_uri=URI)
    remote: Any = types.SimpleNamespace(uri=cfg.uri)
    return restore.Restorer(
        None,
        remote,
        cfg,
        Layout(str(tmp_path)),
        logging.getLogger("test"),
        monotonic=clock.monotonic,
        sleep=clock.sleep,
    )


def unavailable() -> ClientError:
    meta = {"HTTPStatusCode": 503}
    return ClientError({"Error": {"Code": "503", "Message": "x"}, "ResponseMetadata": meta}, "Get")


def attempts(
    tmp_path: Any, *, seconds: float, moves: int, lands: bool, succeeds_at: int = 0
) -> tuple[restore.Restorer, Clock, list[int]]:
    """A restorer whose attempts each take `seconds`, move `moves` bytes, land a file (or
    not), and fail with a 503, but attempt number `succeeds_at`, which restores step 1."""
    clock = Clock()
    r = restorer(tmp_path, clock)
    calls: list[int] = []

    def attempt(cancel: Any) -> Any:
        calls.append(len(calls) + 1)
        clock.now += seconds
        r._moved += moves
        if len(calls) == succeeds_at:
            return restore.RestoreResult("s3", 1)
        if lands:
            r._verified_one(set(), m.FileEntry(f"f{len(calls)}", 10))
        raise unavailable()

    r._run_once = attempt  # type: ignore[method-assign]
    return r, clock, calls


def test_each_file_landed_resets_the_patience(tmp_path):
    # 400 s in all, far past the patience: each attempt landed a file (no bytes moved: kept
    # files of a killed sidecar's temp directory, verified again)
    r, clock, _ = attempts(tmp_path, seconds=50.0, moves=0, lands=True, succeeds_at=8)
    assert r.run().step == 1
    assert clock.now > 2 * restore.RESTORE_PATIENCE


def test_attempts_that_move_bytes_but_land_no_file_end_after_max_fruitless(tmp_path):
    """A range that fails every time: each attempt moves its file's other ranges (bytes, which
    keep the patience from running out) and lands nothing; MAX_FRUITLESS of them end it."""
    r, _, calls = attempts(tmp_path, seconds=1.0, moves=1000, lands=False)
    with pytest.raises(ClientError):
        r.run()
    assert len(calls) == restore.MAX_FRUITLESS


def test_one_file_longer_than_the_patience_gets_its_retries(tmp_path):
    """A file whose download takes longer than RESTORE_PATIENCE: an error 130 s into it is
    retried (bytes moved), and the next attempt lands it."""
    r, _, _ = attempts(tmp_path, seconds=130.0, moves=40_000, lands=False, succeeds_at=3)
    assert r.run().step == 1


def test_a_second_run_counts_from_what_the_first_moved(tmp_path, monkeypatch):
    """The service retries a failed restore with the same restorer: the bytes and files of its
    earlier runs are not progress of the next one."""
    r, clock, _ = attempts(tmp_path, seconds=1.0, moves=1000, lands=True, succeeds_at=3)
    assert r.run().step == 1
    began = clock.now

    def nothing(cancel: Any) -> Any:
        clock.now += 10.0
        raise unavailable()

    r._run_once = nothing  # type: ignore[method-assign]
    monkeypatch.setattr(restore.random, "uniform", lambda _low, high: high)  # no jitter
    with pytest.raises(ClientError):
        r.run()
    # waits 1, 2, 4, 8, 15, 15 s: the attempt ending at 115 s would wait past 120 s
    assert clock.now - began == pytest.approx(115.0)
