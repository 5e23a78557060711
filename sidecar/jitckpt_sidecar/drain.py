"""When the long-running sidecar exits: the drain decision, a pure function of what it knows.

After SIGTERM the sidecar uploads until the trainer has exited (or never started) and nothing
is left to upload: exit 0; or until the drain deadline (the grace period minus a margin, counted
from the earlier of its own SIGTERM and the trainer's: `since_grace_began`) has passed: exit 1.
Without SIGTERM, a trainer that ended for good (JITCKPT_RESTART_POLICY says which ends are)
with everything in S3 ends the sidecar only with JITCKPT_EXIT_WITH_TRAINER=1; else it stays up
(a restarted trainer container needs it).
"""

from __future__ import annotations

import enum
from typing import Optional


class Verdict(enum.Enum):
    TRAINING = None
    """Nothing to decide: the trainer runs (or exited with uploads pending), no SIGTERM."""
    DRAINING = "draining"
    """SIGTERM: keep uploading."""
    DRAINED = 0
    """SIGTERM, the trainer exited (or never started) and everything is in S3: exit 0."""
    DEADLINE = 1
    """SIGTERM and the drain deadline passed: exit 1."""
    TRAINER_DONE_EXIT = "exit with the trainer"
    """No SIGTERM, the trainer ended for good, everything is in S3, JITCKPT_EXIT_WITH_TRAINER=1:
    exit 0."""
    TRAINER_DONE_STAY = "stay"
    """No SIGTERM, the trainer exited, everything is in S3: stay up until SIGTERM."""

    @property
    def exit_code(self) -> Optional[int]:
        if self is Verdict.TRAINER_DONE_EXIT:
            return 0
        return self.value if isinstance(self.value, int) else None


def decide(
    *,
    since_sigterm: Optional[float],
    trainer_known: bool,
    trainer_exited: bool,
    all_uploaded: bool,
    drain_seconds: float,
    exit_with_trainer: bool,
    trainer_final: bool = True,
) -> Verdict:
    """`since_sigterm`: seconds since the grace period began (None: no SIGTERM yet);
    `trainer_known`: status/trainer.json exists; `trainer_exited`: it exited or its container
    died whole; `trainer_final`: that end is for good (the pod's restartPolicy restarts no
    trainer after it); `all_uploaded`: every staged checkpoint and the final model are
    committed in S3."""
    if since_sigterm is not None:
        if (trainer_exited or not trainer_known) and all_uploaded:
            return Verdict.DRAINED
        if since_sigterm >= drain_seconds:
            return Verdict.DEADLINE
        return Verdict.DRAINING
    if trainer_exited and all_uploaded:
        final = exit_with_trainer and trainer_final
        return Verdict.TRAINER_DONE_EXIT if final else Verdict.TRAINER_DONE_STAY
    return Verdict.TRAINING


KUBELET_SLACK = 10.0
"""Seconds a native sidecar's SIGTERM may come after the grace period that began at the
trainer's (the trainer used all of it and was killed; the kubelet then stops the sidecars)."""


def since_grace_began(
    since_sigterm: float, since_trainer_sigterm: Optional[float], grace_seconds: float
) -> float:
    """Seconds since the pod's grace period began: at the sidecar's SIGTERM (`since_sigterm`
    ago), or at the trainer's (trainer.json) when that came first, as for a native sidecar,
    which gets its own only after the trainer exited (or was killed at the grace period's end:
    KUBELET_SLACK later). A trainer's SIGTERM longer before the sidecar's belongs to an earlier
    end (a liveness probe's kill, the container restarted since or waiting in its crash
    backoff), not this one: it once cut the drain of a later pod deletion to nothing."""
    early = grace_seconds + KUBELET_SLACK
    if since_trainer_sigterm is None or since_trainer_sigterm - since_sigterm > early:
        return since_sigterm
    return max(since_sigterm, since_trainer_sigterm)
