"""When the long-running sidecar exits (drain.decide): every combination of SIGTERM, the
trainer's state and the uploads."""

from __future__ import annotations

import pytest

from jitckpt_sidecar.drain import Verdict, decide, since_grace_began


def verdict(
    since: float | None,
    known: bool = True,
    exited: bool = False,
    uploaded: bool = True,
    stay: bool = True,
    final: bool = True,
) -> Verdict:
    return decide(
        since_sigterm=since,
        trainer_known=known,
        trainer_exited=exited,
        all_uploaded=uploaded,
        drain_seconds=50.0,
        exit_with_trainer=not stay,
        trainer_final=final,
    )


@pytest.mark.parametrize(
    ("since", "known", "exited", "uploaded", "expected"),
    [
        (1.0, True, True, True, Verdict.DRAINED),  # the JIT checkpoint is up
        (1.0, False, False, True, Verdict.DRAINED),  # no trainer ever started
        (1.0, True, False, True, Verdict.DRAINING),  # the trainer is still saving its JIT
        (1.0, True, True, False, Verdict.DRAINING),  # uploads pending
        (50.0, True, True, False, Verdict.DEADLINE),
        (50.0, True, False, True, Verdict.DEADLINE),  # the trainer never exited
        (49.9, True, True, False, Verdict.DRAINING),
        (500.0, True, True, True, Verdict.DRAINED),  # done beats a late deadline
    ],
)
def test_after_sigterm(since, known, exited, uploaded, expected):
    assert verdict(since, known, exited, uploaded) is expected


def test_without_sigterm_a_finished_trainer_ends_the_sidecar_only_when_asked():
    assert verdict(None, exited=True) is Verdict.TRAINER_DONE_STAY
    assert verdict(None, exited=True, stay=False) is Verdict.TRAINER_DONE_EXIT
    assert verdict(None, exited=True, uploaded=False, stay=False) is Verdict.TRAINING
    assert verdict(None, exited=False, stay=False) is Verdict.TRAINING
    # An end the kubelet restarts the trainer after (restartPolicy OnFailure, Always): stay.
    assert verdict(None, exited=True, stay=False, final=False) is Verdict.TRAINER_DONE_STAY
    assert verdict(1.0, exited=True, final=False) is Verdict.DRAINED  # SIGTERM: the pod goes


def test_exit_codes():
    codes = {v: v.exit_code for v in Verdict}
    assert codes == {
        Verdict.TRAINING: None,
        Verdict.DRAINING: None,
        Verdict.DRAINED: 0,
        Verdict.DEADLINE: 1,
        Verdict.TRAINER_DONE_EXIT: 0,
        Verdict.TRAINER_DONE_STAY: None,
    }


@pytest.mark.parametrize(
    ("trainer_ago", "expected"),
    [
        (None, 2.0),  # no SIGTERM in trainer.json: the sidecar's own
        (1.0, 2.0),  # the trainer's came later (a plain-container sidecar: the same moment)
        (25.0, 25.0),  # a native sidecar: its own SIGTERM after the trainer exited
        (32.0, 32.0),  # 30 s after the trainer's: still this grace period
        (41.0, 41.0),  # the trainer was killed at its end, the sidecar stopped just after
        (43.0, 2.0),  # longer before: an earlier end's (a liveness probe's kill), ignored
        (3600.0, 2.0),  # it once ended the drain at once
    ],
)
def test_the_grace_period_began_at_the_trainers_sigterm_only_when_it_is_this_ends(
    trainer_ago: float | None, expected: float
) -> None:
    assert since_grace_began(2.0, trainer_ago, grace_seconds=30) == expected
