"""The one owner of a training process's checkpoint lifecycle: save, commit, JIT stop, resume.

Like torchtitan's CheckpointManager: the Trainer callback (trainer.py) and the plain-loop API
(hook/__init__.py) are thin adapters that say *when* (a step ended, a save was written,
training ended) and *how to write* (the Trainer's own `_save_checkpoint`, its files in parts,
or `dcp.save`); this object decides what happens and keeps the books (which steps are
committed, what the sidecar's retention must keep).

A save (`Save`) moves through named states, changed only under `_lock`:

    PLANNED --(async: host copy done)--> STAGED --(files written)--> WRITTEN --> COMMITTED
       \\________________________________________________________________/ \\--> ABANDONED

- PLANNED: `begin_save`, on the training thread: a step already committed is skipped (a crash
  while overwriting one would leave a manifest in front of torn files), the kind is picked, the
  sidecar is told a save started (its save-peak sampler).
- written by one of three ways, each ending in this rank's outcome (ok, cancelled, disk full,
  failed): `write_own` (the Trainer's own save or the plain loop's write, on the training
  thread: its errors are the library's own and propagate, as without jitckpt, a full disk
  named in one line first), `save_now` (the JIT save's fast path: the Trainer's files written
  here from the live tensors), `save_async` (periodic saves' fast path: the small files here,
  a host copy planned, the rest on the background writer). The fast paths catch everything
  after the Trainer's one collective (`store_flos`, which every rank passes first): never an
  exception into training.
- COMMITTED or ABANDONED: committer.commit, collective, with every rank's outcome: committed
  when every rank wrote, else the directory is removed on every node (no rotation slot, no
  resume point, no space held). A full disk is reported in one line (volume, bytes needed,
  bytes free); a fast path that failed turns the fast paths off for the rest of the run (the
  Trainer's own save from then on, one line); a JIT save that failed is written again by the
  Trainer's own save, after what can be freed (uncommitted directories) is freed.

Threads and what they own:
- the training thread: `_pending`, `_inflight`, `_stop_step`, `_last_step`, `_skipped`, the
  stager, `_fast_off`; it starts and waits for background saves (`drain`).
- the background writer (writer.py, one thread, one save at a time): the in-flight save's
  copy, files, vote and commit, on its own control group, so its collectives never interleave
  with the training thread's.
- both, under `_lock`: every `Save.state`, `_committed`, `blocking`, node.json (`_announce`).

SIGTERM inside a training process, in order:
1. `signals.SigtermFlag` records the time; nothing else happens in the handler.
2. After every optimizer step the adapter asks `stop_agreed()` (control.py), so every rank
   says yes at the same step.
3. `stop_at(step)`: an async save of an older step that is still being copied or written is
   cancelled (within one buffer: direct_write checks before every chunk) and abandoned; one that
   is written is committed; one of this very step is finished and is the JIT checkpoint. When
   the step is committed, `finish_jit` at once; else the adapter saves it (kind jit).
4. `saved(step)` commits it, then `finish_jit`: `status/jit.json`, a barrier, and
   `os._exit(JITCKPT_EXIT_CODE)` on every rank.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import threading
import time
from typing import Any, Callable, NoReturn, Optional

from jitckpt_entrypoint.hook import committer, fastpath, memory, resume
from jitckpt_entrypoint.hook.cadence import Cadence
from jitckpt_entrypoint.hook.committer import CANCELLED, DISK_FULL, FAILED, OK
from jitckpt_entrypoint.hook.control import ControlGroup
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.commit import remove_checkpoint, withdraw
from jitckpt_entrypoint.protocol.layout import checkpoint_name, checkpoint_steps, step_of
from jitckpt_entrypoint.protocol.manifest import KINDS
from jitckpt_entrypoint.protocol.validity import committed

TYPE_CHECKING = False
if TYPE_CHECKING:
    from jitckpt_entrypoint.hook.snapshot import Stager, Staging
    from jitckpt_entrypoint.hook.writer import BackgroundWriter, Job


class State(enum.Enum):
    PLANNED = "planned"
    STAGED = "staged"
    WRITTEN = "written"
    COMMITTED = "committed"
    ABANDONED = "abandoned"


@dataclasses.dataclass(frozen=True)
class SaveParts:
    """A checkpoint written in parts (the Trainer's: trainer_checkpoint.TrainerCheckpoint)."""

    write_small: Callable[[str], None]
    """Training thread: everything small, into the checkpoint's directory."""
    tensors: dict[str, Any]
    """The big state (model, optimizer) of this step, live."""
    deferrable: Callable[[], set[Any]]
    """Storage keys (snapshot.storage_key) only an optimizer step changes (parameters and
    optimizer state): an async save may copy them while the next forward runs."""
    writers: Callable[[str, dict[str, Any], int, Any], list[Callable[[], object]]]
    """The big files from `tensors` or a host copy of them, one writer each, each writing
    with up to the given number of threads and calling the given check before every chunk."""
    after_commit: Callable[[], None]
    """Once committed (HF's rotation)."""


@dataclasses.dataclass(eq=False)
class Save:
    """One save of one step, from `begin_save` to committed or abandoned."""

    step: int
    kind: str
    path: str
    started_at: float
    """Unix time the save began (the save event's and the manifest's save time start here)."""
    state: State = State.PLANNED
    outcome: str = OK
    """This rank's outcome of writing its part (set by the thread that writes)."""
    error: str = ""
    job: Optional[Job] = None
    """The background writer's job (async saves)."""
    staging: Optional[Staging] = None
    """The host copy still being made (Trainer saves; DCP stages before it returns)."""
    blocked: float = 0.0
    """Seconds the training thread spent on it (save call, then waits for the copy)."""
    measured: int = 0
    """The overhead budget's number for it (cadence.py; 0: not measured)."""
    retry: Optional[Callable[[], object]] = None
    """Saves written now by the fast path (JIT, final): the Trainer's own save, should this
    one fail."""
    vote: Optional[committer.Vote] = None
    """What the commit learned of every rank (once committed or abandoned)."""
    after_commit: Optional[Callable[[], None]] = None
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set once the training thread is done with the save (`saved`, or a drain): what runs
    after the Trainer's save call (a subclass's extra files, `on_save` callbacks) may still
    write into the directory, so an async save commits only then."""

    def failed(self, exc: BaseException) -> None:
        self.outcome = committer.outcome_of(exc, self.path)
        self.error = str(exc) or type(exc).__name__


class CheckpointManager:
    def __init__(self, session: Session) -> None:
        self.session = session
        self._lock = threading.Lock()
        self._committed: set[int] = set()
        """Steps committed (or resumed from) in this process; identical on every rank."""
        self._pending: Optional[Save] = None
        self._inflight: Optional[Save] = None
        """The async save handed to the background writer, until drained."""
        self._phases = ""
        """Where `save_now`'s time went (small files, big files), for the commit's log."""
        self._stop_step: Optional[int] = None
        """The step every rank agreed to stop at for a JIT checkpoint."""
        self._last_step: Optional[int] = None
        """Training's last step: its checkpoint has kind final."""
        self._ended = False
        """training_ending ran in this train() (once per rank: see there)."""
        self._save_total_limit = session.cfg.save_total_limit
        self._best_step: Optional[int] = None
        self._announced: Optional[status.NodeStatus] = None
        self._async = False
        """The fast paths are on (agreed on every rank by `enable_async`)."""
        self._decided = False
        """`enable_async` decided for this training (once per `train()`)."""
        self._fast_off: Optional[str] = None
        """Why the fast paths were turned off mid-run (a probe, a failed fast save)."""
        self._expected_bytes = 0
        """About what one checkpoint takes on this node's volume (for a full disk's report)."""
        self._writer: Optional[BackgroundWriter] = None
        self._writer_control: Optional[ControlGroup] = None
        self._stager: Optional[Stager] = None
        self._skipped: set[int] = set()
        self._first_step_recorded = False
        """The first optimizer step of this process is in status/first-step.json."""
        self._progress_at = -status.PROGRESS_SECONDS
        """When status/progress.json was last written (monotonic)."""
        self._resumed_step = 0
        """The step this training resumed from (0: from the start)."""
        cfg = session.cfg
        self.cadence = Cadence(cfg.save_interval, cfg.save_overhead, rank0=session.topo.rank == 0)
        """Time-based periodic saves (JITCKPT_SAVE_INTERVAL, JITCKPT_SAVE_OVERHEAD)."""
        self._save_due = False
        """The last step agreement said: save this step (a time-based periodic save)."""
        self._periodic = 0
        """Periodic saves begun in this process (the same on every rank): save requests'
        tokens."""
        self.blocking: list[tuple[int, float]] = []
        """(step, seconds the training thread was held) of every async save, in order."""

    # -- bookkeeping --

    def is_committed(self, step: int) -> bool:
        with self._lock:
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
        with self._lock:
            self._announce()
        self._ended = False
        if not session.training:
            self.cadence.started()
            if self.cadence.active and session.topo.rank == 0:
                session.log.info("time-based periodic saves: %s", self.cadence.describe())
        session.training_started()

    def step_finished(self, step: int, began_at: Optional[int] = None) -> None:
        """After every optimizer step (local rank 0 writes): the first of this process for the
        sidecar's recovery time, then progress.json at most once every PROGRESS_SECONDS for the
        work at risk. `began_at`: the step training began at (the resumed one's when None).
        Never raises into training."""
        session = self.session
        if not session.topo.is_leader or not session.run_id:
            return
        now = time.time()
        try:
            if not self._first_step_recorded:
                self._first_step_recorded = True
                start = self._resumed_step if began_at is None else began_at
                status.write_first_step(
                    session.layout.status, status.FirstStep(session.run_id, start, now)
                )
            tick = time.monotonic()  # a wall clock set back must not stop the records
            if tick - self._progress_at >= status.PROGRESS_SECONDS:
                self._progress_at = tick
                status.write_progress(
                    session.layout.status, status.Progress(session.run_id, step, now)
                )
        except Exception as exc:  # noqa: BLE001 - only metrics depend on them
            session.log.debug("status records not written for step %d: %s", step, exc)

    def training_ended(self) -> None:
        """End of one `train()`: the next one (a second Trainer, a second stage) decides its
        fast paths afresh. (Committed steps stay committed: they share checkpoints/.)"""
        self.drain()
        self.session.training_ended()
        self._skipped.clear()
        self._last_step, self._save_due = None, False
        self._async, self._decided, self._fast_off = False, False, None

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

    def refused(self, message: str) -> None:
        """Training stops before it begins (the error goes up into train()): the one line for
        the entrypoint's termination message (each node's local rank 0)."""
        session = self.session
        if not session.topo.is_leader or not session.run_id:
            return
        try:
            status.write_refusal(session.layout.status, status.Refusal(session.run_id, message))
        except OSError as exc:  # the traceback still says it
            session.log.warning("cannot record why training stopped: %s", exc)

    def resuming_from(self, path: str) -> None:
        """Collective: the script resumes from `path` itself: its saves carry on that
        checkpoint's lineage (when it is one of ours), unless that lineage has a newer save on
        any node (a rollback, or what the restore saw in S3: a new lineage)."""
        session = self.session
        lineage = resume.lineage_of(path)
        step = step_of(os.path.basename(os.path.normpath(path)))
        tips = session.control.all_gather(
            None if lineage is None or step is None else resume.tip(session, step, lineage)
        )
        tip = max((t for t in tips if t is not None), default=None)
        session.lineage = lineage if tip is None else None
        if tip is not None and step is not None:
            self._say_branch(step, tip)

    def resume(self, *, asked: bool = False) -> Optional[int]:
        """Collective: the newest step committed on every node, or None. Directories past it,
        and uncommitted ones, are removed (training writes those steps again; a partial one
        would hold a rotation slot). JITCKPT_RESUME=0 gives None unless the script `asked` for
        the newest checkpoint itself, and clears the earlier run's checkpoints out of the way
        (resume.start_over)."""
        session = self.session
        if not (asked or session.cfg.resume):
            removed = resume.start_over(session)
            with self._lock:
                self._committed.difference_update(step_of(n) for n in removed)
            return None
        resume.fetch_missing(session)
        step = resume.agreed_step(session)
        lineage = None if step is None else resume.lineage_of(self.checkpoint_dir(step))
        # Before remove_stale: the directories past the resume point are what tells.
        tips = session.control.all_gather(
            None if step is None or lineage is None else resume.tip(session, step, lineage)
        )
        resume.remove_stale(session, step)
        tip = max((t for t in tips if t is not None), default=None)
        session.lineage = lineage if tip is None else None
        if tip is not None and step is not None:
            self._say_branch(step, tip)
        if step is None:
            if session.topo.rank == 0:
                session.log.info(
                    "no committed checkpoint in %s: training from the start",
                    session.layout.checkpoints,
                )
            return None
        with self._lock:
            self._committed.add(step)
        self._resumed_step = step
        if session.topo.rank == 0:
            session.log.info("resuming from %s", self.checkpoint_dir(step))
        return step

    def _say_branch(self, step: int, tip: int) -> None:
        if self.session.topo.rank == 0:
            self.session.log.info(
                "resuming from %s, below %s of the same lineage (an attempt that could not be "
                "resumed from, or a rollback): this run's saves begin a new lineage, which "
                "restores prefer to that branch whatever their steps",
                checkpoint_name(step),
                checkpoint_name(tip),
            )

    # -- stopping --

    def stop_agreed(self) -> bool:
        """Once per optimizer step on every rank: True on all ranks at the same step once any
        rank got SIGTERM (hook/control.py). The same round says whether a time-based save is
        due at this step (`save_due`)."""
        session, cadence = self.session, self.cadence
        now = time.monotonic()
        cadence.step_ended(now)
        # A request is a token: one more than the periodic saves so far. A save that began
        # since (save_steps' own, in the rounds a request travels) answered it already: every
        # rank has the same count, so every rank drops it alike (no back-to-back saves).
        token = self._periodic + 1 if session.topo.rank == 0 and cadence.due(now) else 0
        jit = session.cfg.jit
        if not (jit or cadence.active):
            return False
        stop, save = session.control.agree(jit and session.flag.is_set, token)
        if save:
            cadence.agreed(now)
        self._save_due = save > self._periodic and not stop
        return stop and jit

    def save_due(self) -> bool:
        """After `stop_agreed`, on every rank: the same answer, whether this step is saved
        because JITCKPT_SAVE_INTERVAL (or the overhead budget's interval) has passed."""
        due, self._save_due = self._save_due, False
        return due

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
        if self.is_committed(step):
            self.finish_jit(step, 0.0)
        self._make_room(step)

    def last_step(self, step: int) -> bool:
        """`step` is training's last: its save has kind final. False when it is committed."""
        if self.is_committed(step):
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
        if not self.is_committed(step):  # the same on every rank: commits are collective
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

    def begin_save(self, step: int, path: Optional[str] = None) -> Optional[Save]:
        """Training thread, before the files are written; None: `step` is committed, skip it.
        Drains an async save in flight first (one save at a time)."""
        self.drain()
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
        if session.topo.is_leader:  # the sidecar samples the volume until the commit
            start = status.SaveStart(session.run_id, step, save.started_at)
            self._advisory(status.write_save_start, session.layout.status, start)
        if save.kind == "periodic":
            self._periodic += 1
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
            if committer.outcome_of(exc, save.path) == DISK_FULL:
                root = self.session.layout.checkpoints
                name = checkpoint_name(save.step)
                needed = self._expected_bytes
                self.session.log.error(memory.no_space(name, root, needed, False))  # noqa: TRY400
            raise
        self._advance(save, State.WRITTEN)

    def saved(self, step: int, path: Optional[str] = None) -> None:
        """Collective, after every rank wrote `step` (or skipped it as committed): commit it,
        then leave if it was the JIT save or if a SIGTERM arrived on any rank meanwhile."""
        save, self._pending = self._pending, None
        seconds = 0.0
        inflight = self._inflight
        if inflight is not None and inflight.step == step:
            inflight.ready.set()  # the background writer commits it now
        elif step in self._skipped:
            self._remove_skipped(step)
        elif not self.is_committed(step):
            if save is None or save.step != step:  # written without begin_save
                where = path or self.checkpoint_dir(step)
                save = Save(step, self._kind_of(step), where, time.time())
            seconds = self._commit(save)
            if self._retries(save):
                seconds = self._retry_own(save)
        if self._stop_step == step:
            self.finish_jit(step, seconds)
        # A SIGTERM that arrived during the save: once this step is committed (an async save
        # of it is waited for), stop right here. A step that was skipped, or whose background
        # write failed, is not a JIT checkpoint: training goes on, and the next step's
        # agreement (the flag is still set) stops there and saves that step.
        if self.stop_now():
            self.drain()
            if self.is_committed(step):
                self.finish_jit(step, 0.0)

    def save(self, step: int, write: Callable[[str], object], kind: Optional[str] = None) -> str:
        """Begin, `write(path)` on this thread, commit: the plain loop's save. Collective."""
        self._mark(step, kind)
        save = self.begin_save(step)
        if save is not None:
            self.write_own(save, lambda: write(save.path))
        self.saved(step)
        return self.checkpoint_dir(step)

    def commit_written(self, path: str, step: int, kind: Optional[str] = None) -> None:
        """Commit what the caller wrote into `path` itself. Collective."""
        self._mark(step, kind)
        self.saved(step, path)

    def training_ending(self, step: int, save: Optional[Callable[[], object]]) -> None:
        """Training ended at `step` (collective): save it unless committed (kind jit when
        stopping, else final), and leave when a stop is agreed. Once per train() on each rank:
        HF calls `_load_best_model` (which calls this first) only on the ranks that hold the
        best checkpoint, the rest come here from on_train_end; and a final save that failed
        is not tried again after the best model's weights replaced the step's own."""
        if self._ended:
            return
        self._ended = True
        self.drain()
        if not self.is_committed(step) and save is not None:
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

    # -- the fast paths: async periodic saves, JIT saves from live tensors --

    def enable_async(
        self, snapshot_bytes: int, unsupported: Optional[str], growth: int = 0
    ) -> bool:
        """Collective, once when training starts: the fast paths on every rank or none.

        Off with JITCKPT_ASYNC_SAVE=0; when `unsupported` names why (the Trainer's set-up) or
        a library's version is outside the tested range (fastpath.py); or when the snapshots
        of this node's local ranks (`snapshot_bytes` of host memory each), plus what training
        has yet to allocate on each (`growth`: gradients and optimizer state not created yet,
        when they live in host memory), do not fit into what the node and the container's
        cgroup leave (one warning with the numbers)."""
        session = self.session
        if not self._expected_bytes:  # about what a checkpoint of this node takes
            self._expected_bytes = snapshot_bytes * session.topo.local_world_size
        if not session.cfg.async_save or self._decided:
            return self._async
        self._decided = True
        reason = unsupported or fastpath.version_problem()
        budget = memory.budget()
        gathered = session.control.all_gather(
            (session.topo.node, reason, snapshot_bytes + growth, budget.available, budget.limit)
        )
        reason = next((r for _, r, _, _, _ in gathered if r), None)
        node_bytes = sum(b for n, _, b, _, _ in gathered if n == session.topo.node)
        short = memory.short_node([(n, b, memory.Budget(a, lim)) for n, _, b, a, lim in gathered])
        self._expected_bytes = snapshot_bytes * session.topo.local_world_size
        if reason is not None or short is not None:
            if session.topo.rank == 0:
                log = session.log.info if reason else session.log.warning
                log("checkpoints are the Trainer's own save: %s", reason or short)
            return False
        from jitckpt_entrypoint.hook.snapshot import Stager

        self._start_writer()
        self._stager = self._stager or Stager()
        self._async = True
        if session.topo.rank == 0:
            session.log.info(
                "async periodic saves on (%s): %.1f MB host snapshot per save on this node",
                fastpath.versions_line(),
                (node_bytes - growth * session.topo.local_world_size) / 1e6,
            )
        return True

    @property
    def async_on(self) -> bool:
        return self._async and self._fast_off is None

    def use_fast(self, problem: Optional[str]) -> bool:
        """Collective, before a Trainer save the fast paths may write: whether they write this
        one, on every rank. `problem`: why this rank's state is not theirs (fastpath.py's probe
        of it), or None; a state any rank's probe refuses turns them off for the rest of the
        run, with one line."""
        if not self.async_on:
            self._stager = None  # its host buffers are not needed any more
            return False
        problems = self.session.control.all_gather(problem)
        found = next((p for p in problems if p), None)
        if found is not None:
            self._turn_off(f"{found} (rank {problems.index(found)})")
        return self.async_on

    def should_skip(self, step: int) -> bool:
        """Collective, before a periodic save (JITCKPT_ASYNC_BUSY=skip): True on every rank
        when any rank's previous save is still being written; that step is then not saved."""
        inflight = self._inflight
        if self.session.cfg.async_busy != "skip" or not self._async:
            return False
        if self._kind_of(step) != "periodic" or self.is_committed(step):
            return False  # a JIT or final save is never skipped
        busy = inflight is not None and inflight.job is not None and not inflight.job.done
        if not self.session.control.any_now(busy):
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
        forward changes now, the rest in the background."""
        from jitckpt_entrypoint.hook.writer import CancelledError, write_files

        stager = self._stager
        if stager is None:
            raise RuntimeError("save_async before enable_async")
        started = time.monotonic()
        host: dict[str, Any] = {}
        staging = None
        try:
            parts.write_small(save.path)
            host, staging = stager.plan(parts.tensors, parts.deferrable())
            staging.start()
        except Exception as exc:  # noqa: BLE001 - never into training: this save is abandoned
            save.failed(exc)
            staging = None  # nothing for the next optimizer step to wait for

        def write(job: Job) -> None:
            if save.outcome != OK or staging is None:
                return
            try:
                staging.run(job.check)
                self._advance(save, State.STAGED)
                # One thread, one file after another: training keeps the other cores.
                write_files(parts.writers(save.path, host, 1, job.check), job, parallel=False)
            except CancelledError:
                save.outcome = CANCELLED
            except Exception as exc:  # noqa: BLE001 - reported at the commit
                save.failed(exc)

        save.staging = staging
        self._submit(save, write, parts.after_commit, started)

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
        if save.outcome == OK:
            self._advance(save, State.WRITTEN)
        self._phases = (
            f"small files {small - started:.2f} s, big files {time.monotonic() - small:.2f} s"
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
        save: Save,
        write: Callable[[Job], object],
        after_commit: Callable[[], None],
        started: float,
    ) -> None:
        """Hand `save` to the writer: `write` it (setting its outcome), then the commit with
        every rank's outcome on the writer's own group, then `after_commit`."""
        writer, wctl = self._start_writer()

        def run(job: Job) -> None:
            write(job)
            if save.outcome == OK:
                self._advance(save, State.WRITTEN)
            save.ready.wait()  # the training thread is done with the directory
            self._commit(save, wctl)

        save.after_commit = after_commit
        save.blocked = time.monotonic() - started
        self._inflight = save
        self._pending = None
        save.job = writer.submit(run, checkpoint_name(save.step))

    def save_dcp_async(self, step: int, start: Callable[[str, Any], Any]) -> str:
        """The plain loop's async periodic save (collective): `start(path, process_group)`
        begins DCP's own `async_save` (it stages to host memory and plans here, then writes on
        its thread) and returns its future; our writer waits for it, then votes and commits as
        for the Trainer's saves."""
        save = self.begin_save(step)
        if save is not None:
            _, wctl = self._start_writer()
            started = time.monotonic()
            future = start(save.path, wctl.group)  # DCP's own: its errors are its own
            self.save_staged(save, lambda _group, _check: future.result(), lambda: None, started)
        self.saved(step)
        return self.checkpoint_dir(step)

    def save_staged(
        self,
        save: Save,
        write: Callable[[Any, Callable[[], None]], object],
        after_commit: Callable[[], None],
        started: float,
    ) -> None:
        """Training thread, after `begin_save`, once the big state is staged in host memory
        (by DCP: the plain loop's `async_save`, the Trainer's FSDP saves): `write(group, check)`
        in the background, collective on the writer's own group (`check` between its parts
        stops a cancelled save, on every rank at once), then the vote and the commit.
        `started`: when the training thread began the save (its blocking time counts from
        there)."""
        from jitckpt_entrypoint.hook.writer import CancelledError

        _, wctl = self._start_writer()

        def run(job: Job) -> None:
            def check() -> None:
                # Collective: DCP's saves are collectives, so every rank stops at the same one.
                if wctl.any_now(job.cancelled):
                    raise CancelledError(job.label)

            if save.outcome != OK:
                return
            try:
                write(wctl.group, check)
            except CancelledError:
                save.outcome = CANCELLED
            except Exception as exc:  # noqa: BLE001 - reported at the commit
                save.failed(exc)

        self._submit(save, run, after_commit, started)

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
        committed or abandoned. One of a step older than `cancel_before` that is still being
        copied or written is cancelled (it stops within one buffer and is abandoned); one
        already written is committed (a commit takes milliseconds)."""
        inflight = self._inflight
        if inflight is None or inflight.job is None:
            return
        inflight.ready.set()  # the training thread is past the save call
        if cancel_before is not None and inflight.step < cancel_before:
            with self._lock:
                if inflight.state in (State.PLANNED, State.STAGED):
                    inflight.job.cancel()
        self.before_update()
        inflight.job.wait()
        self._inflight = None
        if inflight.job.error is not None:  # the commit or what follows it failed
            self.session.log.error(
                "async save of %s: %s", checkpoint_name(inflight.step), inflight.job.error
            )

    # -- internals --

    def _advisory(self, write: Callable[..., object], *args: Any) -> None:
        """Write a status file for the sidecar and the entrypoint: a failure (a full disk) is
        one warning, never an error in training (the checkpoint itself is what counts)."""
        try:
            write(*args)
        except OSError as exc:
            self.session.log.warning("cannot write a status file: %s", exc)

    def _remove_skipped(self, step: int) -> None:
        """Collective: a skipped save's directory (created for whatever writes into it after
        the Trainer's save call) is removed, holding no rotation slot."""
        self.session.control.barrier()
        if self.session.topo.is_leader:
            remove_checkpoint(self.checkpoint_dir(step))

    def _advance(self, save: Save, state: State) -> None:
        with self._lock:
            save.state = state

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
        )
        save.vote = vote
        if vote.committed:
            with self._lock:
                save.state = State.COMMITTED
                self._committed.add(step)
                self._advisory(self._announce)
            self._log_committed(save, vote, time.monotonic() - started)
            if save.after_commit is not None:
                save.after_commit()
        else:
            self._advance(save, State.ABANDONED)
            self._report_abandoned(save, vote)
        if save.job is not None:
            with self._lock:
                self.blocking.append((step, save.blocked))

    def _log_committed(self, save: Save, vote: committer.Vote, commit_seconds: float) -> None:
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

    def _report_abandoned(self, save: Save, vote: committer.Vote) -> None:
        """One line per cause: a full disk (each node's local rank 0, for its volume), a
        failure (the rank it happened on), a cancel (rank 0). A fast path that failed is off
        from now on (decided from the vote: the same on every rank)."""
        session, name = self.session, checkpoint_name(save.step)
        topo = session.topo
        if save.outcome == FAILED:
            session.log.error("%s not saved: %s", name, save.error)
        if topo.is_leader and vote.any(DISK_FULL, topo.node):
            needed = self._expected_bytes
            session.log.error(memory.no_space(name, session.layout.checkpoints, needed, True))
        if topo.rank == 0 and vote.any(CANCELLED) and not vote.any(FAILED):
            session.log.info("%s abandoned uncommitted", name)
        elif topo.rank == 0:
            session.log.warning("%s abandoned uncommitted; its directory is removed", name)
        fast = save.job is not None or save.retry is not None
        if fast and vote.any(FAILED):
            self._turn_off(f"a fast save of {name} failed")

    def _turn_off(self, reason: str) -> None:
        if self._fast_off is None:
            self._fast_off = reason
            if self.session.topo.rank == 0:
                self.session.log.info(
                    "checkpoints are the Trainer's own save from now on: %s", reason
                )

    @staticmethod
    def _retries(save: Save) -> bool:
        """Whether an abandoned save written now by the fast path is written again (the same on
        every rank: decided from the vote)."""
        if save.state is not State.ABANDONED or save.retry is None or save.vote is None:
            return False
        return save.kind == "jit" or save.vote.any(FAILED)

    def _retry_own(self, failed: Save) -> float:
        """Collective: a save written now by the fast path failed somewhere; the Trainer's own
        save writes it again, after uncommitted directories are freed."""
        retry, failed.retry = failed.retry, None
        self._make_room(failed.step, force=True)
        save = Save(failed.step, failed.kind, failed.path, time.time())
        save.after_commit = failed.after_commit
        if self.session.topo.rank == 0:
            self.session.log.info("writing %s with the Trainer's own save", failed.path)
        if retry is not None:
            self.write_own(save, retry)
        return self._commit(save)

    def _make_room(self, step: int, force: bool = False) -> None:
        """Before a JIT save: when the volume has less free space than a checkpoint takes,
        remove the uncommitted checkpoint directories (this node's local rank 0)."""
        session = self.session
        if not session.topo.is_leader:
            return
        root = session.layout.checkpoints
        if not force and memory.free_bytes(root) >= self._expected_bytes:
            return
        freed = []
        for other in checkpoint_steps(root):
            path = self.checkpoint_dir(other)
            if other != step and committed(path, session.topo.node) is None:
                remove_checkpoint(path)
                freed.append(checkpoint_name(other))
        if freed:
            session.log.info(
                "removed uncommitted %s to make room for the JIT save (%s free)",
                ", ".join(freed),
                memory.gb(memory.free_bytes(root)),
            )

    def _announce(self) -> None:
        """Tell this node's sidecar which node it is and what the trainer keeps (node.json).
        Under `_lock`."""
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
        self._advisory(status.write_jit, session.layout.status, record)
        after = record.trigger_to_commit
        session.log.info(
            "JIT checkpoint %s committed%s",
            record.checkpoint,
            "" if after is None else f" {after:.2f} s after SIGTERM",
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


_current: Optional[CheckpointManager] = None


def current() -> CheckpointManager:
    """This process's manager (one per process, like the signal disposition it owns)."""
    global _current  # noqa: PLW0603 - one lifecycle owner per process
    if _current is None:
        _current = CheckpointManager(Session.from_env(os.environ))
    return _current
