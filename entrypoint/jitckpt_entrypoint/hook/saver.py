"""One save, from the adapter's request to committed or abandoned: the hook's save pipeline.

The checkpoint manager (manager.py) owns the lifecycle (training, resume, the JIT stop) and
hands every save here through one call, `save_step` (the Trainer's; the plain loop's `save`
and `save_dcp_async` begin through `begin_save`, then write through `write_own` and
`save_dcp`). A save (saves.py's `Save`) moves through named states, changed only under
`lock`:

- PLANNED: `begin_save`, on the training thread: a step already committed is skipped (a crash
  while overwriting one would leave a manifest in front of torn files), the kind is picked, the
  sidecar is told a save started (its save-peak sampler).
- written by one of three ways, each ending in this rank's outcome (ok, cancelled, disk full,
  failed): `write_own` (the Trainer's own save or the plain loop's write, on the training
  thread: its errors are the library's own and propagate, as without jitckpt, a full disk
  named in one line first), `save_now` (the JIT save's fast path: the Trainer's files written
  here from the live tensors), `save_async` (periodic saves' fast path: the small files here,
  a host copy planned, the rest on the background writer, inflight.py). The fast paths catch
  everything after the Trainer's one collective (`store_flos`, which every rank passes first):
  never an exception into training. Whether they write a save is the gates' (gates.py).
- a snapshot in RAM (`save_snapshot`, memory_tier.py): the periodic fast path's parts written
  the same way into JITCKPT_MEMORY_DIR, committed there by the background writer, never counted
  as committed on the volume; a failed one turns snapshots off, not the fast paths.
- a periodic save written out (`_write_out`): with the entrypoint's RAM writer running, the
  same snapshot in RAM, which the writer (another process) writes to the volume and commits
  there; the next save's `begin_save` waits for its answer (`_collect_write_out`): counted as
  committed, HF's rotation run then. The plain loop's periodic save likewise
  (`write_out_own`: its `dcp.save` into RAM on the training thread).
- COMMITTED or ABANDONED: `saved` (committer.commit, collective, with every rank's outcome):
  committed when every rank wrote, else the directory is removed on every node (no rotation
  slot, no resume point, no space held). A full disk is reported in one line (volume, bytes
  needed, bytes free); a fast path that failed turns the fast paths off for the rest of the
  run (the Trainer's own save from then on, one line); a JIT save that failed is written again
  by the Trainer's own save, after what can be freed (uncommitted directories) is freed.

Threads: the training thread owns `_pending`, `_skipped` and the gates; the background writer
commits the save in flight; every `Save.state`, `_committed` and `blocking` change under
`lock`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Any, Callable, Optional

from jitckpt_entrypoint.hook import committer, room
from jitckpt_entrypoint.hook.cadence import Cadence
from jitckpt_entrypoint.hook.control import ControlGroup
from jitckpt_entrypoint.hook.gates import Gates
from jitckpt_entrypoint.hook.inflight import InFlight
from jitckpt_entrypoint.hook.memory_tier import MemoryTier
from jitckpt_entrypoint.hook.records import Records
from jitckpt_entrypoint.hook.saves import (
    Outcome,
    Save,
    SaveParts,
    SaveRequest,
    Staged,
    State,
    Vote,
    outcome_of,
)
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.protocol import write_out
from jitckpt_entrypoint.protocol.commit import remove_checkpoint, withdraw
from jitckpt_entrypoint.protocol.layout import checkpoint_name, checkpoint_steps
from jitckpt_entrypoint.protocol.validity import committed, kept


@dataclasses.dataclass
class Handed:
    """A periodic save handed to the RAM writer (saver.py's `_write_out`)."""

    step: int
    rotate: Callable[[], None]
    """Its after-commit (HF's rotation), run once the writer committed it."""
    measured: int
    """Its overhead-budget number (cadence.py); 0 once reported."""
    snap: Save
    """Its snapshot in RAM."""


class Saver:
    def __init__(
        self, session: Session, cadence: Cadence, records: Records, kind_of: Callable[[int], str]
    ) -> None:
        self.session = session
        self.cadence = cadence
        self.records = records
        self._kind_of = kind_of
        """The kind of a step's save (jit, final, periodic): the manager's stop and end."""
        self.lock = threading.Lock()
        self._committed: set[int] = set()
        """Steps committed (or resumed from) in this process; identical on every rank."""
        self._pending: Optional[Save] = None
        """The save begun on the training thread, until `saved` or the background writer."""
        self.inflight = InFlight(session, self.lock, self._commit)
        """The async save handed to the background writer, until drained."""
        self.gates = Gates(session)
        """Whether the fast paths write a save (agreed on every rank)."""
        self.tier = MemoryTier(session)
        """Snapshots in RAM (JITCKPT_MEMORY_DIR)."""
        self._phases = ""
        """Where `save_now`'s time went (small files, big files), for the commit's log."""
        self._expected_bytes = 0
        """About what one checkpoint takes on this node's volume (for a full disk's report)."""
        self._skipped: set[int] = set()
        self.periodic = 0
        """Periodic saves begun in this process (the same on every rank): save requests'
        tokens (the manager's step agreement)."""
        self.periodic_step: Optional[int] = None
        """The step of the last periodic save begun."""
        self.blocking: list[tuple[int, float]] = []
        """(step, seconds the training thread was held) of every async save, in order."""
        self._handed: Optional[Handed] = None
        """The periodic save handed to the RAM writer, until its answer is read (the same on
        every rank)."""

    def is_committed(self, step: int) -> bool:
        with self.lock:
            return step in self._committed

    def checkpoint_dir(self, step: int) -> str:
        return self.session.layout.checkpoint_dir(step)

    def resumed(self, step: Optional[int], removed: list[int]) -> None:
        """Training resumes from `step` (committed); `removed` steps are gone."""
        with self.lock:
            self._committed.difference_update(removed)
            if step is not None:
                self._committed.add(step)

    def committed_steps(self) -> set[int]:
        with self.lock:
            return set(self._committed)

    def left_behind(self, steps: set[int]) -> None:
        """Every rank: a failed attempt's saves (manager.retried), and a save of it cut short,
        are gone; the retry writes those steps again."""
        self._pending = None
        with self.lock:
            self._committed -= steps

    def training_ended(self) -> None:
        """Collective: a save handed to the RAM writer is waited for (its rotation runs); the
        fast paths' state, the writer and the host copies' buffers go."""
        self._collect_write_out()
        self._skipped.clear()
        self.gates.reset()
        self.tier.reset()
        self.inflight.close()

    def saved(self, step: int, path: Optional[str] = None) -> float:
        """Collective, after every rank wrote `step` (or skipped it): commit it (an async save
        of it: the background writer commits it now); the seconds its save took when it was
        committed here, else 0."""
        save, self._pending = self._pending, None
        inflight = self.inflight.save
        if (
            inflight is not None
            and inflight.step == step
            and not (inflight.snapshot and not inflight.written_out)
        ):
            inflight.ready.set()  # the background writer commits it now
            return 0.0
        if step in self._skipped:
            self._remove_skipped(step)
            return 0.0
        if self.is_committed(step) or (self._handed is not None and self._handed.step == step):
            return 0.0
        if save is None or save.step != step:  # written without begin_save
            save = Save(step, self._kind_of(step), path or self.checkpoint_dir(step), time.time())
        seconds = self._commit(save)
        if self._retries(save):
            seconds = self._retry_own(save)
        return seconds

    def save_dcp(self, save: Save, start: Callable[[str, Any], Any]) -> None:
        """Training thread, after `begin_save`: DCP's own `async_save` (inflight.py)."""
        self.inflight.save_dcp(save, start)  # DCP's errors are its own: the save stays pending
        self._pending = None

    def save_step(self, request: SaveRequest) -> None:
        """Training thread, the one call an adapter makes to save a step (collective; `saved`
        commits it once the library is done with the directory). Decides, alike on every
        rank: skipped (JITCKPT_ASYNC_BUSY=skip), committed already (nothing to write), the
        fast path's `parts` (async for a periodic save, now for a JIT or final one), a staged
        write of the library's own save (`stage`, periodic only), or the library's own."""
        if self.should_skip(request.step):
            return
        save = self.begin_save(request.step)
        if save is None:
            return
        own, stage = request.own, request.stage
        if self.async_on and request.parts is not None:
            parts, problem = self._parts(request.parts)
            if self.use_fast(problem) and parts is not None:
                if save.kind == "periodic" and self.tier.writes_out:
                    self._write_out(save, parts)
                elif save.kind == "periodic":
                    self.save_async(save, parts)
                else:
                    self.save_now(save, parts, own)
                return
        elif (
            self.async_on and stage is not None and save.kind == "periodic" and self.use_fast(None)
        ):
            self._save_staged(save, stage, own)
            return
        self.write_own(save, own)

    def save_snapshot(
        self, step: int, make: Callable[[], tuple[Optional[SaveParts], Optional[str]]]
    ) -> None:
        """Training thread, collective, at a step every rank snapshots (memory_tier.py): the
        fast path's parts of this step into JITCKPT_MEMORY_DIR, the big ones copied to host
        memory and written there by the background writer, which commits them. Passed over
        (the clock starts again) while a save is still being written: one save at a time, and
        training must not wait for a slow one."""
        if not self._snapshot_begins():
            return
        parts, problem = self._parts(make)
        if not self.use_fast(problem) or parts is None:
            return
        save = self._snapshot_of(step)
        after = functools.partial(self.tier.committed, step)
        self.inflight.save_async(save, dataclasses.replace(parts, after_commit=after))
        save.ready.set()  # nothing else writes into a snapshot's directory

    def save_snapshot_staged(
        self,
        step: int,
        stage: Callable[[Callable[[], object]], Staged],
        own: Callable[[], object],
    ) -> None:
        """Training thread, collective, at a step every rank snapshots: the library's own save
        `own` of this step into JITCKPT_MEMORY_DIR with its big writes staged (`stage`: FSDP's
        DCP saves, fsdp_checkpoint.py), written there by the background writer, which commits
        them. A rank whose save could not write a file (OSError: a full tmpfs, after the save's
        collectives) or could not stage ends the snapshot on every rank (its directory goes)
        and snapshots, in one line. Other errors are the library's own and propagate, as in
        `write_own`: its collectives may be half done on the other ranks."""
        if not self._snapshot_begins():
            return
        tier = self.tier
        save = self._snapshot_of(step)
        started = time.monotonic()
        staged: Optional[Staged] = None
        try:
            staged = stage(own)
        except OSError as exc:
            tier.failed = f"the snapshot of step {step} failed: {exc!r:.100}"
        if staged is not None and not staged.staged:
            tier.failed = f"DCP cannot stage the state of step {step} (a tensor it cannot copy)"
        if self.session.control.any_now(tier.failed is not None) or staged is None:
            if self.session.topo.is_leader:
                with contextlib.suppress(OSError):
                    remove_checkpoint(save.path)
            tier.turn_off(tier.failed or "a snapshot failed on another rank")
            return
        after = functools.partial(tier.committed, step, spares=False)  # DCP takes no spares
        self.inflight.save_staged(save, staged.write, after, started)
        save.ready.set()  # nothing else writes into a snapshot's directory

    def _write_out(self, save: Save, parts: SaveParts) -> None:
        """Training thread, after `begin_save` of a periodic save (collective): the save as a
        snapshot in RAM, which the RAM writer writes to the volume once committed there; the
        training process writes it itself (`save_async`) when the writer is gone or
        snapshots failed."""
        tier = self.tier
        if not self._still_writes_out():
            self.save_async(save, parts)
            return
        if self.session.topo.is_leader:
            # For what the Trainer writes there around its save call (a subclass's extra
            # files), as the library's own save has it: the writer copies the snapshot in.
            with contextlib.suppress(OSError):
                os.makedirs(save.path, exist_ok=True)
        snap = self._snapshot_of(save.step)
        snap.written_out = True  # measured until the writer's answer (`poll_write_out`)
        step, started_at = save.step, save.started_at

        def after_commit() -> None:  # background writer, every rank
            tier.committed(step)
            tier.ask(step, started_at)

        self._handed = Handed(step, parts.after_commit, save.measured, snap)
        # Committed (and handed to the writer) once `saved` says the Trainer's save call is done.
        self.inflight.save_async(snap, dataclasses.replace(parts, after_commit=after_commit))
        self._pending = None

    def write_out_own(
        self,
        save: Save,
        write: Callable[[str], object],
        errors: tuple[type[BaseException], ...] = (OSError,),
    ) -> bool:
        """Training thread, collective, after `begin_save` of the plain loop's periodic save
        while the RAM writer runs: `write(path)` (its `dcp.save`) into JITCKPT_MEMORY_DIR as a
        snapshot, committed there and handed to the writer, which writes it to the volume.
        False when it was not (snapshots failed, `errors` on a rank, or the writer is gone):
        the caller writes the save to the volume itself. Other errors are the library's own
        and propagate, as in `write_snapshot`."""
        tier = self.tier
        if save.kind != "periodic" or not tier.writes_out or not self._still_writes_out():
            return False
        if self.session.topo.is_leader:
            # There at once, as after the library's own save (the writer keeps what the script
            # writes into it meanwhile, as `_write_out` does for a Trainer subclass).
            with contextlib.suppress(OSError):
                os.makedirs(save.path, exist_ok=True)
        step, started_at = save.step, save.started_at

        def after_commit() -> None:  # every rank, on the commit of the snapshot
            tier.committed(step, spares=False)
            tier.ask(step, started_at)

        snap = self._write_snapshot_here(step, write, errors, after_commit)
        if snap is None:
            return False
        snap.written_out = True
        self._handed = Handed(step, lambda: None, save.measured, snap)
        return True

    def _still_writes_out(self) -> bool:
        """Collective, before a periodic save is handed to the RAM writer: whether it still
        is (no snapshot failed on any rank, the writer lives)."""
        tier, control = self.tier, self.session.control
        if control.any_now(tier.failed is not None):
            tier.turn_off(tier.failed or "a snapshot failed on another rank")
        elif control.any_now(self.session.topo.rank == 0 and tier.writer() is None):
            tier.stop_writing_out("the RAM writer is gone")
        return tier.writes_out

    def settle(self) -> None:
        """Collective: the save handed to the RAM writer, if any, answered (committed or not)."""
        self._collect_write_out()

    def _collect_write_out(self) -> None:
        """Collective, before a save begins: the answer to the save handed to the RAM writer
        (rank 0 waits for it): committed (then HF's rotation runs, as after any commit), or
        not written (the training process writes the periodic saves from then on)."""
        if self._handed is None:
            return
        handed, self._handed = self._handed, None
        tier, topo, step = self.tier, self.session.topo, handed.step
        began = time.monotonic()
        tier.settle()
        if handed.measured:  # not reported by a step: its wait for the writer held training
            blocked = handed.snap.blocked + time.monotonic() - began
            self.cadence.save_finished(handed.measured, time.monotonic(), blocked)
        answer = self.session.control.all_gather(tier.answer() if topo.rank == 0 else None)[0]
        if answer is None or not answer.ok:
            if topo.is_leader:
                path = self.checkpoint_dir(step)
                with contextlib.suppress(OSError):  # else the next resume removes it
                    if committed(path, topo.node) is None:
                        remove_checkpoint(path)  # no rotation slot for a save not there
            # Stopped: the JIT save follows (quietly). Else abandoned in RAM (its own line
            # said why), or the writer failed or is gone.
            why = "no answer" if answer is None else answer.error
            stopped = answer is not None and answer.error == write_out.STOPPED
            tier.stop_writing_out(
                None if stopped else f"{checkpoint_name(step)} was not written out ({why})"
            )
            return
        with self.lock:
            self._committed.add(step)
        self.records.advisory(self.records.announce)
        try:
            handed.rotate()
        except Exception as exc:  # noqa: BLE001 - HF's rotation of older checkpoints only
            self.session.log.warning("HF's checkpoint rotation failed: %r", exc)

    def write_snapshot(
        self,
        step: int,
        write: Callable[[str], object],
        errors: tuple[type[BaseException], ...] = (OSError,),
    ) -> None:
        """Training thread, collective, at a step every rank snapshots: `write(path)` (the plain
        loop's `dcp.save`) into JITCKPT_MEMORY_DIR on this thread, then the commit there.
        `errors` (DCP's CheckpointException, which every rank raises alike) abandon the
        snapshot and turn snapshots off; any other error is the library's own and propagates,
        as it would without jitckpt (its collectives may be half done on the other ranks)."""
        if not self._snapshot_begins(fast=False):
            return
        after = functools.partial(self.tier.committed, step, spares=False)
        self._write_snapshot_here(step, write, errors, after)

    def _write_snapshot_here(
        self,
        step: int,
        write: Callable[[str], object],
        errors: tuple[type[BaseException], ...],
        after_commit: Callable[[], None],
    ) -> Optional[Save]:
        """Collective: `write(path)` into the snapshot of `step` on this thread, then its
        commit there; the snapshot when it was committed, else None and snapshots are off
        (decided from the vote: the same on every rank)."""
        began = time.monotonic()
        snap = self._snapshot_of(step)
        snap.after_commit = after_commit
        try:
            write(snap.path)
        except errors as exc:
            snap.failed(exc)
        snap.blocked = time.monotonic() - began  # written on the training thread
        self._commit(snap)
        if snap.state is State.COMMITTED:
            return snap
        self.tier.turn_off(self.tier.failed or f"the snapshot of step {step} failed")
        return None

    def poll_write_out(self) -> None:
        """Rank 0 (the clock that decides time-based saves), after every step while a save is
        written out: the writer's answer ends the overhead budget's measurement of it, so that
        its cost counts the steps its copy slowed and its write time the writer's (the interval
        is never shorter than that: one save at a time). Never raises."""
        handed = self._handed
        if handed is None or not handed.measured or self.session.topo.rank != 0:
            return
        if self.tier.answered():
            self.cadence.save_finished(handed.measured, time.monotonic(), handed.snap.blocked)
            handed.measured = 0

    def _snapshot_begins(self, fast: bool = True) -> bool:
        """Collective: whether the snapshot of this step is taken (not after a failure, not
        while a save is still being written; `fast`: written by the fast path, which must be
        on)."""
        tier, control = self.tier, self.session.control
        if not tier.on:
            return False
        tier.began()
        self.cadence.not_compared()  # this step's time says nothing of a periodic save's cost
        if control.any_now(tier.failed is not None):  # set by the background writer
            tier.turn_off(tier.failed or "a snapshot failed on another rank")
            return False
        # The snapshot written out must stay; a newer one waits for the peer's copy of the last.
        busy = self.inflight.busy or tier.writing_out() or tier.replicating()
        return not control.any_now(busy or (fast and not self.gates.on))

    def _snapshot_of(self, step: int) -> Save:
        """Collective: the snapshot's directory cleared (an older save of the step, one cut
        short), then its Save."""
        self.inflight.drain()
        try:
            self.tier.prepare(step)
        except OSError as exc:
            self.session.log.warning("cannot clear %s: %s", self.tier.root, exc)
        self.session.control.barrier()  # no rank writes into it before it is cleared
        return Save(step, "periodic", self.tier.path(step), time.time(), snapshot=True)

    def begin_save(self, step: int, path: Optional[str] = None) -> Optional[Save]:
        """Training thread, before the files are written; None: `step` is committed, skip it.
        Drains an async save in flight first (one save at a time); a snapshot in RAM still
        being copied or written is cancelled (this save is newer; the previous snapshot
        stays); the answer to a save handed to the RAM writer is awaited."""
        inflight = self.inflight.save
        cancel = inflight is not None and inflight.snapshot and not inflight.written_out
        self.inflight.drain(step if cancel else None)
        self._collect_write_out()  # the volume has one writer at a time
        self._skipped.discard(step)  # saved after all (training ended at a skipped step)
        if self.is_committed(step):
            return None
        save = Save(step, self._kind_of(step), path or self.checkpoint_dir(step), time.time())
        session = self.session
        if session.topo.is_leader:
            # A directory of the step from before (an earlier run's, a script that resumed
            # from an older checkpoint itself) must not count as committed while this save
            # rewrites it: its manifests go first.
            withdraw(save.path)
        self.records.save_started(step, save.started_at)
        if self.tier.on:
            self.tier.covered()  # a newer save than any snapshot: the snapshot clock restarts
        if save.kind == "periodic":
            self.periodic += 1
            self.periodic_step = step
            save.measured = self.cadence.save_began(time.monotonic())
        self._pending = save
        return save

    def write_own(self, save: Save, write: Callable[[], object]) -> None:
        """Training thread: `write()` writes `save` the library's own way (the Trainer's own
        save, the plain loop's `dcp.save`). Its errors are the library's own and propagate, as
        they would without jitckpt: its collectives may be half done on the other ranks, so no
        rank may carry on alone. A full disk is named in one line first; the partial directory
        is removed when training resumes (resume.remove_stale)."""
        try:
            write()
        except Exception as exc:
            if outcome_of(exc, save.path) == Outcome.DISK_FULL:
                root = self.session.layout.checkpoints
                name = checkpoint_name(save.step)
                needed = self._expected_bytes
                self.session.log.error(room.no_space(name, root, needed, False))  # noqa: TRY400
            raise
        self._advance(save, State.WRITTEN)

    def enable_async(
        self, snapshot_bytes: int, unsupported: Optional[str], growth: int = 0
    ) -> bool:
        """Collective, once when training starts: the fast paths on every rank or none
        (gates.py, which says why not in one line)."""
        estimate = snapshot_bytes * self.session.topo.local_world_size
        if not self._expected_bytes:  # about what a checkpoint of this node takes
            self._expected_bytes = estimate
        deciding = self.session.cfg.async_save and not self.gates.decided
        on = self.gates.decide(snapshot_bytes, unsupported, growth)
        if deciding:  # this training's own estimate, until its first commit says better
            self._expected_bytes = estimate
        if on:
            self.inflight.start()
        return on

    @property
    def async_on(self) -> bool:
        return self.gates.on

    def use_fast(self, problem: Optional[str]) -> bool:
        """Collective, before a save the fast paths may write: whether they write this one, on
        every rank (gates.py). `problem`: why this rank's state is not theirs, or None."""
        if not self.gates.on:
            self.inflight.stager = None  # its host buffers are not needed any more
            return False
        return self.gates.use(problem)

    def should_skip(self, step: int) -> bool:
        """Collective, before a periodic save (JITCKPT_ASYNC_BUSY=skip): True on every rank
        when any rank's previous save is still being written; that step is then not saved."""
        if self.session.cfg.async_busy != "skip" or not self.gates.decided_on:
            return False
        if self._kind_of(step) != "periodic" or self.is_committed(step):
            return False  # a JIT or final save is never skipped
        inflight = self.inflight.save
        periodic = inflight is not None and (not inflight.snapshot or inflight.written_out)
        # A save the RAM writer still writes out counts as one being written.
        writing = (self.inflight.busy and periodic) or self.tier.writing_out()
        if not self.session.control.any_now(writing):  # a snapshot in RAM is cancelled instead
            return False
        self._skipped.add(step)
        # What runs after the Trainer's save call (a subclass's extra files, callbacks) may
        # write into the directory, as it would without jitckpt: it exists, and goes at `saved`.
        os.makedirs(self.checkpoint_dir(step), exist_ok=True)
        if self.session.topo.rank == 0:
            self.session.log.info(
                "skipping the save of step %d: the previous save is still being written", step
            )
        return True

    def save_async(self, save: Save, parts: SaveParts) -> None:
        """Training thread, after `begin_save`: small files and the copy of what the next
        forward changes now, the rest in the background (inflight.py); the host copy's buffers
        of the snapshots stay while they are taken."""
        self.inflight.save_async(save, parts, keep=self.tier.on)
        self._pending = None

    def save_now(self, save: Save, parts: SaveParts, retry: Callable[[], object]) -> None:
        """Training thread, after `begin_save`: the same parts as `save_async`, written now
        from the live tensors (no copy; GPU state streams through direct_write's buffers), the
        big files side by side. The JIT and final saves; `saved` commits it, then runs
        `after_commit`. Should it fail on any rank, `retry` (the Trainer's own save) writes it
        again: a JIT save always, after what can be freed is freed; a final save when the
        fast path failed, not for a full disk (training is over: it ends as it would have)."""
        from jitckpt_entrypoint.hook.writer import WRITERS, write_files

        save.after_commit, save.retry = parts.after_commit, retry
        started = time.monotonic()
        small = started
        try:
            parts.write_small(save.path)
            small = time.monotonic()
            _sync_devices(parts.tensors)
            write_files(parts.writers(save.path, parts.tensors, WRITERS, None))
        except Exception as exc:  # noqa: BLE001 - never into training: the retry writes it
            save.failed(exc)
        if save.outcome == Outcome.OK:
            self._advance(save, State.WRITTEN)
        self._phases = (
            f"small files {small - started:.2f} s, big files {time.monotonic() - small:.2f} s"
        )

    @staticmethod
    def _parts(
        make: Callable[[], tuple[Optional[SaveParts], Optional[str]]],
    ) -> tuple[Optional[SaveParts], Optional[str]]:
        """The fast path's parts of the save, or why this rank cannot give them."""
        try:
            return make()
        except Exception as exc:  # noqa: BLE001 - the library's own save knows its state
            return None, f"cannot read the state to save ({exc!r:.80})"

    def _save_staged(
        self,
        save: Save,
        stage: Callable[[Callable[[], object]], Staged],
        own: Callable[[], object],
    ) -> None:
        """The library's own save `own` with its big writes staged (`stage`), written in the
        background; when any rank could not stage, every rank writes now."""
        started = time.monotonic()
        staged = stage(lambda: self.write_own(save, own))
        if self.session.control.any_now(not staged.staged):  # some rank could not stage
            staged.write_now()  # every rank, DCP's collectives on the training group as usual
            staged.after_commit()  # HF's rotation, where its own save would have run it
            return
        self.inflight.save_staged(save, staged.write, staged.after_commit, started)
        self._pending = None

    def _remove_skipped(self, step: int) -> None:
        """Collective: a skipped save's directory (created for whatever writes into it after
        the Trainer's save call) is removed, holding no rotation slot."""
        self.session.control.barrier()
        if self.session.topo.is_leader:
            remove_checkpoint(self.checkpoint_dir(step))

    def _advance(self, save: Save, state: State) -> None:
        with self.lock:
            save.state = state

    def _commit(self, save: Save, control: Optional[ControlGroup] = None) -> float:
        """Collective (on `control`, the training's by default): commit `save`, or abandon it
        when any rank's outcome is not ok; returns the seconds from its start to the end."""
        try:
            self._commit_or_abandon(save, control)
        finally:  # whatever raised (HF's rotation), the next time-based save is not held up
            if save.kind == "periodic":
                blocked = save.blocked if save.job is not None else None
                self.cadence.save_finished(save.measured, time.monotonic(), blocked)
        return time.time() - save.started_at

    def _commit_or_abandon(self, save: Save, control: Optional[ControlGroup]) -> None:
        """The vote, then the commit (and its after_commit) or the abandon and its report."""
        session, step = self.session, save.step
        started = time.monotonic()
        vote = committer.commit(
            session,
            save.path,
            step,
            save.kind,
            save.started_at,
            outcome=save.outcome,
            control=control,
            snapshot=save.snapshot,
        )
        save.vote = vote
        if vote.committed and save.snapshot:
            self._advance(save, State.COMMITTED)
            self._log_snapshot(save)
            if save.after_commit is not None:
                save.after_commit()
        elif vote.committed:
            with self.lock:
                save.state = State.COMMITTED
                self._committed.add(step)
            self.records.advisory(self.records.announce)
            self._log_committed(save, vote, time.monotonic() - started)
            if save.after_commit is not None:
                save.after_commit()
        else:
            self._advance(save, State.ABANDONED)
            self._report_abandoned(save, vote)
        if save.job is not None:
            with self.lock:
                self.blocking.append((step, save.blocked))

    def _log_snapshot(self, save: Save) -> None:
        """The first snapshot in one line (rank 0); the rest at debug level."""
        level = logging.INFO if self.tier.taken <= 1 else logging.DEBUG
        if self.session.topo.rank == 0:
            self.session.log.log(
                level,
                "snapshot of step %d in RAM (%.2f s, training blocked %.3f s)",
                save.step,
                time.time() - save.started_at,
                save.blocked,
            )

    def _log_committed(self, save: Save, vote: Vote, commit_seconds: float) -> None:
        event = vote.event
        if event is None:
            return
        self._expected_bytes = event.bytes
        if save.job is not None:
            detail = f", async: training blocked {save.blocked:.3f} s"
        elif self._phases:  # written on this thread by save_now
            detail = f": {self._phases}, commit (fsync, manifests) {commit_seconds:.2f} s"
        else:
            detail = ""
        self._phases = ""
        self.session.log.info(
            "committed %s (%s, %.1f MB, %.2f s%s)",
            checkpoint_name(save.step),
            save.kind,
            event.bytes / 1e6,
            event.seconds,
            detail,
        )

    def _report_abandoned(self, save: Save, vote: Vote) -> None:
        """One line per cause: a full disk (each node's local rank 0, for its volume), a
        failure (the rank it happened on), a cancel (rank 0). A fast path that failed is off
        from now on (decided from the vote: the same on every rank)."""
        session, name = self.session, checkpoint_name(save.step)
        topo = session.topo
        if save.snapshot:
            if save.outcome == Outcome.FAILED:
                session.log.warning("snapshot of step %d not written: %s", save.step, save.error)
            if vote.any(Outcome.DISK_FULL):  # the training thread turns them off (in step)
                self.tier.failed = f"JITCKPT_MEMORY_DIR ({self.tier.root}) is full"
            elif vote.any(Outcome.FAILED):
                self.tier.failed = f"the snapshot of step {save.step} failed"
            return
        if save.outcome == Outcome.FAILED:
            session.log.error("%s not saved: %s", name, save.error)
        if topo.is_leader and vote.any(Outcome.DISK_FULL, topo.node):
            needed = self._expected_bytes
            session.log.error(room.no_space(name, session.layout.checkpoints, needed, True))
        if topo.rank == 0 and vote.any(Outcome.CANCELLED) and not vote.any(Outcome.FAILED):
            session.log.info("%s abandoned uncommitted", name)
        elif topo.rank == 0:
            session.log.warning("%s abandoned uncommitted; its directory is removed", name)
        fast = save.job is not None or save.retry is not None
        if fast and vote.any(Outcome.FAILED):
            self.gates.turn_off(f"a fast save of {name} failed")

    @staticmethod
    def _retries(save: Save) -> bool:
        """Whether an abandoned save written now by the fast path is written again (the same on
        every rank: decided from the vote)."""
        if save.state is not State.ABANDONED or save.retry is None or save.vote is None:
            return False
        return save.kind == "jit" or save.vote.any(Outcome.FAILED)

    def _retry_own(self, failed: Save) -> float:
        """Collective: a save written now by the fast path failed somewhere; the Trainer's own
        save writes it again, after uncommitted directories are freed."""
        retry, failed.retry = failed.retry, None
        self.make_room(failed.step, force=True)
        save = Save(failed.step, failed.kind, failed.path, time.time())
        save.after_commit = failed.after_commit
        if self.session.topo.rank == 0:
            self.session.log.info("writing %s with the Trainer's own save", failed.path)
        if retry is not None:
            self.write_own(save, retry)
        return self._commit(save)

    def make_room(self, step: int, force: bool = False) -> None:
        """Before a JIT save: when the volume has less free space than a checkpoint takes,
        remove the uncommitted checkpoint directories (this node's local rank 0)."""
        session = self.session
        if not session.topo.is_leader:
            return
        root = session.layout.checkpoints
        if not force and room.free_bytes(root) >= self._expected_bytes:
            return
        freed = []
        for other in checkpoint_steps(root):
            path = self.checkpoint_dir(other)
            topo = session.topo
            if other != step and not kept(path, topo.node, topo.nodes, topo.world_size):
                remove_checkpoint(path)
                freed.append(checkpoint_name(other))
        if freed:
            session.log.info(
                "removed uncommitted %s to make room for the JIT save (%s free)",
                ", ".join(freed),
                room.gb(room.free_bytes(root)),
            )


def _sync_devices(tree: dict[str, Any]) -> None:
    """Wait for the work queued on the GPUs the state lives on (the optimizer step), before
    other threads read it."""
    import torch

    from jitckpt_entrypoint.hook.snapshot import map_tree

    devices: set[torch.device] = set()
    map_tree(tree, lambda t: devices.add(t.device) if t.is_cuda else None)
    for device in devices:
        torch.cuda.synchronize(device)
