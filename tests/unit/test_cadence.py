"""Time-based periodic saves (hook/cadence.py) on a scripted clock: the interval, the budget."""

from __future__ import annotations

import logging

import pytest

from jitckpt_entrypoint.hook.cadence import FIRST_SAVE_SECONDS, MIN_INTERVAL, Cadence


class Run:
    """Steps of a given length on a fake clock; saves that hold training and take time."""

    def __init__(self, cadence: Cadence) -> None:
        self.cadence, self.now, self.saves = cadence, 0.0, []
        cadence.started()

    def steps(self, count: int, seconds: float, *, blocked: float = 0.0, write: float = 0.0):
        """`count` steps; a due save is agreed at once, holds the next step `blocked` seconds
        and is committed `write` seconds after it began (async) or at once (write=0)."""
        finish, measured = None, 0
        for _ in range(count):
            self.now += seconds
            if finish is not None and self.now >= finish:
                # async: it held training `blocked`
                self.cadence.save_finished(measured, finish, blocked)
                finish = None
            self.cadence.step_ended(self.now)
            if self.cadence.due(self.now):
                self.cadence.agreed(self.now)
                measured = self.cadence.save_began(self.now)
                self.saves.append(self.now)
                finish = self.now + max(write, blocked)
                if not write:
                    self.now += blocked
                    self.cadence.save_finished(measured, self.now)
                    finish = None
                else:
                    self.now += blocked  # the next step ends later by what the save held
        return self

    def gaps(self) -> list[float]:
        return [round(b - a, 3) for a, b in zip(self.saves, self.saves[1:])]


def steady(cadence: Cadence, steps: int = 10) -> float:
    """Training starts and runs `steps` steps of 1 s that overlap no save; returns the clock."""
    cadence.started()
    now = 0.0
    for _ in range(steps):
        now += 1.0
        cadence.step_ended(now)
    return now


def test_no_setting_no_time_based_saves():
    cadence = Cadence(None, None)
    assert not cadence.active
    assert Run(cadence).steps(1000, 1.0).saves == []


def test_the_interval_holds_when_step_time_changes():
    run = Run(Cadence(10.0, None)).steps(100, 0.5).steps(20, 2.0)
    assert run.saves[0] == pytest.approx(10.5)  # counted from the first step's end
    assert all(10.0 <= gap <= 12.0 for gap in run.gaps()), run.gaps()
    assert len(run.saves) == 8  # 89.5 s of training after the first step


def test_a_step_based_save_resets_the_clock():
    cadence = Cadence(10.0, None)
    run = Run(cadence).steps(12, 0.5)  # 6 s
    cadence.save_finished(cadence.save_began(run.now), run.now)  # save_steps asked for this one
    run.steps(12, 0.5)  # 6 s more: 12 s in all, but only 6 s since that save
    assert run.saves == []
    run.steps(10, 0.5)
    assert run.saves == [pytest.approx(16.0)]


def test_rank0_asks_once_until_the_agreement_answers():
    cadence = Cadence(1.0, None)
    cadence.started()
    assert not cadence.due(0.0)  # the first step ended: the clock starts
    assert cadence.due(1.5)
    assert not cadence.due(1.6)  # the answer is one round away: no second save
    cadence.agreed(1.7)
    assert not cadence.due(2.5)
    assert cadence.due(2.8)


def test_no_save_is_asked_for_while_one_is_being_written():
    cadence = Cadence(1.0, None)
    cadence.started()
    measured = cadence.save_began(0.5)
    assert not cadence.due(3.0)
    cadence.save_finished(measured, 3.1)
    cadence.step_ended(3.2)
    assert cadence.due(3.2)


def test_the_budget_picks_cost_over_overhead_and_logs_its_choice(caplog):
    caplog.set_level(logging.INFO, "jitckpt.hook")
    cadence = Cadence(None, 0.01)
    assert cadence.interval == FIRST_SAVE_SECONDS
    # steps of 1 s, a save holds training 0.5 s: 0.5 s / 1% = 50 s
    run = Run(cadence).steps(200, 1.0, blocked=0.5)
    assert cadence.cost == pytest.approx(0.5)
    assert cadence.interval == pytest.approx(50.0)
    assert run.saves[0] == pytest.approx(61.0)
    assert 50.0 <= run.gaps()[-1] <= 52.0
    lines = [r.getMessage() for r in caplog.records if "save interval" in r.getMessage()]
    assert lines == [
        "save interval 50.0 s: a save costs training 0.500 s (written in 0.5 s); budget 1%"
    ]


def test_the_budget_counts_slower_steps_while_an_async_save_is_written():
    """The save held training 0.1 s; the step it was called in (which may hold an evaluation)
    is not compared; the 8 later steps that overlap its write ran 0.2 s slow."""
    cadence = Cadence(None, 0.02)
    now = steady(cadence)
    measured = cadence.save_began(now)
    for _ in range(8):  # written in the background: meanwhile steps take 1.2 s, not 1 s
        now += 1.2
        cadence.step_ended(now)
    now += 1.2
    cadence.save_finished(measured, now - 0.1, 0.1)
    cadence.step_ended(now)  # overlapped the write's end: counted
    now += 1.0
    cadence.step_ended(now)  # after the commit: the measurement ends
    assert cadence.choices == [(pytest.approx(1.7), pytest.approx(10.7), pytest.approx(85.0))]


def test_the_budget_never_exceeds_the_interval_and_never_saves_faster_than_it_writes():
    capped = Cadence(30.0, 0.01)
    assert capped.interval == 30.0  # the first save comes at the cap when it is shorter
    Run(capped).steps(200, 1.0, blocked=0.5)
    assert capped.interval == 30.0
    cheap = Cadence(None, 0.5)
    Run(cheap).steps(300, 1.0, blocked=0.001, write=50.0)
    assert cheap.interval == pytest.approx(50.0, rel=0.1)  # the write, not 0.002 s
    free = Cadence(None, 0.5)
    Run(free).steps(300, 1.0, blocked=0.001, write=2.0)
    assert free.interval == MIN_INTERVAL  # nearly free saves: not every 2 s
    short = Cadence(5.0, 0.5)
    Run(short).steps(100, 1.0, blocked=0.001, write=2.0)
    assert short.interval == 5.0  # the interval set wins over the floor


def test_the_budget_retunes_when_saves_get_cheaper():
    cadence = Cadence(None, 0.01)
    run = Run(cadence).steps(200, 1.0, blocked=1.0)
    assert cadence.interval == pytest.approx(100.0)
    run.steps(2000, 1.0, blocked=0.4)
    assert cadence.interval == pytest.approx(40.0, rel=0.05)
    assert [round(c[2]) for c in cadence.choices][:2] == [100, 100]


def test_an_evaluation_in_the_step_of_the_save_is_not_its_cost():
    """HF evaluates right before it saves (eval_steps == save_steps): that step's 120 s are
    the evaluation's, not the save's."""
    cadence = Cadence(None, 0.01)
    now = steady(cadence)
    measured = cadence.save_began(now + 120.0)  # after the evaluation
    cadence.save_finished(measured, now + 120.5)  # a synchronous save of 0.5 s
    now += 121.5
    cadence.step_ended(now)
    assert cadence.choices == [(pytest.approx(0.5), pytest.approx(0.5), pytest.approx(50.0))]


def test_a_later_evaluation_while_an_async_save_is_written_is_not_its_cost():
    cadence = Cadence(None, 0.01)
    now = steady(cadence)
    measured = cadence.save_began(now)
    now += 1.0
    cadence.step_ended(now)  # the step of the save call
    cadence.not_compared()  # HF evaluates after this step: 60 s
    now += 61.0
    cadence.step_ended(now)
    now += 1.0
    cadence.save_finished(measured, now - 0.5, 0.2)
    cadence.step_ended(now)
    assert cadence.choices == [(pytest.approx(0.2), pytest.approx(62.5), pytest.approx(62.5))]


def test_a_save_that_drains_the_last_one_in_its_step_measures_both_apart():
    """save_steps' save B begins in the step where A, still being written, was drained: A is
    measured up to there, and B's commit (on the writer thread) is not taken for A's."""
    cadence = Cadence(None, 0.01)
    now = steady(cadence)
    a = cadence.save_began(now)
    now += 1.0
    cadence.step_ended(now)
    now += 2.0  # B's begin_save waits for A's write to end, then B begins
    cadence.save_finished(a, now, 0.1)
    b = cadence.save_began(now)
    assert b not in (0, a)
    assert cadence.choices == [(pytest.approx(0.1), pytest.approx(3.0), pytest.approx(30.0))]
    cadence.save_finished(a, now + 0.5, 9.0)  # a late report of A changes nothing
    cadence.save_finished(b, now + 0.4, 0.3)
    now += 1.0
    cadence.step_ended(now)
    assert cadence.choices[1][:2] == (pytest.approx(0.3), pytest.approx(0.4))


def test_the_start_of_training_says_what_the_settings_do():
    assert Cadence(600.0, None).describe() == "every 600 s (JITCKPT_SAVE_INTERVAL)"
    assert Cadence(120.0, 0.01).describe() == (
        "the interval picked from each save's cost for a 1% budget (JITCKPT_SAVE_OVERHEAD), "
        "at most 120 s (JITCKPT_SAVE_INTERVAL); the first after 60 s"
    )
