"""Which checkpoint a restore takes: the newest committed in S3, the same one on every node.

Node 0's manifest of every checkpoint is read (`Remote.heads`, in parallel), and the candidates
go by run, then step (validity.newness): the newest-born lineage first, its highest step first.
The first one committed in S3 (validity.s3_problems) that has not failed its checksum twice is
chosen. A pin younger than PIN_HOLD, with no save made after it, chooses instead; a restore
that downloads pins its choice (`pin`), and never falls back below a pin whose checkpoint is
gone (PinnedGoneError: the restore lists again until its patience runs out). restore.py has the
whole story; this module decides, restore.py downloads.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import status, validity
from jitckpt_entrypoint.protocol.layout import Layout, checkpoint_name, checkpoint_steps
from jitckpt_sidecar.config import Config
from jitckpt_sidecar.errors import SidecarError
from jitckpt_sidecar.remote import Pin, Remote
from jitckpt_sidecar.s3 import describe, is_storage_error, is_transient


class PinnedGoneError(SidecarError):
    """The checkpoint another node's restore pinned is gone, and nothing newer is committed."""


class Chooser:
    def __init__(
        self,
        remote: Remote,
        cfg: Config,
        layout: Layout,
        logger: logging.Logger,
        *,
        clock: Callable[[], float] = time.time,
        partial: bool = False,
    ) -> None:
        self.remote, self.cfg, self.layout, self.log, self.clock = (
            remote,
            cfg,
            layout,
            logger,
            clock,
        )
        self.partial = partial
        """Restore a sharded checkpoint in part (`node_part`): only where a long-running sidecar
        stays to fetch the rest when the trainer asks (the one-shot `restore` restores whole)."""
        self.listed: tuple[list[int], dict[int, m.Manifest]] = ([], {})
        """The steps under the prefix and node 0's manifests, as `choose` listed them last."""
        self.failed: dict[tuple[int, str], int] = {}
        """(step, save id) -> checksum failures: twice, and the checkpoint is passed over."""

    def list_above(self, step: int) -> None:
        """List again: the steps under the prefix, and node 0's manifests of those above `step`
        (for `record_tip`)."""
        steps = self.remote.steps()
        self.listed = (steps, self.remote.heads([s for s in steps if s > step]))

    def newest_local(self) -> Optional[m.Manifest]:
        """Node 0's manifest of the newest local checkpoint that is committed and holds what
        this node loads (every file, unless node_part applies), in the restore's order."""
        found = []
        for step in checkpoint_steps(self.layout.checkpoints):
            path = self.layout.checkpoint_dir(step)
            save = validity.committed(path)
            if save is None and self.node_part(validity.local_save(path)) is not None:
                save = validity.loadable(path, self.cfg.node_rank or 0, self.cfg.nnodes)
            if save is not None:
                found.append(save[0])
        return max(found, key=validity.newness, default=None)

    def node_part(self, save: Optional[dict[int, m.Manifest]]) -> Optional[int]:
        """This node's rank when it restores only what its ranks load: a long-running sidecar
        (`partial`), its node rank and the job's node count known (JITCKPT_NODE_RANK,
        JITCKPT_NNODES), and the checkpoint of that node count (at another count DCP reshards,
        reading every file)."""
        node, nodes = self.cfg.node_rank, self.cfg.nnodes
        if not self.partial or not save or node is None or nodes is None:
            return None
        if nodes != save[0].nodes or node >= nodes:
            return None
        # A dynamic rendezvous numbers the nodes in its own order: the node rank of the pod is
        # not the trainer's then.
        if os.environ.get("PET_RDZV_BACKEND", "static") not in ("", "static"):
            return None
        return node

    def choose(self) -> tuple[Optional[validity.RemoteCheckpoint], bool]:
        """The checkpoint this round restores, or None; and whether a pin chose it (else the
        caller pins it with pin, once it knows it downloads it)."""
        steps = self.remote.steps()
        heads = self.remote.heads(steps)
        self.listed = (steps, heads)
        pin = self.remote.pinned(self.clock())
        if pin is not None and any(h.created_at > pin.pinned_at for h in heads.values()):
            pin = None  # training saved after it: that round is over
        if pin is not None and self.failed.get((pin.step, pin.save_id), 0) >= 2:
            # Its object in S3 fails the checksum: no node can have restored it, so there is no
            # floor to keep.
            pin = None
        if pin is not None:
            ckpt = self.remote.load(pin.step)
            if ckpt.committed and ckpt.save_id == pin.save_id:
                self.log.info(
                    "restoring %s: pinned by the first restore of this round, %.0f s ago",
                    checkpoint_name(pin.step),
                    self.clock() - pin.pinned_at,
                )
                return ckpt, True
        best = self._best(heads, floor=None if pin is None else (pin.lineage, pin.step))
        if best is None:
            if pin is not None:
                raise PinnedGoneError(
                    f"{checkpoint_name(pin.step)}, which another node restored, is no longer "
                    "committed in S3 and nothing newer is; not falling back below it"
                )
            return None, False
        for step in sorted(set(steps) - set(heads), reverse=True):
            if step > best.step:
                self.log.info(
                    "skipping %s in S3: not committed (no manifest of node 0)",
                    checkpoint_name(step),
                )
        self._say_passed_over(heads, best)
        return best, False

    def record_tip(self, resumed: Optional[m.Manifest]) -> None:
        """Tell the trainer (status.LineageTip) the newest step of `resumed`'s lineage that S3
        holds a save of, committed or not, when it is above `resumed` (the checkpoint the
        trainer will resume from): such a save may still be completed by an attempt's late
        upload, and a run resuming below it must begin a new lineage to come first (the
        rollback rule, hook/resume.py). By node 0's manifest, the one read of every step: a
        step only other nodes uploaded cannot be completed without node 0's, and a late upload
        of it meets the round's pin (uploader.py)."""
        tip = None
        if resumed is not None:
            _, heads = self.listed
            above = [h.step for h in heads.values() if h.step > resumed.step]
            for step in sorted(above, reverse=True):
                if heads[step].lineage == resumed.lineage:
                    tip = status.LineageTip(resumed.lineage, step)
                    break
        try:
            if tip is None:  # nothing above: no record
                status.LINEAGE_TIP.remove(self.layout.status)
            else:
                status.LINEAGE_TIP.write(self.layout.status, tip)
        except OSError as exc:  # the hook then knows only what the volume shows
            self.log.warning("cannot record the newest save of the run in S3: %s", exc)
            return
        if tip is not None:
            self.log.info(
                "S3 also holds %s of this run (not restored: not committed, or passed over); the "
                "trainer begins a new lineage from %s, so its saves come first",
                checkpoint_name(tip.step),
                checkpoint_name(resumed.step if resumed else 0),
            )

    def pin(self, best: validity.RemoteCheckpoint) -> validity.RemoteCheckpoint:
        """Pin `best` for the other nodes' restores; returns what this restore downloads (another
        node's choice when it pinned at the same moment)."""
        try:
            written = self.remote.pin(best, self.clock())
        except Exception as exc:
            if is_storage_error(exc) and is_transient(exc):
                raise
            self.log.warning(
                "cannot pin %s for the other nodes' restores (%s); restoring it unpinned",
                checkpoint_name(best.step),
                describe(exc, self.cfg, "PutObject", str(self.remote.uri)),
            )
            return best
        again = self.remote.pinned(self.clock())
        if again is not None and (again.step, again.save_id) != (written.step, written.save_id):
            return self._follow(again) or best
        return best

    def _best(
        self, heads: dict[int, m.Manifest], floor: Optional[tuple[str, int]]
    ) -> Optional[validity.RemoteCheckpoint]:
        for head in sorted(heads.values(), key=validity.newness, reverse=True):
            if floor is not None and validity.newness(head) < floor:
                break
            if self.failed.get((head.step, head.save_id), 0) >= 2:
                continue
            ckpt = self.remote.load(head.step)
            found = validity.s3_problems(ckpt)
            if found:
                self.log.info(
                    "skipping %s in S3: not committed (%s)", checkpoint_name(head.step), found[0]
                )
                continue
            return ckpt
        return None

    def _follow(self, pin: Pin) -> Optional[validity.RemoteCheckpoint]:
        """Another node pinned at the same moment: take its choice when it is committed."""
        ckpt = self.remote.load(pin.step)
        if ckpt.committed and ckpt.save_id == pin.save_id:
            self.log.info(
                "another node pinned %s at the same moment: restoring that one",
                checkpoint_name(pin.step),
            )
            return ckpt
        return None

    def _say_passed_over(
        self, heads: dict[int, m.Manifest], best: validity.RemoteCheckpoint
    ) -> None:
        """One line when S3 also holds an earlier run's checkpoints (not restored)."""
        others = sorted(
            {h.lineage for h in heads.values() if h.lineage != (best.lineage or "")},
            reverse=True,
        )
        if not others:
            return
        newest = max(h.step for h in heads.values() if h.lineage == others[0])
        self.log.info(
            "%s also holds checkpoints of %d other run(s) (e.g. lineage %s, up to %s): not "
            "restored; %s is of the newest run (lineage %s)",
            self.remote.uri,
            len(others),
            others[0] or "from before lineages",
            checkpoint_name(newest),
            checkpoint_name(best.step),
            best.lineage or "from before lineages",
        )


def replaces(chosen: validity.RemoteCheckpoint, local: Optional[m.Manifest]) -> bool:
    """Whether restoring `chosen` downloads: the volume holds nothing as new, or holds another
    save of its step (replaced: the nodes load one save)."""
    if local is None:
        return True
    here, there = validity.newness(local), (chosen.lineage or "", chosen.step)
    return here < there or (here == there and local.save_id != chosen.save_id)
