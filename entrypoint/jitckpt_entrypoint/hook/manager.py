"""The one owner of a training process's checkpoint lifecycle: save, commit, JIT stop, resume.

Like torchtitan's CheckpointManager: the Trainer callback (trainer.py) and the plain-loop API
(hook/__init__.py) are thin adapters that say *when* (a step ended, a save was written,
training ended) and *how to write* (the Trainer's own `_save_checkpoint`, or `dcp.save`); this
object decides what happens and keeps the books (which steps are committed, what the sidecar's
retention must keep).

A save is two halves:
- `begin_save`, on the training thread: skip a step that is already committed (a crash while
  overwriting one would leave a manifest in front of torn files), pick the kind, tell the
  sidecar a save started (its save-peak sampler). The adapter then writes the files.
- `saved`, collective: the commit (every rank wrote: manifests, own node's last; staging; the
  save event), then leave if this was the JIT save or a SIGTERM arrived meanwhile.

An async save (issue 15; Trainer periodic saves, JITCKPT_ASYNC_SAVE=1) splits the write too:
`save_async`, on the training thread, drains the previous save (one in flight), writes the
small files, plans a host copy of the weights and optimizer state (snapshot.py) and hands the
rest to the background writer (writer.py): finish the copy, write the big files in the
Trainer's format, fsync, then a vote of every rank on the writer's own control group (all
wrote, none cancelled) and the commit, on that group. `before_update` (before the next
optimizer step) waits until the copy is done. Every synchronous save, the JIT stop and the end
of training drain first, so the Trainer's rotation never sees a checkpoint being written.

SIGTERM inside a training process, in order:
1. `signals.SigtermFlag` records the time; nothing else happens in the handler.
2. After every optimizer step the adapter asks `stop_agreed()`: an async all-reduce on the
   control group (control.py), read one round later, so every rank says yes at the same step.
3. `stop_at(step)`: an async save of an older step is cancelled (left uncommitted), one of
   this step is finished; that step is committed already → `finish_jit` at once; else the adapter
   saves it (kind jit) through `begin_save` and `save_now` (the async save's parts, written on
   the training thread) or its own writer.
4. `saved(step)` commits it, then `finish_jit`: `status/jit.json`, a barrier, and
   `os._exit(JITCKPT_EXIT_CODE)` on every rank.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any, Callable, NoReturn, Optional

from jitckpt_entrypoint.hook import committer, memory, resume
from jitckpt_entrypoint.hook.control import ControlGroup
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.layout import checkpoint_name
from jitckpt_entrypoint.protocol.manifest import KINDS

TYPE_CHECKING = False
if TYPE_CHECKING:
    from jitckpt_entrypoint.hook.snapshot import Stager, Staging
    from jitckpt_entrypoint.hook.writer import BackgroundWriter, Job


@dataclasses.dataclass(frozen=True)
class SaveParts:
    """A checkpoint written in parts (the Trainer's: trainer_checkpoint.TrainerCheckpoint)."""

    write_small: Callable[[str], None]
    """Training thread: everything small, into the checkpoint's directory."""
    tensors: Callable[[], dict[str, Any]]
    """The big state (model, optimizer) of this step, live."""
    writers: Callable[[str, dict[str, Any], int], list[Callable[[], object]]]
    """The big files from `tensors` or a host copy of them, one writer each, each writing
    with up to the given number of threads."""
    after_commit: Callable[[], None]
    """Once committed (HF's rotation)."""


@dataclasses.dataclass(frozen=True)
class PendingSave:
    """A save that began and is not committed yet."""

    step: int
    kind: str
    path: str
    started_at: float
    """Unix time the save began (the save event's and the manifest's save time start here)."""


@dataclasses.dataclass
class InFlight:
    """An async save handed to the background writer, not yet committed or abandoned."""

    pending: PendingSave
    job: Job
    staging: Optional[Staging]
    """The host copy still being made (Trainer saves; DCP stages before it returns)."""
    blocked: float
    """Seconds the training thread spent on it so far (save call, then waits for the copy)."""


class CheckpointManager:
    def __init__(self, session: Session) -> None:
        self.session = session
        self._committed: set[int] = set()
        """Steps committed (or resumed from) in this process; identical on every rank."""
        self._pending: Optional[PendingSave] = None
        self._after_commit: Optional[Callable[[], None]] = None
        """What `save_now`'s caller runs once its save is committed (HF's rotation)."""
        self._phases = ""
        """Where `save_now`'s time went (small files, big files, fsync), for the commit's log."""
        self._stop_step: Optional[int] = None
        """The step every rank agreed to stop at for a JIT checkpoint."""
        self._last_step: Optional[int] = None
        """Training's last step: its checkpoint has kind final."""
        self._save_total_limit = session.cfg.save_total_limit
        self._best_step: Optional[int] = None
        self._announced: Optional[status.NodeStatus] = None
        self._async = False
        """Periodic saves go through `save_async` (agreed on every rank by `enable_async`)."""
        self._writer: Optional[BackgroundWriter] = None
        self._writer_control: Optional[ControlGroup] = None
        self._stager: Optional[Stager] = None
        self._inflight: Optional[InFlight] = None
        self._skipped: set[int] = set()
        self._lock = threading.Lock()
        self.blocking: list[tuple[int, float]] = []
        """(step, seconds the training thread was held) of every async save, in order."""

    # -- bookkeeping --

    def is_committed(self, step: int) -> bool:
        return step in self._committed

    def checkpoint_dir(self, step: int) -> str:
        return self.session.layout.checkpoint_dir(step)

    def retention(
        self, *, save_total_limit: Optional[int] = None, best_step: Optional[int] = None
    ) -> None:
        """What the trainer keeps, handed to this node's sidecar (node.json): it deletes the other
        nodes' parts of what HF's rotation (process 0 only) deletes here."""
        if save_total_limit is not None:
            self._save_total_limit = save_total_limit
        if best_step is not None:
            self._best_step = best_step
        with self._lock:
            self._announce()

    # -- training --

    def training_started(self) -> None:
        """Collective on first call: the control group, node.json, the SIGTERM flag."""
        session = self.session
        session.control  # noqa: B018 - collective: create the group while every rank is here
        self._announce()
        session.training_started()

    def training_ended(self) -> None:
        self.drain()
        self.session.training_ended()

    def record_output(self, output_dir: str, step: int) -> None:
        """The output_dir whose content becomes the final model after exit 0 (world rank 0)."""
        session = self.session
        if not session.run_id:
            return
        record = status.OutputRecord(session.run_id, os.path.abspath(output_dir), step, time.time())
        try:
            status.write_output(session.layout.status, record)
        except OSError as exc:  # the model is still saved; only its upload is lost
            session.log.warning("cannot record output_dir for the final model: %s", exc)

    # -- resume --

    def resume(self, *, asked: bool = False) -> Optional[int]:
        """Collective: the newest step committed on every node, or None. Directories past it are
        removed (training will write those steps again). JITCKPT_RESUME=0 gives None unless the
        script `asked` for the newest checkpoint itself."""
        session = self.session
        if not (asked or session.cfg.resume):
            return None
        step = resume.agreed_step(session)
        resume.remove_newer(session, step)
        if step is None:
            if session.topo.rank == 0:
                session.log.info(
                    "no committed checkpoint in %s: training from the start",
                    session.layout.checkpoints,
                )
            return None
        self._committed.add(step)
        if session.topo.rank == 0:
            session.log.info("resuming from %s", self.checkpoint_dir(step))
        return step

    # -- stopping --

    def stop_agreed(self) -> bool:
        """Once per optimizer step on every rank: True on all ranks at the same step once any
        rank got SIGTERM (hook/control.py)."""
        session = self.session
        return bool(session.cfg.jit and session.control.stop_requested(session.flag.is_set))

    def stop_now(self) -> bool:
        """Blocking agreement where every rank is in step anyway (after a save, an evaluation)."""
        session = self.session
        return bool(
            session.training and session.cfg.jit and session.control.any_now(session.flag.is_set)
        )

    def stop_at(self, step: int) -> None:
        """Every rank agreed to stop at `step`. When it is committed already, leave now (does not
        return); else its save is the JIT checkpoint, and `saved` leaves after committing it."""
        self._stop_step = step
        if self.session.topo.rank == 0:
            self.session.log.info("all ranks stop at step %d for a JIT checkpoint", step)
        self.drain(cancel_before=step)
        if step in self._committed:
            self.finish_jit(step, 0.0)

    def last_step(self, step: int) -> bool:
        """`step` is training's last: its save has kind final. False when it is committed."""
        if step in self._committed:
            return False
        self._last_step = step
        return True

    @property
    def stopping(self) -> bool:
        return self._stop_step is not None

    def finish_jit(self, step: int, save_seconds: float) -> NoReturn:
        """Record the JIT checkpoint of `step` and exit every rank with JITCKPT_EXIT_CODE."""
        self.drain(cancel_before=step)
        session = self.session
        if step not in self._committed:  # the same on every rank: commits are collective
            if session.topo.rank == 0:
                session.log.error(
                    "no JIT checkpoint: %s is not committed; exiting 1", checkpoint_name(step)
                )
            session.control.barrier()
            session.exit(1)
        self._record_jit(step, save_seconds)
        session.control.barrier()  # the record exists before any rank's exit is seen
        session.exit(session.cfg.exit_code)

    # -- saving --

    def begin_save(self, step: int, path: Optional[str] = None) -> Optional[PendingSave]:
        """Training thread, before the files are written; None: `step` is committed, skip it.
        Drains an async save in flight first (one save at a time)."""
        self.drain()
        if step in self._committed:
            return None
        pending = PendingSave(
            step, self._kind_of(step), path or self.checkpoint_dir(step), time.time()
        )
        session = self.session
        if session.topo.is_leader:  # the sidecar samples the volume until the commit
            start = status.SaveStart(session.run_id, step, pending.started_at)
            status.write_save_start(session.layout.status, start)
        self._pending = pending
        return pending

    def saved(self, step: int, path: Optional[str] = None) -> None:
        """Collective, after every rank wrote `step` (or skipped it as committed): commit it,
        then leave if it was the JIT save or if a SIGTERM arrived on any rank meanwhile."""
        pending, self._pending = self._pending, None
        seconds = 0.0
        inflight = self._inflight
        if step in self._skipped or (inflight is not None and inflight.pending.step == step):
            pass  # skipped, or committed by the background writer
        elif step not in self._committed:
            if pending is None or pending.step != step:  # written without begin_save
                pending = PendingSave(
                    step, self._kind_of(step), path or self.checkpoint_dir(step), time.time()
                )
            seconds = self._commit(pending)
        after_commit, self._after_commit = self._after_commit, None
        if after_commit is not None and step in self._committed:
            after_commit()
        if self._stop_step == step:
            self.finish_jit(step, seconds)
        # A SIGTERM that arrived during the save: once this step is committed (an async save
        # of it is waited for), stop right here. A step that was skipped, or whose background
        # write failed, is not a JIT checkpoint: training goes on, and the next step's
        # agreement (the flag is still set) stops there and saves that step.
        if self.stop_now():
            self.drain()
            if step in self._committed:
                self.finish_jit(step, 0.0)

    def save(self, step: int, write: Callable[[str], object], kind: Optional[str] = None) -> str:
        """Begin, `write(path)` on this thread, commit: the plain loop's save. Collective."""
        self._mark(step, kind)
        pending = self.begin_save(step)
        if pending is not None:
            write(pending.path)
        self.saved(step)
        return self.checkpoint_dir(step)

    def commit_written(self, path: str, step: int, kind: Optional[str] = None) -> None:
        """Commit what the caller wrote into `path` itself. Collective."""
        self._mark(step, kind)
        self.saved(step, path)

    def training_ending(self, step: int, save: Optional[Callable[[], object]]) -> None:
        """Training ended at `step` (collective): save it unless committed (kind jit when
        stopping, else final), and leave when a stop is agreed."""
        self.drain()
        if step not in self._committed and save is not None:
            if self._stop_step is not None:
                self._stop_step = step
            else:
                self._last_step = step
            save()
            self.saved(step)
        elif self._stop_step is not None:
            self.finish_jit(step, 0.0)
        # SIGTERM during the end of training (best-model loading, a last evaluation): the
        # final step is committed, so leave now rather than wait for the pod's SIGKILL.
        if self.stop_now():
            self.finish_jit(step, 0.0)

    # -- async saves --

    def enable_async(self, snapshot_bytes: int, unsupported: Optional[str]) -> bool:
        """Collective, once when training starts: async periodic saves on every rank or none.

        Off with JITCKPT_ASYNC_SAVE=0, when `unsupported` names why, or when the snapshot
        (`snapshot_bytes` of host memory on this rank) does not fit into what the node and the
        container's cgroup leave (one warning with the numbers)."""
        session = self.session
        if not session.cfg.async_save or self._writer_control is not None:
            return self._async
        short = None
        if unsupported is None:
            budget = memory.budget()
            if not budget.fits(snapshot_bytes):
                short = (
                    f"a snapshot needs {snapshot_bytes / 1e9:.2f} GB of host memory, more than "
                    f"{memory.HEADROOM:.0%} of the {budget.describe()}"
                )
                session.log.warning("async saves off, saving synchronously: %s", short)
        if session.control.any_now(unsupported is not None or short is not None):
            if unsupported is not None and session.topo.rank == 0:
                session.log.info("periodic saves stay synchronous: %s", unsupported)
            return False
        from jitckpt_entrypoint.hook.snapshot import Stager

        self._start_writer()
        self._stager = Stager()
        self._async = True
        if session.topo.rank == 0:
            session.log.info(
                "async periodic saves on: %.1f MB host snapshot per rank 0 save",
                snapshot_bytes / 1e6,
            )
        return True

    @property
    def async_on(self) -> bool:
        return self._async

    def should_skip(self, step: int) -> bool:
        """Collective, before a periodic save (JITCKPT_ASYNC_BUSY=skip): True on every rank
        when any rank's previous save is still being written; that step is then not saved."""
        inflight = self._inflight
        if self.session.cfg.async_busy != "skip" or not self._async:
            return False
        if self._kind_of(step) != "periodic" or step in self._committed:
            return False  # a JIT or final save is never skipped
        busy = inflight is not None and not inflight.job.done
        if not self.session.control.any_now(busy):
            return False
        self._skipped.add(step)
        if self.session.topo.rank == 0:
            self.session.log.info(
                "skipping the save of step %d: the previous save is still being written", step
            )
        return True

    def save_async(self, pending: PendingSave, parts: SaveParts) -> None:
        """Training thread, after `begin_save`: small files now, the rest in the background."""
        from jitckpt_entrypoint.hook.writer import fsync_tree, write_files

        stager = self._stager
        if stager is None:
            raise RuntimeError("save_async before enable_async")
        started = time.monotonic()
        parts.write_small(pending.path)
        host, staging = stager.plan(parts.tensors())
        staging.start()

        def write(job: Job) -> None:
            staging.run()
            job.check()
            # One thread, one file after another: training keeps the other cores.
            write_files(parts.writers(pending.path, host, 1), job, parallel=False)
            job.check()
            fsync_tree(pending.path)

        self._submit(pending, write, parts.after_commit, staging, started)

    def save_now(self, pending: PendingSave, parts: SaveParts) -> None:
        """Training thread, after `begin_save`: the same parts as `save_async`, written now
        from the live tensors (no copy): the big files side by side, one fsync pass. The JIT
        save; `saved` commits it, then runs `after_commit`."""
        from jitckpt_entrypoint.hook.writer import WRITERS, fsync_tree, write_files

        self._after_commit = parts.after_commit
        started = time.monotonic()
        parts.write_small(pending.path)
        small = time.monotonic()
        write_files(parts.writers(pending.path, parts.tensors(), WRITERS))
        big = time.monotonic()
        fsync_tree(pending.path)
        self._phases = (
            f"small files {small - started:.2f} s, big files {big - small:.2f} s,"
            f" fsync {time.monotonic() - big:.2f} s"
        )

    def _start_writer(self) -> tuple[BackgroundWriter, ControlGroup]:
        """The background writer and its own control group (collective on first call)."""
        from jitckpt_entrypoint.hook.writer import BackgroundWriter

        if self._writer is None or self._writer_control is None:
            self._writer_control = ControlGroup()  # collective: every rank creates it here
            self._writer = BackgroundWriter("jitckpt-writer")
        return self._writer, self._writer_control

    def _submit(
        self,
        pending: PendingSave,
        write: Callable[[Job], object],
        after_commit: Callable[[], None],
        staging: Optional[Staging],
        started: float,
    ) -> None:
        """Hand `pending` to the writer: `write` it, vote on the writer's group (every rank
        wrote, none cancelled), commit on that group, `after_commit`."""
        from jitckpt_entrypoint.hook.writer import CancelledError

        writer, wctl = self._start_writer()

        def run(job: Job) -> None:
            ok = False
            try:
                write(job)
                ok = True
            except CancelledError:
                pass
            except Exception as exc:  # noqa: BLE001 - reported, training goes on
                self.session.log.error(  # noqa: TRY400 - one line, no traceback
                    "async save of %s failed, not committed: %s",
                    checkpoint_name(pending.step),
                    exc,
                )
            if not all(wctl.all_gather(ok and not job.cancelled)):
                if self.session.topo.rank == 0:
                    self.session.log.warning(
                        "%s abandoned uncommitted", checkpoint_name(pending.step)
                    )
                return
            self._commit(pending, wctl, inflight)
            after_commit()

        job = writer.submit(run, checkpoint_name(pending.step))
        inflight = InFlight(pending, job, staging, time.monotonic() - started)
        self._inflight = inflight
        self._pending = None

    def save_dcp_async(self, step: int, start: Callable[[str, Any], Any]) -> str:
        """The plain loop's async periodic save (collective): `start(path, process_group)`
        begins DCP's own `async_save` (it stages to host memory and plans here, then writes on
        its thread) and returns its future; our writer waits for it, then votes and commits as
        for the Trainer's saves."""
        pending = self.begin_save(step)
        if pending is not None:
            _, wctl = self._start_writer()
            started = time.monotonic()
            future = start(pending.path, wctl.group)
            self.save_staged(pending, lambda _group: future.result(), lambda: None, started)
        self.saved(step)
        return self.checkpoint_dir(step)

    def save_staged(
        self,
        pending: PendingSave,
        write: Callable[[Any], object],
        after_commit: Callable[[], None],
        started: float,
    ) -> None:
        """Training thread, after `begin_save`, once the big state is staged in host memory
        (by DCP: the plain loop's `async_save`, the Trainer's FSDP saves): `write(group)` in
        the background, collective on the writer's own group, then the vote and the commit.
        `started`: when the training thread began the save (its blocking time counts from
        there)."""
        _, wctl = self._start_writer()
        self._submit(pending, lambda _job: write(wctl.group), after_commit, None, started)

    def before_update(self) -> None:
        """Training thread, before every optimizer step: the snapshot must be complete."""
        inflight = self._inflight
        if inflight is None or inflight.staging is None or inflight.staging.copied:
            return
        started = time.monotonic()
        inflight.staging.before_update()
        inflight.blocked += time.monotonic() - started

    def drain(self, cancel_before: Optional[int] = None) -> None:
        """Training thread, on every rank in step: wait until the async save in flight is
        committed or abandoned; one older than `cancel_before` is cancelled (abandoned)."""
        inflight = self._inflight
        if inflight is None:
            return
        if cancel_before is not None and inflight.pending.step < cancel_before:
            inflight.job.cancel()
        self.before_update()
        inflight.job.wait()
        self._inflight = None
        if inflight.job.error is not None:  # the commit or what follows it failed
            self.session.log.error(
                "async save of %s: %s",
                checkpoint_name(inflight.pending.step),
                inflight.job.error,
            )

    # -- internals --

    def _mark(self, step: int, kind: Optional[str]) -> None:
        if kind is not None and kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        if kind == "jit":
            self.stop_at(step)
        elif kind == "final":
            self.last_step(step)

    def _kind_of(self, step: int) -> str:
        if step == self._stop_step:
            return "jit"
        if step == self._last_step:
            return "final"
        return "periodic"

    def _commit(
        self,
        pending: PendingSave,
        control: Optional[ControlGroup] = None,
        inflight: Optional[InFlight] = None,
    ) -> float:
        """Collective (on `control`, the training's by default): commit `pending`; returns the
        seconds from its start to the commit. `inflight`: it was an async save."""
        session, step = self.session, pending.step
        control = control or session.control
        event = committer.commit(
            session, pending.path, step, pending.kind, pending.started_at, control=control
        )
        if inflight is not None:
            detail = f", async: training blocked {inflight.blocked:.3f} s"
        else:  # written on this thread by save_now, or by the caller
            detail, self._phases = (f": {self._phases}" if self._phases else ""), ""
        if event is not None:
            with self._lock:
                self._announce()
            session.log.info(
                "committed %s (%s, %.1f MB, %.2f s%s)",
                checkpoint_name(pending.step),
                pending.kind,
                event.bytes / 1e6,
                event.seconds,
                detail,
            )
        if inflight is not None:
            self.blocking.append((pending.step, inflight.blocked))
        self._committed.add(pending.step)
        control.barrier()  # no rank leaves before the manifests exist
        return time.time() - pending.started_at

    def _announce(self) -> None:
        """Tell this node's sidecar which node it is and what the trainer keeps (node.json)."""
        session = self.session
        if not session.topo.is_leader:
            return
        node = status.NodeStatus(
            session.run_id,
            session.topo.node,
            session.topo.nodes,
            self._save_total_limit,
            self._best_step,
        )
        if node != self._announced:
            status.write_node(session.layout.status, node)
            self._announced = node

    def _record_jit(self, step: int, save_seconds: float) -> None:
        """Tell the entrypoint (and the sidecar) that a JIT checkpoint of this run is committed."""
        session = self.session
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
        after = record.trigger_to_commit
        session.log.info(
            "JIT checkpoint %s committed%s",
            record.checkpoint,
            "" if after is None else f" {after:.2f} s after SIGTERM",
        )


_current: Optional[CheckpointManager] = None


def current() -> CheckpointManager:
    """This process's manager (one per process, like the signal disposition it owns)."""
    global _current  # noqa: PLW0603 - one lifecycle owner per process
    if _current is None:
        _current = CheckpointManager(Session.from_env(os.environ))
    return _current
