"""Commit a checkpoint every rank has finished writing: manifests, staging, status events.

Collective: every rank calls `commit` after its own part of the checkpoint is on disk. After
a barrier, each node's local rank 0 lists what the node holds; the lists are exchanged so each
file gets one uploading owner; every node writes all nodes' manifests (its own last), hard-links
its owned files into staging/ for the sidecar, and records a save event. A final barrier keeps
any rank from exiting before its node's checkpoint is committed.
"""

from __future__ import annotations

import os
import time
from typing import NoReturn, Optional

from jitckpt_entrypoint import manifest as m
from jitckpt_entrypoint import status
from jitckpt_entrypoint.final import link_or_copy
from jitckpt_entrypoint.hook.session import Session


def commit(session: Session, ckpt_dir: str, step: int, kind: str, started_at: float) -> None:
    topo, control = session.topo, session.control
    control.barrier()  # every rank finished writing its files
    holding = (topo.node, m.list_files(ckpt_dir)) if topo.is_leader else None
    holdings = dict(filter(None, control.all_gather(holding)))
    if topo.is_leader:
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
        committed_at = time.time()
        status.write_save_event(
            session.layout.status,
            status.SaveEvent(
                kind, step, started_at, committed_at, own.total_bytes, session.run_id, topo.node
            ),
        )
        session.log.info(
            "committed %s (%s, %.1f MB, %.2f s)",
            m.checkpoint_name(step),
            kind,
            own.total_bytes / 1e6,
            committed_at - started_at,
        )
    session.committed_steps.add(step)
    control.barrier()  # no rank leaves before the manifests exist


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


def record_jit(session: Session, step: int, save_seconds: float) -> None:
    """Tell the entrypoint (and the sidecar) that a JIT checkpoint of this run is committed."""
    if not session.topo.is_leader:
        return
    record = status.JitRecord(
        run_id=session.run_id,
        step=step,
        checkpoint=m.checkpoint_name(step),
        committed_at=time.time(),
        sigterm_at=session.flag.received_at,
        save_seconds=save_seconds,
    )
    status.write_jit(session.layout.status, record)
    after: Optional[float] = record.trigger_to_commit
    session.log.info(
        "JIT checkpoint %s committed%s",
        record.checkpoint,
        "" if after is None else f" {after:.2f} s after SIGTERM",
    )


def finish_jit(session: Session, step: int, save_seconds: float) -> NoReturn:
    """Record the JIT checkpoint of `step` and exit every rank with JITCKPT_EXIT_CODE."""
    record_jit(session, step, save_seconds)
    session.control.barrier()  # the record exists before any rank's exit is seen
    session.exit(session.cfg.exit_code)
