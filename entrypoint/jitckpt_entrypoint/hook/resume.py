"""Which checkpoint to resume from: the newest committed one every rank has."""

from __future__ import annotations

from typing import Optional

from jitckpt_entrypoint import manifest as m
from jitckpt_entrypoint.hook.session import Session


def agreed_step(session: Session) -> Optional[int]:
    """The highest step committed on every node (collective), or None.

    Ranks never disagree on where to resume: each reports what its node holds and all pick the
    newest step common to every report.
    """
    topo = session.topo
    local = set(m.committed_steps(session.layout.checkpoints, topo.node))
    reports = session.control.all_gather(sorted(local))
    common = set.intersection(*(set(r) for r in reports)) if reports else set()
    step = max(common) if common else None
    newest_anywhere = max((max(r) for r in reports if r), default=None)
    if step is None and newest_anywhere is not None and topo.rank == 0:
        session.log.warning(
            "checkpoint-%d is committed on some nodes but not on all; starting from scratch "
            "(a new pod restores it from S3 on every node)",
            newest_anywhere,
        )
    return step


def remove_newer(session: Session, resume_step: Optional[int]) -> list[str]:
    """Delete this node's checkpoint directories past the resume point.

    Training will reach those steps again and the Trainer would save into the same directories,
    mixing stale files with new ones. On one node these are always partial saves; with several
    nodes they can also be checkpoints that not every node committed.
    """
    if not session.topo.is_leader:
        return []
    removed = []
    for step in m.checkpoint_steps(session.layout.checkpoints):
        if resume_step is None or step > resume_step:
            m.remove_checkpoint(session.layout.checkpoint_dir(step))
            removed.append(m.checkpoint_name(step))
    if removed:
        session.log.info(
            "removed checkpoint directories past the resume point: %s", ", ".join(removed)
        )
    return removed
