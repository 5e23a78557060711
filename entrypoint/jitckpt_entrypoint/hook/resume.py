"""Which checkpoint to resume from: the newest committed one every rank has."""

from __future__ import annotations

from typing import Optional

from jitckpt_entrypoint.errors import JitckptError
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.protocol.commit import remove_checkpoint
from jitckpt_entrypoint.protocol.layout import checkpoint_name, checkpoint_steps
from jitckpt_entrypoint.protocol.validity import committed, committed_steps


def agreed_step(session: Session) -> Optional[int]:
    """The highest step complete on every node (collective), or None.

    Ranks never disagree on where to resume: each node reports the checkpoints it holds in full
    and all pick the newest step common to every report. With several nodes a node holds only
    its own part of what it saved (each pod has its own emptyDir); the sidecar's restore brings
    the rest when a pod starts. A newer checkpoint committed but not complete everywhere is
    skipped with a warning; when it is the only one, training stops with an error rather than
    silently starting over.
    """
    topo, checkpoints = session.topo, session.layout.checkpoints
    complete = committed_steps(checkpoints)
    own = committed_steps(checkpoints, topo.node)
    reports = session.control.all_gather((complete, own[-1] if own else None))
    common = set.intersection(*(set(c) for c, _ in reports)) if reports else set()
    step = max(common) if common else None
    newest = max((n for _, n in reports if n is not None), default=None)
    if newest is not None and (step is None or newest > step):
        name = checkpoint_name(newest)
        if step is None:
            raise JitckptError(
                f"{name} is committed but no node holds all of its files; restart the pods so "
                "the sidecar restores it from S3 (or set JITCKPT_RESUME=0 to start over)"
            )
        if topo.rank == 0:
            session.log.warning(
                "%s is committed but not held in full by every node; resuming from %s "
                "(a new pod restores the newest one from S3 on every node)",
                name,
                checkpoint_name(step),
            )
    return step


def remove_stale(session: Session, resume_step: Optional[int]) -> list[str]:
    """Delete this node's checkpoint directories past the resume point, and the uncommitted ones.

    Training will reach the steps past the resume point again and the Trainer would save into
    the same directories, mixing stale files with new ones. On one node these are always partial
    saves; with several nodes they can also be checkpoints that not every node committed. An
    uncommitted directory before the resume point (a save cut short by a crash) is never
    loaded, but would hold a slot of HF's rotation (save_total_limit) and disk space.
    """
    if not session.topo.is_leader:
        return []
    removed = []
    root, node = session.layout.checkpoints, session.topo.node
    for step in checkpoint_steps(root):
        path = session.layout.checkpoint_dir(step)
        if resume_step is None or step > resume_step or committed(path, node) is None:
            remove_checkpoint(path)
            removed.append(checkpoint_name(step))
    if removed:
        session.log.info(
            "removed checkpoint directories past the resume point or uncommitted: %s",
            ", ".join(removed),
        )
    return removed
