"""Commit a checkpoint every rank has finished writing: the manifests, staging, the save event.

Collective: every rank calls `commit` after its own part of the checkpoint is on disk. After
a barrier, each node's local rank 0 lists what the node holds; the lists are exchanged and each
node commits its part with them (protocol.commit.commit_node: every node's manifests, its own
last, its owned files staged for the sidecar, the save event). The caller (manager.py) ends
with a barrier, so no rank exits before its node's checkpoint is committed.
"""

from __future__ import annotations

from typing import Optional

from jitckpt_entrypoint.hook.control import ControlGroup
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.commit import commit_node


def commit(
    session: Session,
    ckpt_dir: str,
    step: int,
    kind: str,
    started_at: float,
    *,
    control: Optional[ControlGroup] = None,
) -> Optional[status.SaveEvent]:
    """Collective (on `control`, the background writer's own group for its saves; the
    training's by default): commit `ckpt_dir`. Returns the save event on each node's local
    rank 0, None on the other ranks."""
    topo, control = session.topo, control or session.control
    control.barrier()  # every rank finished writing its files
    holding = (topo.node, m.list_files(ckpt_dir)) if topo.is_leader else None
    holdings = dict(filter(None, control.all_gather(holding)))
    if not topo.is_leader:
        return None
    return commit_node(
        session.layout,
        ckpt_dir,
        holdings,
        node=topo.node,
        nodes=topo.nodes,
        world_size=topo.world_size,
        step=step,
        kind=kind,
        started_at=started_at,
        run_id=session.run_id,
        stage_for_upload=bool(session.cfg.storage_uri),
    )
