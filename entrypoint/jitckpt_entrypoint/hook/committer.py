"""Commit a checkpoint every rank has written, or abandon it when any rank could not.

Collective: every rank calls `commit` once its own part of the checkpoint is written (or its
write failed), with the outcome of that write. After a barrier, each node's local rank 0 makes
the node's files durable (protocol.durable) and lists them; outcomes and lists are exchanged in
one round, so every rank learns the same thing at once, and no node writes a manifest before
every node's data is on disk:
- every rank wrote: each node commits its part with the lists (protocol.commit.commit_node:
  every node's manifests, its own last, its owned files staged for the sidecar, the save
  event). A last round tells every rank whether every node's
  commit went through; a node whose commit failed (a full disk while writing the manifests)
  makes every node uncommit, so no rank counts a checkpoint that some node does not hold.
- any rank failed or was cancelled: each node's local rank 0 removes the directory (it must not
  hold a rotation slot, or a resume point, or the space the next save needs).
Either way the last round is a barrier: no rank leaves before its node is done.
"""

from __future__ import annotations

from typing import Optional

from jitckpt_entrypoint.hook import dcp_reads
from jitckpt_entrypoint.hook.control import ControlGroup
from jitckpt_entrypoint.hook.saves import Outcome, Vote, outcome_of
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.hook.topology import Topology
from jitckpt_entrypoint.protocol import durable
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.commit import commit_node, remove_checkpoint


def commit(
    session: Session,
    ckpt_dir: str,
    step: int,
    kind: str,
    started_at: float,
    *,
    outcome: Outcome = Outcome.OK,
    control: Optional[ControlGroup] = None,
    snapshot: bool = False,
) -> Vote:
    """Collective (on `control`, the background writer's own group for its saves; the
    training's by default): commit `ckpt_dir`, or remove it when any rank's outcome is not OK.
    `snapshot`: a snapshot in RAM (memory_tier.py): neither staged nor recorded as a save."""
    topo, control = session.topo, control or session.control
    control.barrier()  # every rank finished writing its files (or failed to)
    holding = None
    if topo.is_leader and outcome == Outcome.OK:
        # Durable before the round below: on a shared volume every node writes every node's
        # manifests, so each node's data must be on disk before any node commits.
        try:
            durable.sync_tree(ckpt_dir)
            holding = m.list_files(ckpt_dir)
        except OSError as exc:
            session.log.error("cannot make %s durable: %s", ckpt_dir, exc)  # noqa: TRY400
            outcome = outcome_of(exc, ckpt_dir)
    # Rank 0 draws the save id (and the lineage of a run that did not resume): every node's
    # manifests carry the same ones.
    # With several nodes it also hands out which DCP shard files each rank reads back.
    drawn = None
    if topo.rank == 0:
        lineage = session.lineage if session.lineage is not None else m.new_lineage()
        maps = dcp_reads.take(ckpt_dir)
        reads = dcp_reads.node_reads(maps, topo.local_world_size) if topo.nodes > 1 else None
        drawn = (m.new_save_id(), lineage, reads)
    gathered = control.all_gather((topo.node, outcome, holding, drawn))
    save_id, session.lineage, reads = gathered[0][3]
    outcomes = tuple((node, o) for node, o, _, _ in gathered)
    event, result = None, Outcome.OK
    written = all(o == Outcome.OK for _, o in outcomes)
    if written and topo.is_leader:
        holdings = {node: files for node, _, files, _ in gathered if files is not None}
        try:
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
                stage_for_upload=bool(session.cfg.storage_uri) and not snapshot,
                save_id=save_id,
                lineage=session.lineage,
                reads=_node_reads(reads, [node for node, _, _, _ in gathered], topo),
                synced=True,
                record=not snapshot,
            )
        except OSError as exc:
            session.log.error("cannot commit %s: %s", ckpt_dir, exc)  # noqa: TRY400 - one line
            result = outcome_of(exc)
    results = control.all_gather(result)  # every node committed, or none keeps it
    if written and all(r == Outcome.OK for r in results):
        return Vote(True, outcomes, event)
    outcomes = tuple((n, r if o == Outcome.OK else o) for (n, o), r in zip(outcomes, results))
    if topo.is_leader:
        remove_checkpoint(ckpt_dir)
        if written and not snapshot:  # its commit may have staged it
            remove_checkpoint(session.layout.staged_dir(step))
    return Vote(False, outcomes)


def _node_reads(
    reads: Optional[tuple[tuple[str, ...], dict[tuple[str, ...], tuple[int, ...]]]],
    nodes: list[int],
    topo: Topology,
) -> dict[int, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Per node, its manifest's (shard_dirs, shard_reads) from rank 0's grouped `reads`; none
    (every node reads every file) unless the ranks are numbered as node_reads assumed."""
    if reads is None or nodes != [r // topo.local_world_size for r in range(len(nodes))]:
        return {}
    dirs, grouped = reads
    return {node: (dirs, files) for files, members in grouped.items() for node in members}
