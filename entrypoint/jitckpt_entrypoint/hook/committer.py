"""Commit a checkpoint every rank has finished writing: the manifests, and staging for upload.

Collective: every rank calls `commit` after its own part of the checkpoint is on disk. After
a barrier, each node's local rank 0 lists what the node holds; the lists are exchanged so each
file gets one uploading owner; every node writes all nodes' manifests (its own last) and
hard-links its owned files into staging/ for the sidecar. The caller (manager.py) records the
save and ends with a barrier, so no rank exits before its node's checkpoint is committed.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from jitckpt_entrypoint import manifest as m
from jitckpt_entrypoint.final import link_or_copy
from jitckpt_entrypoint.hook.control import ControlGroup
from jitckpt_entrypoint.hook.session import Session


def commit(
    session: Session,
    ckpt_dir: str,
    step: int,
    kind: str,
    started_at: float,
    *,
    control: Optional[ControlGroup] = None,
) -> Optional[m.Manifest]:
    """Collective: write every node's manifest for `ckpt_dir` (and stage this node's part).

    Returns this node's own manifest on each node's local rank 0, None on the other ranks. The
    caller records the commit and ends with a barrier (no rank leaves before the manifests exist).
    `control`: the group the collectives run on (the background writer's own, for its saves).
    """
    topo, control = session.topo, control or session.control
    control.barrier()  # every rank finished writing its files
    holding = (topo.node, m.list_files(ckpt_dir)) if topo.is_leader else None
    holdings = dict(filter(None, control.all_gather(holding)))
    if not topo.is_leader:
        return None
    entries = m.assign_owners(holdings)
    save_seconds = time.time() - started_at
    manifests = {
        node: m.new_manifest(
            step,
            kind,
            node=node,
            nodes=topo.nodes,
            world_size=topo.world_size,
            files=files,
            save_seconds=save_seconds,
        )
        for node, files in entries.items()
    }
    for node in sorted(manifests, key=lambda n: n == topo.node):  # our own manifest last
        m.write_manifest(ckpt_dir, manifests[node])
    own = manifests[topo.node]
    if session.cfg.storage_uri:
        stage(session.layout, ckpt_dir, own)
    return own


def stage(layout: m.Layout, ckpt_dir: str, own: m.Manifest) -> str:
    """Hard-link this node's owned files, then its manifest, into staging/ (no extra bytes)."""
    dest = os.path.join(layout.staging, m.checkpoint_name(own.step))
    if os.path.exists(dest):
        m.remove_checkpoint(dest)
    for entry in own.owned:
        target = os.path.join(dest, entry.path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        link_or_copy(os.path.join(ckpt_dir, entry.path), target)
    os.makedirs(dest, exist_ok=True)
    link_or_copy(
        os.path.join(ckpt_dir, m.manifest_name(own.node)),
        os.path.join(dest, m.manifest_name(own.node)),
    )
    return dest
