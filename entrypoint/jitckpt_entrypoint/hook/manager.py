"""The one owner of a training process's checkpoint lifecycle: save, commit, JIT stop, resume.

Like torchtitan's CheckpointManager: the Trainer callback (trainer.py) and the plain-loop API
(hook/__init__.py) are thin adapters that say *when* (a step ended, a save was written,
training ended) and *how to write* (the Trainer's own `_save_checkpoint`, its files in parts,
or `dcp.save`); this object decides what happens and keeps the books (which steps are
committed, what the sidecar's retention must keep).

Every save goes to the save pipeline (saver.py) through one call: `save_step` (the
Trainer's: a `SaveRequest`), `save` and `save_dcp_async` (the plain loop's); the manager commits
it at `saved` and leaves when it was the JIT checkpoint.

Threads and what they own:
- the training thread: `_stop_step`, `_last_step`, the saver's pending save and gates; it
  starts and waits for background saves (inflight.py: `drain`).
- the background writer (writer.py, one thread, one save at a time): the in-flight save's
  copy, files, vote and commit, on its own control group, so its collectives never interleave
  with the training thread's.
- both, under the saver's lock: every `Save.state`, the committed steps, `blocking`; the
  status records (records.py) under their own.

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

import os
import time
from typing import Any, Callable, NoReturn, Optional

from jitckpt_entrypoint.hook import resume
from jitckpt_entrypoint.hook.cadence import Cadence
from jitckpt_entrypoint.hook.records import Records
from jitckpt_entrypoint.hook.save_asks import SaveAsks
from jitckpt_entrypoint.hook.saver import Saver
from jitckpt_entrypoint.hook.saves import SaveParts, SaveRequest, Staged
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.hook.survivors import Survivors
from jitckpt_entrypoint.protocol.layout import checkpoint_name, step_of
from jitckpt_entrypoint.protocol.manifest import KINDS


class CheckpointManager:
    def __init__(self, session: Session) -> None:
        self.session = session
        self._stop_step: Optional[int] = None
        """The step every rank agreed to stop at for a JIT checkpoint."""
        self._last_step: Optional[int] = None
        """Training's last step: its checkpoint has kind final."""
        self._ended = False
        """training_ending ran in this train() (once per rank: see there)."""
        self._resumed_step = 0
        """The step this training resumed from (0: from the start)."""
        cfg = session.cfg
        self.cadence = Cadence(cfg.save_interval, cfg.save_overhead, rank0=session.topo.rank == 0)
        """Time-based periodic saves (JITCKPT_SAVE_INTERVAL, JITCKPT_SAVE_OVERHEAD)."""
        self._save_due = False
        """The last step agreement said: save this step (a time-based periodic save)."""
        self.records = Records(session)
        self.saver = Saver(session, self.cadence, self.records, self._kind_of)
        """One save from its request to committed or abandoned (saver.py)."""
        self.tier = self.saver.tier
        """Snapshots in RAM (memory_tier.py)."""
        self.asks = SaveAsks(session)
        """Saves asked for from outside training (save_asks.py: the sidecar's early notice)."""
        self._finished: Optional[int] = None
        """The last step `step_finished` was told of."""
        self.survivors = Survivors(session)
        """The last completed step, saved by the ranks left when peers are lost (survivors.py)."""
        self.resumed_dir: Optional[str] = None
        """The directory the last `resume` chose (a snapshot's in RAM, or the volume's)."""
        self._in_ram = False
        """`resumed_dir` is a snapshot in RAM (the sidecar's recovery label)."""
        self._before_loop: set[int] = set()
        """Steps committed before the Trainer's first training loop in this train() began."""

    # -- bookkeeping --

    def is_committed(self, step: int) -> bool:
        return self.saver.is_committed(step)

    def checkpoint_dir(self, step: int) -> str:
        return self.session.layout.checkpoint_dir(step)

    def retention(
        self, *, save_total_limit: Optional[int] = None, best_step: Optional[int] = None
    ) -> None:
        """What the trainer keeps, handed to this node's sidecar (records.py: node.json)."""
        self.records.retention(save_total_limit=save_total_limit, best_step=best_step)
        self.records.advisory(self.records.announce)

    # -- training --

    def training_started(self) -> None:
        """Collective on first call: the control group, node.json, the SIGTERM flag."""
        session = self.session
        session.control  # noqa: B018 - collective: create the group while every rank is here
        self.records.advisory(self.records.announce)
        self._ended = False
        if not session.training:
            self.cadence.started()
            self.tier.started()
            if self.cadence.active and session.topo.rank == 0:
                session.log.info("time-based periodic saves: %s", self.cadence.describe())
        session.training_started()

    def loop_began(self) -> None:
        """The Trainer's first training loop in this train() begins: the steps committed
        before it (resumed from, an earlier run's) are never a retry's to leave behind."""
        self._before_loop = self.saver.committed_steps()

    def retried(self, step: int, batch_size: object) -> None:
        """Collective: the Trainer runs its training loop again within one train(), from `step`
        (the checkpoint it resumed from, or 0): accelerate's find_executable_batch_size retries
        with a smaller batch after an out-of-memory error (auto_find_batch_size). The failed
        attempt's saves past `step` are a branch left behind: a save of the same step now would
        be skipped as committed (a JIT checkpoint would name the old attempt's state), and a
        restore would prefer the old attempt's higher steps. They are drained, removed from
        this node's volume and RAM (S3 keeps what was uploaded), and the next commit begins a
        new lineage, which restores prefer whatever the steps. After SIGTERM (a JIT save that
        ran out of memory, a signal meanwhile) nothing is left behind: the newest committed
        checkpoint, the failed attempt's, is the JIT one, and the process exits (finish_jit)."""
        session = self.session
        self.drain()  # the save in flight commits (no rotation: trainer.py's RETRYING)
        self.saver.settle()  # a save handed to the RAM writer: answered
        if self.stop_now() or self.stopping:  # collective first: every rank takes part
            newest = max(self.saver.committed_steps(), default=None)
            if newest is not None:
                self.finish_jit(newest, 0.0)
            # else nothing to stand for it: the retry goes on, its first step is the JIT one
        if session.topo.rank == 0:
            session.log.info(
                "the Trainer trains again from step %d (a retry within train(): "
                "auto_find_batch_size after an out-of-memory error, batch size now %s): the "
                "failed attempt's checkpoints past it are left behind; the next save begins a "
                "new lineage, which restores prefer",
                step,
                batch_size,
            )
        made = {s for s in self.saver.committed_steps() - self._before_loop if s > step}
        try:
            resume.leave_behind(session, made)  # each node's leader
        except OSError as exc:  # a save of a step left here has its manifests withdrawn first
            session.log.warning("cannot remove the failed attempt's checkpoints: %s", exc)
        self.tier.remove_stale(self.resumed_dir if step > 0 else None)
        self.saver.left_behind(made)
        self.cadence.started()  # a time-based save cut short by the error left its window open
        self.tier.started()
        self._stop_step, self._last_step, self._save_due = None, None, False
        session.lineage = None

    def step_finished(self, step: int, began_at: Optional[int] = None) -> None:
        """After every optimizer step: the status records of progress (records.py).
        `began_at`: the step training began at (the resumed one's when None). Never raises
        into training."""
        start = self._resumed_step if began_at is None else began_at
        self._finished = step
        self.records.step_finished(step, start, self._in_ram and start == self._resumed_step)
        self.saver.poll_write_out()

    def training_ended(self) -> None:
        """Collective, at the end of jitckpt's `train()`: every save drained, the control
        groups closed (their gloo threads are not left to the interpreter's teardown)."""
        if self.session.control_lost:  # a plain loop's done() after destroy_process_group()
            self.session.log.warning(
                "training ended after torch.distributed.destroy_process_group(): jitckpt's "
                "last collectives are skipped (call jitckpt.done() before it)"
            )
            self.training_failed(None)
            return
        try:
            self.drain()
            self.saver.training_ended()  # a write-out it collects agrees on the control group
        finally:
            self._last_step, self._save_due = None, False
            try:
                self.session.close_control()
            finally:
                self.session.training_ended()  # last: a SIGTERM that came meanwhile ends us

    def training_failed(self, error: Optional[BaseException]) -> None:
        """`train()` ended without `training_ended` (it raised `error`, on this rank at least):
        not collective, the other ranks may be anywhere. SIGTERM ends the process again (a
        later stage's training, a script that carries on, must not swallow it), and the groups
        go unless a collective is still in flight on them."""
        session = self.session
        if not session.training:
            return
        try:
            self.saver.inflight.close(wait=False)
            session.close_control(wait=False)
        except Exception as exc:  # noqa: BLE001 - the training's error is the one to report
            session.log.warning("cannot close jitckpt's process groups: %r", exc)
        finally:
            session.training_ended(error)

    def record_output(self, output_dir: str, step: int) -> None:
        """The output_dir whose content becomes the final model after exit 0 (world rank 0)."""
        self.records.output(output_dir, step)

    # -- resume --

    def refused(self, message: str) -> None:
        """Training stops before it begins (the error goes up into train()): the one line for
        the entrypoint's termination message (each node's local rank 0)."""
        self.records.refusal(message)

    def resuming_from(self, path: str) -> None:
        """Collective: the script resumes from `path` itself (resume.resuming_from)."""
        resume.resuming_from(self.session, path)

    def resume(self, *, asked: bool = False) -> Optional[int]:
        """Collective: the newest step committed on every node, or None (resume.resume: what
        it removes, when it starts over); its directory is `resumed_dir`. A snapshot in RAM
        resumed from is not committed on the volume: a save of its step is still made."""
        step, path, removed = resume.resume(self.session, self.tier, asked=asked)
        on_volume = path is None or path == self.checkpoint_dir(step or 0)
        gone = [s for s in map(step_of, removed) if s is not None]
        self.saver.resumed(step if on_volume else None, gone)
        self.resumed_dir = path
        self._in_ram = path is not None and not on_volume
        if step is not None:
            self._resumed_step = step
        return step

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
        # A save asked for from outside (save_asks.py: any node's) rides the same token.
        rank0 = session.topo.rank == 0
        jit = session.cfg.jit
        if not (jit or cadence.active or self.tier.timed):
            return False
        asked = self.asks.asked(now)
        token = self.saver.periodic + 1 if (rank0 and cadence.due(now)) or asked else 0
        snap = self.tier.token(now) if rank0 else 0
        stop, save, snapshot = session.control.agree(jit and session.flag.is_set, token, snap)
        if save:
            cadence.agreed(now)
        self._save_due = save > self.saver.periodic and not stop
        if asked and (self._save_due or (stop and jit)):
            self.asks.agreed(self._finished)
        elif asked and save:  # a save began since the ask was sent (save_steps'): it answers
            self.asks.agreed(self.saver.periodic_step)
        self.tier.agreed(snapshot)
        session.stop_read = session.stop_read or (stop and jit)
        return stop and jit

    def save_due(self) -> bool:
        """After `stop_agreed`, on every rank: the same answer, whether this step is saved
        because JITCKPT_SAVE_INTERVAL (or the overhead budget's interval) has passed."""
        due, self._save_due = self._save_due, False
        return due

    def snapshot(
        self,
        step: int,
        make: Callable[[], tuple[Optional[SaveParts], Optional[str]]],
        *,
        saved: bool,
        later: bool,
        staged: Optional[
            tuple[Callable[[Callable[[], object]], Staged], Callable[[], object]]
        ] = None,
    ) -> None:
        """After `stop_agreed` and `save_due`, on every rank alike: snapshot `step` to RAM when
        one is wanted (memory_tier.py), unless it is `saved` to the volume (no snapshot needed)
        or must wait for what `later` comes in this step (an evaluation). `make` gives the
        fast path's parts; `staged` (FSDP), the library's own save with its big writes staged
        instead (saver.save_snapshot_staged)."""
        tier = self.tier
        if not tier.wanted(step):
            return
        if saved:
            tier.covered()
        elif later:
            return
        elif staged is not None:
            self.saver.save_snapshot_staged(step, *staged)
        else:
            self.saver.save_snapshot(step, make)

    def snapshot_wanted(self, step: int) -> bool:
        """The plain loop, after `stop_agreed`, on every rank alike: whether to snapshot `step`
        (collective on the first call: snapshots are decided then)."""
        tier = self.tier
        if not tier.decided:  # on every rank: a node without JITCKPT_MEMORY_DIR takes part
            tier.decide(0, True)  # the state's size is not known here: a full tmpfs says so
        return tier.wanted(step)

    def enable_snapshots(
        self,
        snapshot_bytes: int,
        fast: bool,
        not_whole: Optional[str],
        *,
        staged: bool = False,
        lacking: Optional[str] = None,
    ) -> bool:
        """Collective, when training starts (after `enable_async`): snapshots to RAM on every
        rank or none (memory_tier.py, one line why not). `fast`: this Trainer's periodic saves
        take a fast path; `not_whole`: why, with several nodes, a node's snapshot cannot hold
        every file its ranks load (None: it does); `staged`: its saves are the library's own
        with DCP's staging (FSDP: two host copies while staging; not the RAM writer's);
        `lacking`: why a snapshot would lack what this rank's checkpoints hold."""
        return self.tier.decide(
            snapshot_bytes,
            fast and self.saver.async_on,
            not_whole,
            written_out=not staged,
            host_copies=2 if staged else 1,
            lacking=lacking,
        )

    def stop_now(self) -> bool:
        """Blocking agreement where every rank is in step anyway (after a save, an evaluation)."""
        session = self.session
        stop = session.training and session.cfg.jit and session.control.any_now(session.flag.is_set)
        session.stop_read = session.stop_read or stop
        return stop

    def stop_at(self, step: int) -> None:
        """Every rank agreed to stop at `step`. When it is committed already, leave now (does not
        return); else its save is the JIT checkpoint, and `saved` leaves after committing it."""
        self._stop_step = step
        if self.session.topo.rank == 0:
            self.session.log.info("all ranks stop at step %d for a JIT checkpoint", step)
        self.drain(cancel_before=step)
        if self.is_committed(step):
            self.finish_jit(step, 0.0)
        self.saver.make_room(step)

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
        self.records.jit(step, save_seconds)
        self.asks.agreed(step)  # an ask still waiting: this save answers it
        session.control.barrier()  # the record exists before any rank's exit is seen
        session.exit(session.cfg.exit_code)

    # -- saving --

    def save_step(self, request: SaveRequest) -> None:
        """Training thread: the one call an adapter makes to save a step (saver.py); `saved`
        commits it."""
        self.saver.save_step(request)

    def saved(self, step: int, path: Optional[str] = None) -> None:
        """Collective, after every rank wrote `step` (or skipped it as committed): commit it,
        then leave if it was the JIT save or if a SIGTERM arrived on any rank meanwhile."""
        seconds = self.saver.saved(step, path)
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

    def save(
        self,
        step: int,
        write: Callable[[str], object],
        kind: Optional[str] = None,
        errors: tuple[type[BaseException], ...] = (OSError,),
    ) -> str:
        """Begin, `write(path)` on this thread, commit: the plain loop's save. Collective. A
        periodic save goes to RAM first while the entrypoint's RAM writer runs, and the writer
        writes it to the volume and commits it there after this returns; the next save and
        `training_ended` wait for that (saver.write_out_own; `errors` of the write into RAM
        fall back to the volume). A final save ends training (`_saved_final`)."""
        self._mark(step, kind)
        tier = self.tier
        if not tier.decided and self._kind_of(step) == "periodic":
            tier.decide(0, True)  # as `snapshot_wanted`: a full tmpfs says so when written
        save = self.saver.begin_save(step)
        if save is not None and not self.saver.write_out_own(save, write, errors):
            self.saver.write_own(save, lambda: write(save.path))
        self.saved(step)
        self._saved_final(step, kind)
        return self.checkpoint_dir(step)

    def commit_written(self, path: str, step: int, kind: Optional[str] = None) -> None:
        """Commit what the caller wrote into `path` itself. Collective."""
        self._mark(step, kind)
        self.saved(step, path)
        self._saved_final(step, kind)

    def _saved_final(self, step: int, kind: Optional[str]) -> None:
        """After the plain loop's final save (committed, or abandoned in one line): training
        is over, as at `done()` (which then has nothing left to do). A loop that never calls
        `done()` (it ends, the script works on) gets SIGTERM back as it was before training:
        jitckpt's flag alone would swallow it, and the entrypoint would say a JIT save follows.
        A SIGTERM whose stop agreement found nothing committed to stand for it is sent again.
        What the end raises (a peer lost after the commit) is one line: the save is done."""
        session = self.session
        if kind != "final" or not session.training:
            return
        if not self.is_committed(step):
            session.stop_read = False  # no JIT checkpoint handled that SIGTERM
        try:
            self.training_ended()
        except Exception as exc:  # noqa: BLE001 - never into training after its last save
            session.log.warning("the end of training after the final save failed: %r", exc)

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

    def enable_async(
        self, snapshot_bytes: int, unsupported: Optional[str], growth: int = 0
    ) -> bool:
        """Collective, once when training starts: the fast paths on every rank or none
        (saver.py, gates.py)."""
        return self.saver.enable_async(snapshot_bytes, unsupported, growth)

    def save_dcp_async(self, step: int, start: Callable[[str, Any], Any]) -> str:
        """The plain loop's async periodic save (collective): `start(path, process_group)`
        begins DCP's own `async_save` and returns its future; the writer waits for it, then
        votes and commits as for the Trainer's saves (inflight.py)."""
        save = self.saver.begin_save(step)
        if save is not None:
            self.saver.save_dcp(save, start)
        self.saved(step)
        return self.checkpoint_dir(step)

    def before_update(self) -> None:
        """Training thread, before every optimizer step: the snapshot must be complete."""
        self.saver.inflight.before_update()

    def drain(self, cancel_before: Optional[int] = None) -> None:
        """Training thread, on every rank in step: wait until the async save in flight is
        committed or abandoned; cancel one of a step older than `cancel_before` that is still
        being copied or written (inflight.py)."""
        self.saver.inflight.drain(cancel_before)

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


_current: Optional[CheckpointManager] = None


def current() -> CheckpointManager:
    """This process's manager (one per process, like the signal disposition it owns)."""
    global _current  # noqa: PLW0603 - one lifecycle owner per process
    if _current is None:
        _current = CheckpointManager(Session.from_env(os.environ))
    return _current
