"""The RAM tier: snapshots of the Trainer's state in JITCKPT_MEMORY_DIR, a memory-backed volume.

A snapshot is a checkpoint in the usual files and layout, `<memory dir>/checkpoints/
checkpoint-<step>/`, committed with the same manifests (protocol.commit), written by the async
save path (saver.py, inflight.py: the host copy on the training thread, the files on the
background writer). It is not staged for upload and records no save event: the volume and S3
get the periodic saves as before. One committed snapshot is kept, besides the one being
written, so a crash in the middle of a snapshot leaves the previous one whole; at most two
snapshots' bytes are held. An older snapshot is retired, not deleted: its large files are the
spares the next snapshot writes over (ram_files.py), so the tmpfs pages are not freed and zeroed
again for every snapshot.

When: JITCKPT_SNAPSHOT_INTERVAL, a number of steps (every rank counts alike) or a duration
(rank 0's clock; its request rides in the step agreement, control.py, so every rank snapshots
the same step). A step that is saved to the volume needs no snapshot (the clock starts again);
a step with an evaluation gets none (the evaluation comes after it: the snapshot waits a step).

Written out (item "another process"): when the entrypoint's RAM writer runs (ram_writer.py,
protocol.write_out), a periodic save of the Trainer is a snapshot too, and the writer, not the
training process, writes it to the volume and commits it there (saver.py: `_write_out`). One
is written out at a time; no other snapshot is taken meanwhile (the one being written out
stays whole).

Resume (resume.py) counts a committed snapshot of this job's size like a checkpoint on the
volume: the newest wins (the same order as everywhere: lineage, then step).

Several nodes (each pod has its own memory volume): the Trainer's snapshot is whole on every
node (trainer_checkpoint.py `whole_node`: each node's local rank 0 writes the shared files, as
process 0 does), so a node resumes from RAM with its own files alone (validity.whole_here). It
is not a node's part of a save: the RAM writer does not write periodic saves out. A plain
loop's snapshots are refused there (its DCP shards are per rank: PART), and FSDP's full state.

FSDP with a sharded state: a snapshot is the Trainer's own save with its DCP saves staged
(trainer.py `_snapshot_staged`, saver.py `save_snapshot_staged`); its periodic saves are not
the RAM writer's (`written_out`). With several nodes a node holds its own ranks' shards, the
shared files (`save_on_each_node`) and the DCP files its ranks read that node 0 wrote
(dcp_reads.py `spread`): whole there by the read map its manifest records.

The peer replica (sidecar/peer.py: each node's sidecar keeps another node's newest snapshot;
a replacement pod's restores its own from it): a lost node's copy must be of a save every
other node still holds in RAM. While the sidecar says the peer answers (status.PEER_KEPT), an
older snapshot stays past a newer one's commit until the next snapshot begins, and that one
begins only once the peer keeps the newest (`replicating`; at most PEER_WAIT after its commit).
Still at most two snapshots' bytes: the older goes before the next is written.

Threads: `due`, `wanted`, `began`, `covered` on the training thread; `committed` on the
background writer (it only retires older snapshot directories).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Optional

from jitckpt_entrypoint.hook import ram_files, room
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.protocol import status, write_out
from jitckpt_entrypoint.protocol.commit import remove_checkpoint
from jitckpt_entrypoint.protocol.layout import checkpoint_name, checkpoint_steps
from jitckpt_entrypoint.protocol.manifest import Manifest
from jitckpt_entrypoint.protocol.validity import committed

PART = (
    "with several nodes a node's snapshot holds only its own ranks' files, and a resume from "
    "RAM needs every file its ranks load (the Trainer's DDP snapshots do; a plain loop's not yet)"
)
"""Why a plain loop's snapshots are off with several nodes (its DCP shards are per rank)."""
KEPT = 2
"""Snapshots whose bytes the volume must hold at once: the committed one and the next."""
WAIT_POLL = 0.02
"""Seconds between looks at the RAM writer's answer while waiting for it."""
PEER_LIVE = 10.0
"""Seconds: a peer record (status.PEER_KEPT) older than this is of a sidecar gone: not waited on."""
PEER_WAIT = 120.0
"""Seconds after its commit that a snapshot's replica at the peer is waited for at most."""


class MemoryTier:
    def __init__(self, session: Session) -> None:
        self.session = session
        cfg = session.cfg
        self.root = os.path.join(cfg.memory_dir, "checkpoints") if cfg.memory_dir else ""
        """Where snapshots go ("" without JITCKPT_MEMORY_DIR)."""
        self.seconds = cfg.snapshot_seconds
        self.steps = cfg.snapshot_steps
        self.on = False
        """Snapshots are taken (decided by `decide`, the same on every rank)."""
        self._decided = False
        self.taken = 0
        """Snapshots begun in this process (the same on every rank): the requests' tokens."""
        self._last: Optional[float] = None
        """Rank 0: when the last snapshot (or volume save) of this train() began."""
        self._asked = False
        self._wanted = False
        """Every rank: a snapshot is due (agreed on, or its step count reached) and not taken
        yet (an evaluation at its step puts it off by a step)."""
        self.failed: Optional[str] = None
        """Why a snapshot failed (set by the background writer; `on` changes only where every
        rank is in step: saver.save_snapshot)."""
        self._writer = False
        """The entrypoint's RAM writer writes periodic saves out (decided with `on`)."""
        self._request: Optional[str] = None
        """Rank 0: the id of the request for the save handed to the RAM writer."""
        self._deferred: Optional[bool] = None
        """Each node's local rank 0: older snapshots stay past a commit for the peer replica,
        retired at the next `prepare` (with spares: the value)."""
        self._said_peer = False
        self._peer_behind = False
        """The peer took longer than PEER_WAIT: not waited for until it keeps the newest."""

    @property
    def configured(self) -> bool:
        return bool(self.root)

    @property
    def decided(self) -> bool:
        return self._decided

    @property
    def timed(self) -> bool:
        """Snapshots go by rank 0's clock (they need the step agreement)."""
        return self.on and self.seconds is not None

    @property
    def writes_out(self) -> bool:
        """Periodic saves go to RAM and the RAM writer writes them to the volume."""
        return self.on and self._writer

    def path(self, step: int) -> str:
        return os.path.join(self.root, checkpoint_name(step))

    # -- deciding, once --

    def decide(
        self,
        snapshot_bytes: int,
        async_on: bool,
        not_whole: Optional[str] = PART,
        *,
        written_out: bool = True,
        host_copies: int = 1,
        lacking: Optional[str] = None,
    ) -> bool:
        """Collective, once per process when training starts: snapshots on every rank, or on
        none (one line why). `snapshot_bytes`: this rank's part of a snapshot; `not_whole`:
        why, in a job of several nodes, a node's snapshot would not hold every file its ranks
        load (None: it does, the Trainer's `whole_node`), so resuming from it is not possible;
        `written_out`: periodic saves may go through RAM to the RAM writer (not FSDP's);
        `host_copies`: copies of the state in host memory while a snapshot is taken (FSDP: the
        state dict accelerate offloads, and DCP's staged copy of it); `lacking`: why a
        snapshot would lack a file this rank's checkpoints hold. Every rank takes part,
        with JITCKPT_MEMORY_DIR or without (set on some nodes only: refused in one line)."""
        if self._decided:
            return self.on
        self._decided = True
        session, topo = self.session, self.session.topo
        pid = self.writer() if topo.rank == 0 else None
        gathered = session.control.all_gather((topo.node, snapshot_bytes, pid, self.configured))
        if not any(configured for *_, configured in gathered):
            return False
        node_bytes = sum(b for node, b, _, _ in gathered if node == topo.node)
        pid = gathered[0][2]
        without = sorted({node for node, _, _, configured in gathered if not configured})
        problem = None
        if without:
            problem = (
                f"JITCKPT_MEMORY_DIR is set on some nodes only (not on node "
                f"{', '.join(map(str, without))}); set it for every node's trainer"
            )
        elif not async_on:
            problem = "the Trainer's saves do not take the fast path (the line above says why)"
        elif lacking:
            problem = lacking
        elif topo.nodes > 1 and not_whole:
            problem = not_whole
        else:
            problem = self._room_problem(node_bytes, host_copies)
        refused = session.control.all_gather(problem)
        reasons = [r for r in refused if r]
        self.on = not reasons
        if self.on:
            ram_files.register(self.root)
        # With several nodes a node's snapshot is not its part of a save (each holds the
        # shared files): the training processes write periodic saves to the volume.
        self._writer = self.on and pid is not None and topo.nodes == 1 and written_out
        if topo.rank == 0 and not self.on:
            session.log.warning("no snapshots to RAM: %s", reasons[0])
        elif topo.rank == 0:
            self._say_on(node_bytes, pid, written_out)
        return self.on

    def _say_on(self, node_bytes: int, pid: Optional[int], written_out: bool) -> None:
        """Rank 0: snapshots are on, and who writes the periodic saves to the volume."""
        log = self.session.log
        every = f"{self.steps} steps" if self.steps else f"{self.seconds:g} s"
        size = f" ({room.gb(node_bytes)} each on this node)" if node_bytes else ""
        log.info("snapshots to RAM every %s into %s%s", every, self.root, size)
        if self._writer:
            log.info(
                "periodic saves go to RAM first; the RAM writer (pid %d) writes them to the volume",
                pid,
            )
        elif pid is not None and not written_out:
            log.info(
                "FSDP's periodic saves are written to the volume by the training processes "
                "(their DCP saves in the background), not the RAM writer"
            )
        elif pid is not None:
            log.info(
                "with several nodes the training processes write periodic saves to the volume "
                "(a node's snapshot holds what its ranks load, not its part of a save)"
            )
        elif self.session.run_id:  # under the entrypoint, which starts one
            log.info(
                "no RAM writer is running for this run (its own line says why): the training "
                "processes write periodic saves to the volume"
            )

    def _room_problem(self, node_bytes: int, host_copies: int = 1) -> Optional[str]:
        """Why two snapshots of this node do not fit in JITCKPT_MEMORY_DIR (and, beside
        `host_copies` of it, in the container's memory), or None."""
        try:
            os.makedirs(self.root, exist_ok=True)
            free = room.free_bytes(self.root)
            held = sum(room.tree_bytes(self.path(s)) for s in checkpoint_steps(self.root))
            held += room.tree_bytes(os.path.join(self.root, ram_files.SPARE))
        except OSError as exc:
            return f"cannot use JITCKPT_MEMORY_DIR {self.session.cfg.memory_dir}: {exc}"
        needed = KEPT * node_bytes
        if free + held < needed:
            return (
                f"two snapshots of node {self.session.topo.node} take {room.gb(needed)} and "
                f"JITCKPT_MEMORY_DIR ({self.session.cfg.memory_dir}) has {room.gb(free + held)}; "
                "raise its sizeLimit (and the pod's memory limit) or unset it"
            )
        # A memory-backed volume's pages count against the container's memory: two snapshots
        # beside the host copies a snapshot takes, where an OOM kill would end the very run
        # they are for.
        budget, total = room.budget(), (KEPT + host_copies) * node_bytes
        if not budget.fits(max(0, total - held)):
            copies = "the host copy" if host_copies == 1 else f"{host_copies} host copies"
            return (
                f"two snapshots of node {self.session.topo.node} and {copies} take "
                f"{room.gb(total)} of memory, more than "
                f"{room.HEADROOM:.0%} of the {budget.describe()}; raise the pod's memory limit"
            )
        return None

    def turn_off(self, why: str) -> None:
        """Training thread, on every rank in step: no more snapshots in this run."""
        if self.on and self.session.topo.rank == 0:
            self.session.log.warning("no more snapshots to RAM: %s", why)
        self.on = False
        self._drop_spares()

    def reset(self) -> None:
        """Training ended: nothing decided carries over."""
        self._decided, self.on, self.failed, self._writer = False, False, None, False
        self._drop_spares()

    def _drop_spares(self) -> None:
        """Each node's local rank 0: no snapshot will write over the spares; they go."""
        if self.configured and self.session.topo.is_leader:
            ram_files.remove(self.root)

    # -- written out by the RAM writer (protocol.write_out) --

    def writer(self) -> Optional[int]:
        """The pid of the entrypoint's RAM writer serving this run, else None."""
        if not self.configured:
            return None
        try:
            return write_out.writer(self.session.cfg.memory_dir, self.session.run_id)
        except OSError:
            return None

    def stop_writing_out(self, why: Optional[str]) -> None:
        """Every rank in step: periodic saves are written by the training process again
        (`why` in one line; None: quietly)."""
        if why is not None and self._writer and self.session.topo.rank == 0:
            self.session.log.warning(
                "periodic saves are written by the training process from now: %s", why
            )
        self._writer = False

    def ask(self, step: int, started_at: float) -> None:
        """Rank 0, once snapshot `step` is committed: the RAM writer writes it out."""
        if self.session.topo.rank != 0:
            return
        request = write_out.Request(write_out.new_id(), step, started_at, self.session.run_id)
        try:
            write_out.ask(self.session.cfg.memory_dir, request)
        except OSError as exc:  # never answered: the saver reads it as not written
            self.session.log.warning("cannot ask the RAM writer for step %d: %s", step, exc)
            return
        self._request = request.id

    def writing_out(self) -> bool:
        """Rank 0: a save is being written out by a live writer (its snapshot must stay)."""
        if not self.configured or self.session.topo.rank != 0:
            return False
        memory, run_id = self.session.cfg.memory_dir, self.session.run_id
        try:
            waiting = write_out.request(memory)
            if waiting is None:
                return False
            if write_out.writer(memory, run_id) is None:  # died with it: nobody answers it
                write_out.withdraw(memory, waiting.id)
                return False
        except OSError:  # cannot tell now (too many open files): still writing, look again
            return True
        return True

    def settle(self) -> None:
        """Collective: wait until no save is being written out (rank 0 looks; every rank joins
        a short round per look, so none waits in one collective for the whole copy; on every
        rank, with JITCKPT_MEMORY_DIR or without)."""
        control = self.session.control
        while control.any_now(self.session.topo.rank == 0 and self.writing_out()):
            time.sleep(WAIT_POLL)

    def answered(self) -> bool:
        """Rank 0: whether this process's last request has its answer (it stays to be read)."""
        if self._request is None:
            return False
        try:
            return write_out.answered(self.session.cfg.memory_dir, self._request) is not None
        except OSError:
            return False

    def answer(self) -> Optional[write_out.Answer]:
        """Rank 0, after `settle`: the answer to this process's last request, once."""
        asked, self._request = self._request, None
        if asked is None:
            return None
        try:
            return write_out.answered(self.session.cfg.memory_dir, asked)
        except OSError:
            return None

    # -- when --

    def started(self) -> None:
        """A train() begins: the clock counts from its first step."""
        self._last, self._asked, self._wanted = None, False, False

    def token(self, now: float) -> int:
        """Rank 0, once per step: a request's token when a time-based snapshot is due (once,
        until the agreement answers), else 0."""
        if not self.timed or self._asked:
            return 0
        if self._last is None:
            self._last = now
        if now - self._last < (self.seconds or 0.0):
            return 0
        self._asked = True
        return self.taken + 1

    def agreed(self, token: int) -> None:
        """Every rank, with the step agreement's snapshot token: a request not answered yet by
        a snapshot makes this step want one."""
        if token > self.taken:
            self._wanted = True

    def wanted(self, step: int) -> bool:
        """Every rank, after the agreement: whether this step wants a snapshot."""
        if not self.on:
            return False
        if self.steps and step % self.steps == 0:
            self._wanted = True
        return self._wanted

    def began(self) -> None:
        """A snapshot of this step begins (or was passed over as busy): the next one counts
        from now."""
        self.covered()

    def covered(self) -> None:
        """Every rank alike: this step is saved to the volume (or snapshotted): no snapshot is
        due until the interval passed again (a request already on its way is answered)."""
        self.taken += 1
        self._wanted, self._asked = False, False
        self._last = time.monotonic()

    # -- the directories --

    def prepare(self, step: int) -> None:
        """Each node's local rank 0, before a snapshot of `step`: what no resume uses goes
        (a cut-short snapshot, an older save of this step, a committed one older than the
        newest: kept past a commit for the peer replica, `committed`), the newest committed one
        stays."""
        if not self.session.topo.is_leader:
            return
        node = self.session.topo.node
        os.makedirs(self.root, exist_ok=True)
        kept = [s for s in checkpoint_steps(self.root) if s != step]
        whole = [s for s in kept if committed(self.path(s), node) is not None]
        for other in kept:
            path = self.path(other)
            if other not in whole:
                remove_checkpoint(path)
            elif other != whole[-1]:  # kept past its commit for the peer's copy (`committed`)
                self._retire(path, self._deferred is True)
        self._deferred = None
        remove_checkpoint(self.path(step))

    def committed(self, step: int, spares: bool = True) -> None:
        """Background writer, once snapshot `step` is committed on every node: the older ones
        go (each node's local rank 0), their large files kept as the spares of the next one
        (`spares`: written by direct_write, which takes them; what this one did not take goes,
        so at most two snapshots' bytes are held). With the peer replica, they stay until the
        next snapshot begins (`prepare`), which waits until the peer keeps this one
        (`replicating`)."""
        if not self.session.topo.is_leader:
            return
        with contextlib.suppress(OSError):  # the next commit tries again
            ram_files.remove(self.root)
            if self._peer_kept() is not None:  # until the peer keeps this one (`replicating`)
                self._deferred = spares
                return
            for other in checkpoint_steps(self.root):
                if other != step:
                    self._retire(self.path(other), spares)

    def _retire(self, path: str, spares: bool) -> None:
        if spares:
            ram_files.retire(self.root, path)
        else:
            remove_checkpoint(path)

    # -- the peer replica (sidecar/peer.py) --

    def _peer_kept(self) -> Optional[status.PeerKept]:
        """What the node keeping this node's replica holds of it, while the sidecar says so
        (a live record of the last PEER_LIVE seconds), else None: no peer replica."""
        if self.session.topo.nodes < 2:
            return None
        kept = status.PEER_KEPT.read(self.session.cfg.memory_dir)
        if kept is None or not kept.live or abs(time.time() - kept.at) > PEER_LIVE:
            return None
        return kept

    def replicating(self) -> bool:
        """Each node's local rank 0, before a snapshot: the newest one committed here is not
        kept by the peer yet, so no newer one is taken (the older stays until then: `committed`,
        `prepare`). A lost node's copy is then of a save every other node still holds. Not
        longer than PEER_WAIT after the newest one's commit (one line; snapshots go on without
        waiting until the peer keeps the newest again)."""
        kept = self._peer_kept() if self.on and self.session.topo.is_leader else None
        save = None if kept is None else self._newest_own()
        node = self.session.topo.node
        if kept is None or save is None or save[node].save_id == kept.save_id:
            self._peer_behind = False  # caught up (or nothing to wait for): waited for again
            return False
        if self._peer_behind:
            return False
        if time.time() - save[node].created_at < PEER_WAIT:
            return True
        self._peer_behind = True
        if not self._said_peer:
            self._said_peer = True
            self.session.log.warning(
                "the peer has not kept %s within %.0f s of its commit; snapshots go on without "
                "waiting for it until it catches up (said once)",
                checkpoint_name(save[node].step),
                PEER_WAIT,
            )
        return False

    def _newest_own(self) -> Optional[dict[int, Manifest]]:
        """The manifests of the newest snapshot committed on this node, or None (also when the
        directory cannot be read now)."""
        node = self.session.topo.node
        try:
            for step in reversed(checkpoint_steps(self.root)):
                save = committed(self.path(step), node)
                if save is not None:
                    return save
        except OSError:
            pass
        return None

    def clear(self) -> None:
        """Each node's local rank 0: every snapshot goes (JITCKPT_RESUME=0 starts over)."""
        if not self.configured or not self.session.topo.is_leader:
            return
        with contextlib.suppress(OSError):
            for other in checkpoint_steps(self.root):
                remove_checkpoint(self.path(other))
        self._drop_spares()

    def remove_stale(self, resumed_dir: Optional[str]) -> None:
        """Each node's local rank 0, at resume: every snapshot but the one resumed from goes
        (past the resume point training makes those steps again; below it, or uncommitted,
        none is ever used)."""
        if not self.configured or not self.session.topo.is_leader:
            return
        with contextlib.suppress(OSError):
            for other in checkpoint_steps(self.root):
                if self.path(other) != resumed_dir:
                    remove_checkpoint(self.path(other))
        self._drop_spares()
