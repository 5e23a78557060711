"""Which checkpoint to resume from: the newest committed one every rank has, on the volume or
in RAM (a snapshot in JITCKPT_MEMORY_DIR of a job of this size: memory_tier.py)."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import time
from collections.abc import Callable, Iterable
from typing import Optional

from jitckpt_entrypoint.errors import JitckptError
from jitckpt_entrypoint.hook import fetch
from jitckpt_entrypoint.hook.memory_tier import MemoryTier
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.hook.topology import Topology
from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.commit import remove_checkpoint
from jitckpt_entrypoint.protocol.layout import checkpoint_name, checkpoint_steps, step_of
from jitckpt_entrypoint.protocol.manifest import read_manifests
from jitckpt_entrypoint.protocol.validity import (
    committed,
    complete_save,
    kept,
    loadable,
    local_save,
    whole_here,
)

SaveKey = tuple[int, str, str]
"""(step, save id, lineage) of a committed checkpoint."""


def lineage_of(ckpt_dir: str) -> Optional[str]:
    """The lineage of the committed checkpoint in `ckpt_dir` ("" for one written before
    lineages: the run carries that on); None when it is not a committed checkpoint of ours
    (the run then starts a new lineage at its first commit)."""
    save = complete_save(read_manifests(ckpt_dir))
    return save[0].lineage if save else None


def tip(session: Session, step: int, lineage: str) -> Optional[int]:
    """The newest step above `step` that `lineage` has a save of, as this node knows (None when
    `step` is its newest): a directory on this volume holding any manifest of that lineage,
    committed or not, or S3's as the sidecar's restore saw it (status.LineageTip). A run that
    resumes below it begins a new lineage: validity.newness then puts its saves above that
    branch's, whatever their steps (an in-place restart that could not load the newest, an
    attempt's late upload completing a higher step, a rollback)."""
    found = []
    memory = os.path.join(session.cfg.memory_dir, "checkpoints") if session.cfg.memory_dir else ""
    topo = session.topo
    for root in filter(None, (session.layout.checkpoints, memory)):
        try:
            steps = checkpoint_steps(root)
        except OSError:  # JITCKPT_MEMORY_DIR unusable: memory_tier.decide says so
            continue
        for other in steps:
            if other > step:
                manifests = read_manifests(os.path.join(root, checkpoint_name(other)))
                if root == memory:  # a snapshot of another job size is never a branch here
                    size = (topo.world_size, topo.nodes)
                    manifests = {
                        k: v for k, v in manifests.items() if (v.world_size, v.nodes) == size
                    }
                if any(man.lineage == lineage for man in manifests.values()):
                    found.append(other)
    seen = status.LINEAGE_TIP.read(session.layout.status)
    if seen is not None and seen.lineage == lineage and seen.step > step:
        found.append(seen.step)
    return max(found, default=None)


def _saves(checkpoints: str, topo: Topology, own_part: bool = False) -> list[SaveKey]:
    """(step, save id, lineage) of every checkpoint committed under `checkpoints` that this
    node can load (what its ranks read: validity.loadable), or of which it holds its own part."""
    return list(_dirs(checkpoints, topo, own_part))


def _dirs(checkpoints: str, topo: Topology, own_part: bool = False) -> dict[SaveKey, str]:
    """`_saves` with each one's directory."""
    found = {}
    for step in checkpoint_steps(checkpoints):
        path = os.path.join(checkpoints, checkpoint_name(step))
        save = (
            committed(path, topo.node)
            if own_part
            else loadable(path, topo.node, topo.nodes, topo.world_size)
        )
        if save is None:
            continue
        found[(step, save[0].save_id, save[0].lineage)] = path
    return found


def _newest(saves: Iterable[SaveKey]) -> Optional[SaveKey]:
    """The newest in the sidecar's order (validity.newness): by run (the newest-born one: a run
    started over on the prefix), then step."""
    return max(saves, key=lambda s: (s[2], s[0]), default=None)


def fetch_missing(session: Session, in_ram: Optional[SaveKey] = None) -> None:
    """When the newest committed checkpoint on this node's volume is one its ranks cannot load
    from what the volume holds (the restore fetched another node's part, the job changed size,
    or a container restarted in place where each node holds only its own part), ask the sidecar
    for the rest and wait (hook/fetch.py): every local rank asks and waits, so no collective
    waits on it. Without an answer, training carries on: agreed_step then resumes from an
    older checkpoint every node can load, or stops with one line. Not when `in_ram`, the
    newest snapshot every node holds in RAM (`common_in_ram`), is newer: the resume takes it."""
    topo, layout = session.topo, session.layout
    try:
        wanted = _wanted(layout.checkpoints, topo)
    except OSError:
        return
    if wanted is None:
        return
    step, save_id, lineage = wanted
    if in_ram is not None and (in_ram[2], in_ram[0]) > (lineage, step):
        return
    if topo.is_leader:
        session.log.info(
            "%s is committed but this node does not hold every file its ranks load; asking the "
            "sidecar to fetch the rest from S3",
            checkpoint_name(step),
        )
    fetch.ask_sidecar(layout, step, save_id, say=topo.is_leader)


def _wanted(checkpoints: str, topo: Topology) -> Optional[SaveKey]:
    """(step, save id, lineage) of the newest committed checkpoint here, when this node cannot
    load it from what it holds and can load nothing as new."""
    newest: Optional[tuple[tuple[str, int], int, str, bool]] = None
    for step in checkpoint_steps(checkpoints):
        path = os.path.join(checkpoints, checkpoint_name(step))
        save = local_save(path)
        if save is None:
            continue
        here = loadable(path, topo.node, topo.nodes, topo.world_size) is not None
        key = (save[0].lineage, step)
        if newest is None or key > newest[0]:
            newest = (key, step, save[0].save_id, here)
    if newest is None or newest[3]:
        return None
    return newest[1], newest[2], newest[0][0]


def _memory_dirs(memory: str, topo: Topology) -> dict[SaveKey, str]:
    """The snapshots in RAM this node can resume from: of a job of this size, each holding on
    this node what its ranks load (validity.whole_here); none when the directory cannot be
    read (memory_tier.decide says so in one line)."""
    found = {}
    try:
        steps = checkpoint_steps(memory)
    except OSError:
        return {}
    for step in steps:
        path = os.path.join(memory, checkpoint_name(step))
        save = whole_here(path, topo.node)
        if save is not None and (save[0].world_size, save[0].nodes) == (
            topo.world_size,
            topo.nodes,
        ):
            found[(step, save[0].save_id, save[0].lineage)] = path
    return found


def common_in_ram(session: Session, memory: str) -> Optional[SaveKey]:
    """Collective with several nodes (on every node, whatever its `memory`, JITCKPT_MEMORY_DIR's
    checkpoints, or ""): the newest snapshot every node holds in RAM, or None."""
    if session.topo.nodes <= 1:
        return None
    held = list(_memory_dirs(memory, session.topo)) if memory else []
    reports = session.control.all_gather(held)
    common = set.intersection(*(set(r) for r in reports)) if reports else set()
    return _newest(common)


def agreed_step(session: Session) -> Optional[int]:
    """The highest step complete on every node (collective), or None (`agreed_save`'s step)."""
    agreed = agreed_save(session)
    return None if agreed is None else agreed[0]


def agreed_save(session: Session, memory: str = "") -> Optional[tuple[int, str]]:
    """The newest save complete on every node (collective), and its directory here, or None.
    `memory`: JITCKPT_MEMORY_DIR's checkpoints, whose snapshots count too.

    Ranks never disagree on where to resume: each node reports the checkpoints it can load
    (every file its ranks read: all of them, or for a sharded save at its own size, its own
    shards and the shared files) and all pick the newest step common to every report. With
    several nodes a node holds only its own part of what it saved to the volume (each pod has
    its own emptyDir; its snapshots in RAM hold all it loads); the sidecar's restore brings
    what else it reads when a pod starts. A newer
    checkpoint committed but not loadable everywhere is skipped with a warning; when it is the
    only one, training stops with an error rather than silently starting over.
    """
    topo, checkpoints = session.topo, session.layout.checkpoints
    here = _dirs(checkpoints, topo)
    if memory:  # the volume's save of a step wins over a snapshot of it
        here = {**_memory_dirs(memory, topo), **here}
    # The same save, not just the same step number: a volume may hold another save of a step
    # (an earlier attempt's) that the other nodes do not.
    reports = session.control.all_gather(
        (list(here), _newest(_saves(checkpoints, topo, own_part=True)))
    )
    common = set.intersection(*(set(c) for c, _ in reports)) if reports else set()
    # Of a step's saves, the volume's before a snapshot's (a save id is one or the other on
    # every node, so every rank picks the same).
    best = max(
        common, key=lambda s: (s[2], s[0], os.path.dirname(here[s]) != memory, s[1]), default=None
    )
    step = None if best is None else best[0]
    newest = _newest(n for _, n in reports if n is not None)
    if newest is not None and (best is None or (newest[2], newest[0]) > (best[2], best[0])):
        name = checkpoint_name(newest[0])
        if step is None:
            raise JitckptError(
                f"{name} is committed but no node holds every file its ranks load; restart the "
                "pods so the sidecar restores it from S3 (or set JITCKPT_RESUME=0 to start over)"
            )
        if topo.rank == 0:
            session.log.warning(
                "%s is committed but not every node holds the files its ranks load; resuming "
                "from %s (a new pod restores the newest one from S3 on every node)",
                name,
                checkpoint_name(step),
            )
    return None if best is None else (best[0], here[best])


def zero_refusal(ckpt_dir: str, world_size: int, load_universal: bool) -> Optional[str]:
    """One line when `ckpt_dir` holds DeepSpeed ZeRO optimizer states of a data-parallel
    size other than this run's: DeepSpeed loads those only at their own size (its own error
    comes after the model is built, as a traceback), unless converted to a universal
    checkpoint. Only for pure data parallelism (one ZeRO partition per saved rank); with
    tensor or sequence parallelism DeepSpeed decides."""
    if load_universal:
        return None
    save = complete_save(read_manifests(ckpt_dir))
    if not save:
        return None
    names = glob.glob(os.path.join(glob.escape(ckpt_dir), "global_step*", "*zero_pp_rank_*"))
    partitions = {m.group(1) for n in names if (m := _ZERO_RANK.search(os.path.basename(n)))}
    saved = save[0].world_size
    if len(partitions) != saved or saved == world_size:
        return None
    return (
        f"{os.path.basename(ckpt_dir)} holds DeepSpeed ZeRO optimizer states of {saved} ranks "
        f"and this run has {world_size}: DeepSpeed loads them only at {saved} ranks; run at "
        f"{saved} ranks, or convert the checkpoint with DeepSpeed's ds_to_universal.py and "
        'resume from it with "checkpoint": {"load_universal": true} in the DeepSpeed config'
    )


_ZERO_RANK = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


def remove_stale(session: Session, resume_step: Optional[int]) -> list[str]:
    """Delete this node's checkpoint directories past the resume point, and the uncommitted ones.

    Training will reach the steps past the resume point again and the Trainer would save into
    the same directories, mixing stale files with new ones. On one node these are always partial
    saves; with several nodes they can also be checkpoints that not every node committed. An
    uncommitted directory before the resume point (a save cut short by a crash) is never
    loaded, but would hold a slot of HF's rotation (save_total_limit) and disk space.
    """
    return _remove(
        session,
        lambda step: resume_step is None or step > resume_step,
        "checkpoint directories past the resume point or uncommitted",
    )


def leave_behind(session: Session, steps: Iterable[int]) -> list[str]:
    """Delete this node's directories of `steps` (a failed attempt's saves, when the Trainer
    trains again: manager.retried) and the uncommitted ones (its save cut short). Every other
    checkpoint stays (an earlier run's, the one resumed from)."""
    gone = set(steps)
    return _remove(
        session, gone.__contains__, "the failed attempt's checkpoints and uncommitted directories"
    )


def _remove(session: Session, doomed: Callable[[int], bool], what: str) -> list[str]:
    """This node's leader: delete the checkpoint directories of the steps `doomed` names, and
    the uncommitted ones; the names removed (logged as `what`)."""
    if not session.topo.is_leader:
        return []
    removed = []
    topo = session.topo
    for step in checkpoint_steps(session.layout.checkpoints):
        path = session.layout.checkpoint_dir(step)
        if doomed(step) or not kept(path, topo.node, topo.nodes, topo.world_size):
            remove_checkpoint(path)
            removed.append(checkpoint_name(step))
    if removed:
        session.log.info("removed %s: %s", what, ", ".join(removed))
    return removed


def start_over(session: Session, tier: Optional[MemoryTier] = None) -> list[str]:
    """JITCKPT_RESUME=0: this run begins a new lineage, and the checkpoints on this node's
    volume are an earlier run's. Its saves must not land in their directories (a step both
    runs save would mix their files, or look committed by the earlier save's manifests). With
    S3 they are in S3 or staged for upload (hard links keep the bytes): deleted. Without, the
    volume holds the only copy: moved to `checkpoints/.earlier-run-<time>/`, where neither the
    resume nor HF's rotation looks."""
    if session.started_over:  # once per process: a second stage keeps the first's saves
        return []
    session.started_over = True
    session.lineage = None
    if tier is not None:
        tier.clear()
    if not session.topo.is_leader:
        return []
    root = session.layout.checkpoints
    steps = checkpoint_steps(root)
    if not steps:
        return []
    names = [checkpoint_name(s) for s in steps]
    if session.cfg.storage_uri:
        for step in steps:
            remove_checkpoint(session.layout.checkpoint_dir(step))
        session.log.info(
            "JITCKPT_RESUME=0: starting over; removed the earlier run's %s from this volume "
            "(S3 keeps what was uploaded)",
            ", ".join(names),
        )
        return names
    aside = os.path.join(root, f".earlier-run-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}")
    os.makedirs(aside, exist_ok=True)
    for name in names:
        with contextlib.suppress(FileNotFoundError):  # another node of a shared volume moved it
            os.rename(os.path.join(root, name), os.path.join(aside, name))
    session.log.info(
        "JITCKPT_RESUME=0: starting over; moved the earlier run's %s to %s", ", ".join(names), aside
    )
    return names


def resuming_from(session: Session, path: str) -> None:
    """Collective: the script resumes from `path` itself: its saves carry on that
    checkpoint's lineage (when it is one of ours), unless that lineage has a newer save on
    any node (a rollback, or what the restore saw in S3: a new lineage)."""
    lineage = lineage_of(path)
    step = step_of(os.path.basename(os.path.normpath(path)))
    tips = session.control.all_gather(
        None if lineage is None or step is None else tip(session, step, lineage)
    )
    newest = max((t for t in tips if t is not None), default=None)
    session.lineage = lineage if newest is None else None
    if newest is not None and step is not None:
        _say_branch(session, step, newest)


def resume(
    session: Session, tier: Optional[MemoryTier] = None, *, asked: bool = False
) -> tuple[Optional[int], Optional[str], list[str]]:
    """Collective: the newest step committed on every node, or None; its directory (on the
    volume, or a snapshot's in RAM); and the checkpoints a start over removed. Directories past
    it, and uncommitted ones, are removed (training writes those steps again; a partial one
    would hold a rotation slot), and every snapshot but the one resumed from. JITCKPT_RESUME=0
    gives None unless the script `asked` for the newest checkpoint itself, and clears the
    earlier run's checkpoints out of the way (`start_over`)."""
    if tier is not None:
        tier.settle()  # a save the RAM writer still writes out (a restarted worker): whole first
    if not (asked or session.cfg.resume):
        return None, None, start_over(session, tier)
    memory = tier.root if tier is not None else ""
    fetch_missing(session, common_in_ram(session, memory))
    agreed = agreed_save(session, memory)
    step, path = (None, None) if agreed is None else agreed
    lineage = None if path is None else lineage_of(path)
    # Before remove_stale: the directories past the resume point are what tells.
    tips = session.control.all_gather(
        None if step is None or lineage is None else tip(session, step, lineage)
    )
    remove_stale(session, step)
    if tier is not None:
        tier.remove_stale(path)
    newest = max((t for t in tips if t is not None), default=None)
    session.lineage = lineage if newest is None else None
    if newest is not None and step is not None:
        _say_branch(session, step, newest)
    if step is None:
        if session.topo.rank == 0:
            session.log.info(
                "no committed checkpoint in %s: training from the start",
                session.layout.checkpoints,
            )
        return None, None, []
    if session.topo.rank == 0:
        in_ram = " (a snapshot in RAM)" if path != session.layout.checkpoint_dir(step) else ""
        session.log.info("resuming from %s%s", path, in_ram)
    return step, path, []


def _say_branch(session: Session, step: int, newest: int) -> None:
    if session.topo.rank == 0:
        session.log.info(
            "resuming from %s, below %s of the same lineage (an attempt that could not be "
            "resumed from, or a rollback): this run's saves begin a new lineage, which "
            "restores prefer to that branch whatever their steps",
            checkpoint_name(step),
            checkpoint_name(newest),
        )
