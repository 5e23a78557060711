"""Commit a checkpoint every rank has finished writing: manifests, staging, status events.

Collective: every rank calls `commit` after its own part of the checkpoint is on disk. After
a barrier, each node's local rank 0 lists what the node holds; the lists are exchanged, and each
node commits its part with them (protocol.commit.commit_node: every node's manifests, its own
last, its owned files staged for the sidecar, a save event). A final barrier keeps any rank
from exiting before its node's checkpoint is committed.
"""

from __future__ import annotations

import time
from typing import NoReturn, Optional

from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.commit import commit_node
from jitckpt_entrypoint.protocol.layout import checkpoint_name


def commit(session: Session, ckpt_dir: str, step: int, kind: str, started_at: float) -> None:
    topo, control = session.topo, session.control
    control.barrier()  # every rank finished writing its files
    holding = (topo.node, m.list_files(ckpt_dir)) if topo.is_leader else None
    holdings = dict(filter(None, control.all_gather(holding)))
    if topo.is_leader:
        event = commit_node(
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
        session.announce()
        session.log.info(
            "committed %s (%s, %.1f MB, %.2f s)",
            checkpoint_name(step),
            kind,
            event.bytes / 1e6,
            event.seconds,
        )
    session.committed_steps.add(step)
    control.barrier()  # no rank leaves before the manifests exist


def record_jit(session: Session, step: int, save_seconds: float) -> None:
    """Tell the entrypoint (and the sidecar) that a JIT checkpoint of this run is committed."""
    if not session.topo.is_leader:
        return
    record = status.JitRecord(
        run_id=session.run_id,
        step=step,
        checkpoint=checkpoint_name(step),
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
