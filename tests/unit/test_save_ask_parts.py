"""Saves asked for from outside training (hook/save_asks.py): who reads an ask, how often, and
that an ask is answered once, also by a trainer started again on the same volume."""

from __future__ import annotations

import os
import time

from jitckpt_entrypoint.config import Config
from jitckpt_entrypoint.hook.save_asks import CHECK_SECONDS, SaveAsks
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.hook.topology import Topology
from jitckpt_entrypoint.protocol import status


def asks(tmp_path, local_rank: int = 0) -> SaveAsks:
    topo = Topology(rank=2 + local_rank, world_size=4, local_rank=local_rank, local_world_size=2)
    made = Session(Config(dir=str(tmp_path)), topo, "run-1")
    made.layout.ensure()
    return SaveAsks(made)


def ask(tmp_path, ask_id: str, asked_at: float = 0.0) -> None:
    record = status.SaveAsk(ask_id, "node drained", asked_at or time.time())
    status.SAVE_ASK.write(str(tmp_path / "status"), record)


def test_an_ask_is_read_by_the_nodes_local_rank_0_once_a_second_and_answered_once(tmp_path):
    leader, other = asks(tmp_path), asks(tmp_path, local_rank=1)
    assert not leader.asked(100.0)  # no ask yet
    ask(tmp_path, "a")
    assert not leader.asked(100.0 + CHECK_SECONDS / 2)  # not looked at again so soon
    assert leader.asked(100.0 + CHECK_SECONDS)
    assert leader.asked(100.0 + CHECK_SECONDS)  # waiting until a save answers it
    assert not other.asked(200.0)  # only local rank 0 reads
    leader.agreed(12)
    answer = status.SAVE_ANSWER.read(str(tmp_path / "status"))
    assert answer is not None
    assert (answer.id, answer.step) == ("a", 12)
    assert not leader.asked(300.0)

    os.utime(tmp_path / "status" / "save-ask.json", (1, 1))  # the same ask, written again
    assert not leader.asked(400.0)
    assert not asks(tmp_path).asked(500.0)  # a trainer started again: answered already
    ask(tmp_path, "b")
    assert leader.asked(600.0)


def test_an_ask_from_before_the_trainer_started_is_not_its_own(tmp_path):
    """The trainer before it saved for it or crashed; this one resumes from the newest save."""
    leader = asks(tmp_path)
    ask(tmp_path, "old", asked_at=1.0)
    assert not leader.asked(100.0)


def test_an_ask_that_cannot_be_read_turns_asks_off_with_one_line(tmp_path):
    leader = asks(tmp_path)
    (tmp_path / "status" / "save-ask.json").mkdir()  # read as a file: IsADirectoryError
    assert not leader.asked(100.0)
    assert not leader.asked(200.0)


def test_a_torn_or_empty_ask_is_none_and_never_raises(tmp_path):
    leader = asks(tmp_path)
    (tmp_path / "status" / "save-ask.json").write_text('{"id": "a", "rea')
    assert not leader.asked(100.0)
    ask(tmp_path, "")
    assert not leader.asked(200.0)
    leader.agreed(5)  # nothing waiting: nothing written
    assert status.SAVE_ANSWER.read(str(tmp_path / "status")) is None
