"""The survivors' save: a node lost without notice, and the ranks left save the last step.

When a peer on another node dies (its pod SIGKILLed or OOM-killed), the next collective raises
on every rank left: gloo's `Connection closed by peer` from DDP's all-reduce or from the hook's
own step agreement. Without this, that error ends training and the run falls back to its last
periodic checkpoint, though each DDP rank left holds a whole replica of the last step.

A Trainer's state is exactly one step's only between that step's end (and its evaluation) and
the next optimizer update. `step_ended` (on_step_end, before any collective of the hook) keeps
what the next step's forward changes: RNG states, flops, tokens seen, the model's persistent
buffers; later events of the same step (a log, an evaluation, a save) keep them again, as HF's
own save of the step would take them, until the next step begins (`step_begun`); `updating`
(on_pre_optimizer_step, and before the best model is loaded) marks the state as changing. When
`train()` raises a lost peer's error (`lost_peer`), `after_error` writes the last completed step
from this rank's replica with no collective: every file the Trainer's save writes for every
rank (the dead ranks' RNG files are copies of this rank's: DDP ranks seed and draw alike),
committed as a one-node save of the job's world size (a resume at any node count loads it
whole), kind jit, its manifest naming the rank that wrote it; then the rank exits with
JITCKPT_EXIT_CODE. One rank per node saves (a lock in status/); the node's other ranks exit
alike once it has (a marker per torchrun attempt in the run's status directory). Under HSDP
with one replica per node (replica_group.py) a node's ranks hold the replica together: each
writes its own shards, and the node's local rank 0 merges them and commits the save, its
writers every rank of the node. A machine gone
without closing its connections fails the collective only after the process group's timeout,
unless JITCKPT_PEER_TIMEOUT (opt-in) has its silent connections shut down sooner
(peer_timeout.py, started here when such a save can be made).

What this does not cover goes on as without it, with one line why (the error goes up into
training): one node, no whole replica on a rank or a node (FSDP but HSDP with a replica per
node, DeepSpeed, a Trainer that keeps its own save or writes files of its own into its
checkpoints: save_extras.py), a model on an accelerator (its
collectives run behind the host: `_accelerator`), a rank inside an optimizer update or before
its step's evaluation is done, a rank of this very node gone (a worker crash: torchrun's
restart and the RAM tier handle it; `_crashed` leaves a marker for its node-mates, as a killed
process leaves a zombie), a save in flight that does not stop, or a failed write.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import random
import re
import time
from typing import Any, Optional

from jitckpt_entrypoint.hook import peer_timeout, replica_group, save_extras
from jitckpt_entrypoint.hook.peer_timeout import PeerTimeout
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.protocol import atomic, registry, validity
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.commit import commit_node, remove_checkpoint
from jitckpt_entrypoint.protocol.layout import checkpoint_name

LOST_PEER = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "connection timed out",
)
"""What gloo's errors say when the rank at the other end is gone (lower case); the first also
when its machine acknowledged nothing for JITCKPT_PEER_TIMEOUT seconds (peer_timeout.py shut
the connection down), the last when the kernel's keepalive ended it."""

IN_FLIGHT_WAIT = 5.0
"""Seconds a background save in flight gets to stop before the survivors' save of its step."""
BUFFERS_DIFFER = "the model's buffers differ per rank (only rank 0's are saved)"
"""The one training-wide refusal a node-mate (rank 0) does not share."""
LOCAL_SETTLE = 0.5
"""Seconds a rank whose node-mates all look alive keeps looking before it takes a peer's error
for a node lost (a node-mate killed a moment ago may not show as exiting yet)."""
PF_EXITING = 0x4
"""linux/sched.h: the process is exiting (/proc/PID/stat's flags)."""
LOCK = "survivors.lock"
"""The flock in status/ that one rank per node saves under."""
CRASHED = "crashed-{restart}-{who}"
"""A marker in the run's status directory: that rank of torchrun's `restart` raised."""
SAVED = "survivors-{restart}-{who}"
"""A marker in the run's status directory: the step that node's survivors' save committed
(HSDP: -1 when its local rank 0 refused it)."""
PART = "survivors-part-{restart}-{who}"
"""HSDP: a marker in the run's status directory: the step whose shards that rank wrote in its
part directory, or `refused: <why>`."""
PARTS = "survivors-parts-{restart}-{who}"
"""HSDP: the directory in the run's status directory where node `who`'s ranks write their
parts (on the volume: the merge moves their files into the checkpoint)."""
GROUP_WAIT = 30.0
"""HSDP: seconds local rank 0 waits for its node-mates' parts once its own is written."""
GROUP_LIMIT = 1800.0
"""HSDP: seconds a node-mate waits at most for local rank 0's decision (while every rank of
the node lives: a merge and commit of a large model's parts take a while)."""


def lost_peer(exc: BaseException) -> bool:
    """`exc` (or what caused it) is a gloo collective's error because a peer is gone."""
    import torch.distributed as dist

    seen: set[int] = set()
    cause: Optional[BaseException] = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        text = str(cause).lower()
        gloo = isinstance(cause, RuntimeError) and "gloo" in text
        if (gloo or isinstance(cause, dist.DistNetworkError)) and any(s in text for s in LOST_PEER):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


class SaveShortError(Exception):
    """A survivors' save written but not committed: it lacks a file of this training's
    checkpoints (save_extras.held_before)."""


class Survivors:
    """This rank's last completed step, and the save of it when peers are lost."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._why_not: Optional[str] = "training has not started"
        """Why no survivors' save can be made in this training (decided when it starts)."""
        self._group = False
        """HSDP with one replica per node: the node's ranks save their shards together
        (replica_group.py), not one rank alone."""
        self._step: Optional[int] = None
        """The step the state is exactly, or None (inside a step's update or evaluation)."""
        self._in_step = False
        """The next step began: a log now is of its forward, not of `_step`."""
        self._evaluating = False
        """The kept step's evaluation is still to come."""
        self._began_at = 0
        self._kept: dict[str, Any] = {}
        """What the next step changes before its update: RNG states, flops, tokens seen."""
        self._buffers: list[tuple[Any, str, str]] = []
        """(module, name, state-dict key) of the model's persistent buffers."""
        self._buffer_copies: dict[str, Any] = {}
        self._timeout = PeerTimeout(session.cfg.peer_timeout, session.log)
        """Ends a connection whose other machine acknowledges nothing (a node gone silent)."""

    # -- training thread --

    def started(self, trainer: Any, step: int, own_files: Optional[str] = None) -> None:
        """Training (re)starts at `step`: nothing newer than it to save yet. Decides whether a
        survivors' save can be made at all; when not, nothing is kept per step. `own_files`:
        what the Trainer subclass's own `_save_checkpoint` adds to its checkpoints, which such
        a save cannot write (save_extras.py). Never raises."""
        self._step, self._in_step, self._began_at = None, False, step
        self._kept, self._buffer_copies, self._group = {}, {}, False
        try:
            self._why_not = own_files or self._unsupported(trainer)
            self._buffers = [] if self._why_not else persistent_buffers(trainer)
        except Exception as exc:  # noqa: BLE001 - a Trainer we cannot inspect: no such save
            self._why_not = f"cannot inspect the Trainer ({exc!r:.80})"
        if not self._why_not and self._buffers and self._group:
            self._why_not = "HSDP and the model's persistent buffers (each rank's own)"
        self._group = self._group and not self._why_not
        if not self._why_not and self._buffers and self.session.topo.rank != 0:
            # DDP broadcasts rank 0's buffers before each forward; a forward then changes each
            # rank's own: the checkpoint holds rank 0's, which a writer of another rank lacks.
            self._why_not = BUFFERS_DIFFER
        if not self._why_not:
            self._watch_connections()
        else:
            self._say_off()

    def _say_off(self) -> None:
        """Rank 0 of a job of several nodes says once per training why no survivors' save can
        be made, and that JITCKPT_PEER_TIMEOUT, when set, does nothing here."""
        session = self.session
        if session.topo.nodes < 2 or not session.cfg.jit or session.topo.rank != 0:
            return
        session.log.info("survivors' saves are off in this training: %s", self._why_not)
        if session.cfg.peer_timeout:
            session.log.warning(
                "JITCKPT_PEER_TIMEOUT=%d has no effect: no survivors' save here",
                session.cfg.peer_timeout,
            )

    def _watch_connections(self) -> None:
        """JITCKPT_PEER_TIMEOUT: a connection silent that long is shut down (peer_timeout.py)."""
        try:
            count = self._timeout.started()
        except Exception as exc:  # noqa: BLE001 - only the detection of a silent machine
            self.session.log.debug("connections not watched (JITCKPT_PEER_TIMEOUT): %r", exc)
            return
        if count and self.session.topo.rank == 0:
            self.session.log.info(
                "a machine that acknowledges nothing for %d s counts as lost "
                "(JITCKPT_PEER_TIMEOUT; %d connections watched)",
                self._timeout.seconds,
                count,
            )

    def ended(self) -> None:
        """Training ended: the connections are no longer watched."""
        self._timeout.stopped()

    def _unsupported(self, trainer: Any) -> Optional[str]:  # noqa: PLR0911 - a reason each
        from jitckpt_entrypoint.hook import trainer_checkpoint

        session = self.session
        if not session.cfg.jit:
            return "JIT checkpoints are off"
        if session.topo.nodes < 2:
            return "one node: a lost rank is a worker crash (torchrun's restart handles it)"
        if getattr(trainer, "is_fsdp_enabled", False):
            topo = session.topo
            why = replica_group.replica_per_node(
                trainer, topo.rank, topo.local_rank, topo.local_world_size
            )
            if why is not None:
                return why
            if not session.run_id:
                return "HSDP: the node's ranks agree through the entrypoint's run directory"
            overridden = replica_group.overridden(trainer)
            if overridden:
                return f"{type(trainer).__name__} overrides {overridden}: its save is its own"
        device = _accelerator(trainer)
        if device is not None:
            return (
                f"the model is on {device}: the device may still be inside a collective with "
                "the lost peer, or have ended it with partial data (built for CPU training only)"
            )
        if not trainer_checkpoint.rng_kept():
            return "this accelerator's RNG state is not kept per step"
        why = trainer_checkpoint.unsupported(trainer)
        self._group = why is None and getattr(trainer, "is_fsdp_enabled", False)
        return why

    def evaluation_due(self) -> None:
        """An evaluation of this step comes (an epoch's end): not the step's state until it
        is done."""
        if self._step is not None:
            self._step, self._evaluating = None, True

    def evaluation_cancelled(self, step: int) -> None:
        """A JIT stop at `step` cancels its evaluation: the state is the step's as kept."""
        if self._evaluating and self._kept.get("step") == step:
            self._step, self._evaluating = step, False

    def step_begun(self) -> None:
        """The next step's forward begins: the kept step's RNG states are final."""
        self._in_step = True

    def updating(self) -> None:
        """The state is about to change (an optimizer update, the best model loaded): no step
        until the next ends."""
        self._step, self._evaluating = None, False

    def step_ended(self, trainer: Any, step: int, evaluating: bool) -> None:
        """The state is exactly `step`'s: keep what the next forward changes. `evaluating`: the
        step's evaluation is still to come (a save without it would not be the step's state:
        its best metric, a plateau scheduler). Never raises."""
        if self._why_not:
            return
        self._timeout.progressed()
        try:
            self._buffer_copies = {
                key: getattr(module, name).detach().clone() for module, name, key in self._buffers
            }
            self._keep(trainer)
            self._step, self._in_step = (None if evaluating else step), False
            self._evaluating = evaluating
        except Exception as exc:  # noqa: BLE001 - only the survivors' save depends on it
            self._step = None
            self.session.log.debug("step %d not kept for a survivors' save: %r", step, exc)

    def same_step(self, trainer: Any, evaluated: bool = False) -> None:
        """Later in the same step (a log, an evaluation, a save): HF's save at this step would
        take the RNG states and flops now. `evaluated`: the step's evaluation is done."""
        if self._why_not or self._in_step:
            return
        step = trainer.state.global_step
        if evaluated and self._evaluating and self._kept.get("step") == step:
            self._step, self._evaluating = step, False
        if self._step is not None and step == self._step:
            try:
                self._keep(trainer)
            except Exception:  # noqa: BLE001 - the kept states of the step's end stay
                self._step = None

    def _keep(self, trainer: Any) -> None:
        state = trainer.state
        self._kept = {
            "step": state.global_step,
            "rng": _rng_states(),
            "current_flos": float(getattr(trainer, "current_flos", 0.0)),
            "total_flos": state.total_flos,
            "tokens": getattr(state, "num_input_tokens_seen", None),
        }

    def _put_back(self, trainer: Any) -> None:
        """The state as it was when the step's last event was kept."""
        kept, state = self._kept, trainer.state
        _set_rng_states(kept["rng"])
        for module, name, key in self._buffers:
            getattr(module, name).data.copy_(self._buffer_copies[key])
        trainer.current_flos = kept["current_flos"]
        state.total_flos = kept["total_flos"]
        if kept["tokens"] is not None:
            state.num_input_tokens_seen = kept["tokens"]

    # -- after training raised --

    def after_error(self, trainer: Any, exc: BaseException, manager: Any) -> None:
        """`train()` raised `exc`: when a peer is lost, save the last step and exit (does not
        return); else return (the error goes on up). Never raises."""
        lost_at = time.time()
        self._timeout.stopped()
        try:
            if not lost_peer(exc):
                self._crashed()
                return
            why = self._refusal(trainer, manager)
            if self._group and not self._why_not:
                self._save_group(trainer, exc, manager, why, lost_at)
                return
            if why is not None:
                self._wait_for_mates(why)  # exits when a node-mate saved
                self.session.log.error(
                    "a peer is lost (%s); no survivors' save: %s", _short(exc), why
                )
                return
            self._save_or_leave(trainer, exc, manager, self._step, lost_at)
        except Exception as inner:  # noqa: BLE001 - the training error is the one to report
            self.session.log.error("survivors' save failed: %r", inner)  # noqa: TRY400 - one line

    def _refusal(self, trainer: Any, manager: Any) -> Optional[str]:  # noqa: PLR0911 - a reason each
        if self._why_not:
            return self._why_not
        if self._step is None or trainer.state.global_step != self._step:
            if self._evaluating:
                return f"this rank was inside step {trainer.state.global_step}'s evaluation"
            return "this rank was inside an optimizer update"
        if self._step <= self._began_at:
            return f"no step completed since step {self._began_at}"
        if self._local_crash(settle=LOCAL_SETTLE):
            return "a rank of this node crashed (torchrun's restart and the RAM tier handle it)"
        if getattr(manager.saver, "_handed", None) is not None:
            return "the RAM writer is writing a save out"
        if not _stop_in_flight(manager):
            return f"the background save in flight did not stop within {IN_FLIGHT_WAIT:.0f} s"
        return None

    def _wait_for_mates(self, why: str) -> None:
        """Refused here: a node-mate may save (it is rank 0, or its step is whole). Leaving at
        once would have torchrun stop the node's workers mid-save; so wait (a few seconds at
        most) while one may still take the lock, then for its save, and exit as it did."""
        session = self.session
        topo = session.topo
        shared = self._why_not == why and why != BUFFERS_DIFFER  # every rank refuses alike
        if topo.local_world_size <= 1 or shared or self._local_crash():
            if self._saved_here(0):
                session.exit(session.cfg.exit_code)
            return
        lock = os.path.join(session.layout.status, LOCK)
        deadline = time.monotonic() + IN_FLIGHT_WAIT + 1.0
        while time.monotonic() < deadline and not self._saved_here(0):
            if _held(lock):
                with _locked(lock):  # its save is done (or failed) when this returns
                    break
            time.sleep(0.05)
        if self._saved_here(0):
            session.exit(session.cfg.exit_code)

    def _saved_here(self, step: int) -> bool:
        """A rank of this node committed a survivors' save of `step` or a later one in this
        attempt of torchrun's (a marker in the run's status directory; without the entrypoint's
        run id there is none: each rank saves in turn, skipping a step committed already)."""
        path = self._marker(SAVED, self.session.topo.node)
        try:
            with open(path or "", encoding="ascii") as f:
                return int(f.read().strip() or -1) >= step
        except (OSError, ValueError):
            return False

    def _marker(self, template: str, who: int) -> Optional[str]:
        session = self.session
        if not session.run_id:
            return None
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        name = template.format(restart=restart, who=who)
        return os.path.join(registry.run_dir(session.layout.status, session.run_id), name)

    def _crashed(self) -> None:
        """This rank's training raised (not a lost peer): mark it before its process group
        goes, so that its node-mates, whose collectives fail next, do not take it for a node
        lost."""
        path = self._marker(CRASHED, self.session.topo.rank)
        if path is not None and self.session.topo.local_world_size > 1:
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))

    def _local_crash(self, settle: float = 0.0) -> bool:
        """A rank of this node raised, or its process is gone or exiting: a worker crash, not a
        node lost. `settle`: seconds to keep looking while every node-mate looks alive."""
        topo = self.session.topo
        if topo.local_world_size <= 1:
            return False
        first = topo.rank - topo.local_rank
        deadline = time.monotonic() + settle
        while True:
            for rank in range(first, first + topo.local_world_size):
                path = self._marker(CRASHED, rank)
                if path is not None and os.path.exists(path):
                    return True
            if _local_peer_gone(topo.local_world_size):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def _save_or_leave(
        self, trainer: Any, exc: BaseException, manager: Any, step: Optional[int], lost_at: float
    ) -> None:
        session = self.session
        if step is None:  # not reached: _refusal said why
            return
        with self._save_lock():
            if self._saved(session.topo.node) == -1:  # a node-mate's save fell short
                return
            if not self._saved_here(step):
                if self._kept_committed(exc, step):
                    seconds = 0.0
                else:
                    session.log.warning(
                        "a peer is lost (%s): rank %d saves %s, the last step it completed",
                        _short(exc),
                        session.topo.rank,
                        checkpoint_name(step),
                    )
                    try:
                        seconds = self._save(trainer, step)
                    except SaveShortError as short:
                        self._mark(SAVED, session.topo.node, -1)
                        session.log.error(  # noqa: TRY400 - one line, not a traceback
                            "a peer is lost (%s); no survivors' save: %s", _short(exc), short
                        )
                        return
                path = self._marker(SAVED, session.topo.node)
                if path is not None:
                    atomic.write_bytes(path, str(step).encode(), durable=False)
                manager.records.jit(step, seconds, peer_lost_at=lost_at, any_rank=True)
        session.exit(session.cfg.exit_code)

    def _save_group(
        self, trainer: Any, exc: BaseException, manager: Any, why: Optional[str], lost_at: float
    ) -> None:
        """HSDP: every rank of this node writes its part of the last step; the node's local
        rank 0 merges and commits them (replica_group.py), or refuses for all. Exits when
        the node's save is committed; returns when it is not (the error goes on up)."""
        session, topo = self.session, self.session.topo
        lead = topo.local_rank == 0
        # A node-mate may wait in a collective on this rank, which left it: its wait ends now.
        peer_timeout.shut_down_to(_node_mates())
        parts, part = self._parts()
        committed = False
        try:
            if why is None and self._saved(topo.node) is not None:
                why = "local rank 0 refused the node's save"
            if why is None and self._step is not None:
                committed = self._write_part(trainer, exc, manager, self._step, lost_at)
        except Exception as inner:  # noqa: BLE001 - the training error is the one to report
            why = f"rank {topo.rank}'s part failed: {inner!r:.200}"
        finally:
            if lead and not committed:  # the node-mates stop waiting
                with contextlib.suppress(OSError):
                    self._mark(SAVED, topo.node, -1)
        if why is not None:
            with contextlib.suppress(OSError):
                self._mark(PART, topo.rank, f"refused: {why}")
            session.log.error("a peer is lost (%s); no survivors' save: %s", _short(exc), why)
        if not lead:
            self._wait_for_lead(topo.rank - topo.local_rank)
        saved = self._saved(topo.node)
        replica_group.remove(parts if lead else part)
        if saved is not None and saved >= 0:
            session.exit(session.cfg.exit_code)

    def _parts(self) -> tuple[str, str]:
        """The node's parts directory, and this rank's part in it."""
        parts = self._marker(PARTS, self.session.topo.node) or ""
        return parts, os.path.join(parts, replica_group.PART.format(rank=self.session.topo.rank))

    def _write_part(
        self, trainer: Any, exc: BaseException, manager: Any, step: int, lost_at: float
    ) -> bool:
        """This rank's part of `step`; local rank 0 then merges and commits the node's parts.
        True once committed (local rank 0); raises when this rank's part fails."""
        topo, started = self.session.topo, time.time()
        parts, part = self._parts()
        self._put_back(trainer)
        names = replica_group.write_part(trainer, part)
        trainer._save_rng_state(part)
        self._mark(PART, topo.rank, step)
        if topo.local_rank != 0:
            return False
        why = self._merge_and_commit(trainer, exc, step, parts, names)
        if why is not None:
            self._mark(PART, topo.rank, f"refused: {why}")
            self.session.log.error("a peer is lost (%s); no survivors' save: %s", _short(exc), why)
            return False
        with contextlib.suppress(Exception):  # the save is committed whatever the record does
            seconds = time.time() - started
            manager.records.jit(step, seconds, peer_lost_at=lost_at, any_rank=True)
        return True

    def _wait_for_lead(self, lead: int) -> None:
        """Until local rank 0 decides (SAVED): its part first, for GROUP_WAIT after this
        rank's own at most; then while every rank of the node lives and none crashed, for
        GROUP_LIMIT at most (a large model's merge and commit take a while)."""
        topo = self.session.topo
        begun = time.monotonic()
        while self._saved(topo.node) is None:
            waited = time.monotonic() - begun
            if self._read(PART, lead) is None and waited > GROUP_WAIT:
                return
            if waited > GROUP_LIMIT or self._local_crash():
                return
            time.sleep(0.05)

    def _merge_and_commit(
        self, trainer: Any, exc: BaseException, step: int, parts: str, names: list[str]
    ) -> Optional[str]:
        """Local rank 0, its own part written: wait for the node's other parts, merge them
        into the checkpoint and commit it; why not, or None once committed."""
        session, topo = self.session, self.session.topo
        ranks = list(range(topo.rank, topo.rank + topo.local_world_size))  # local rank 0's node
        deadline = time.monotonic() + GROUP_WAIT
        done: dict[int, str] = {}
        while len(done) < len(ranks) and time.monotonic() < deadline:
            done.update((r, t) for r in ranks if (t := self._read(PART, r)) is not None)
            if any(t != str(step) for t in done.values()):
                break
            time.sleep(0.05)
        wrong = [f"rank {r}: {done.get(r, 'no part')}" for r in ranks if done.get(r) != str(step)]
        if wrong:
            return f"this node's ranks are not all at step {step} ({'; '.join(wrong)})"
        expected = {replica_group.MODEL_DIR}
        if not trainer.args.save_only_model:
            expected.add(replica_group.OPTIMIZER_DIR)
        if set(names) != expected:
            return f"the Trainer's FSDP save wrote {names or 'no DCP directory'}, not {expected}"
        with self._save_lock():  # one save of this step at a time (PVC mode: every node's)
            if not self._kept_committed(exc, step):
                session.log.warning(
                    "a peer is lost (%s): ranks %d-%d save %s, the last step they completed",
                    _short(exc),
                    ranks[0],
                    ranks[-1],
                    checkpoint_name(step),
                )
                why = self._write_group(trainer, step, parts, names)
                if why is not None:
                    return why
            self._mark(SAVED, topo.node, step)
        return None

    def _write_group(self, trainer: Any, step: int, parts: str, names: list[str]) -> Optional[str]:
        """The shared files, each rank's RNG file and the merged DCP directories in the
        checkpoint of `step`, committed as a one-node save of the job's world size; why not, or
        None."""
        from jitckpt_entrypoint.hook.trainer_checkpoint import TrainerCheckpoint

        topo, layout = self.session.topo, self.session.layout
        started = time.time()
        ckpt_dir = layout.checkpoint_dir(step)
        ranks = list(range(topo.rank, topo.rank + topo.local_world_size))
        if os.path.lexists(ckpt_dir):  # uncommitted, or not whole here
            remove_checkpoint(ckpt_dir)
        try:
            TrainerCheckpoint(trainer, alone=True).write_small(ckpt_dir)
            own = {r: os.path.join(parts, replica_group.PART.format(rank=r)) for r in ranks}
            for rank, part in own.items():  # each rank's own RNG file, not a copy of this one's
                os.replace(
                    os.path.join(part, f"rng_state_{rank}.pth"),
                    os.path.join(ckpt_dir, f"rng_state_{rank}.pth"),
                )
            for name in names:
                merged = {r: os.path.join(part, name) for r, part in own.items()}
                replica_group.merge(merged, os.path.join(ckpt_dir, name))
        except Exception as err:  # noqa: BLE001 - nothing half-written stays; one line why
            remove_checkpoint(ckpt_dir)
            return f"the parts do not make one save ({err!r:.200})"
        short = self._short_of_earlier(ckpt_dir, step)
        if short is not None:
            return short
        self._commit(ckpt_dir, step, started, tuple(ranks))
        return None

    def _short_of_earlier(self, ckpt_dir: str, step: int) -> Optional[str]:
        """Why the written, uncommitted `ckpt_dir` is not this training's checkpoint of `step`
        (it lacks a file its earlier ones hold: save_extras.py), removed then; else None."""
        session = self.session
        why = save_extras.held_before(
            session.layout.checkpoints,
            session.topo.node,
            ckpt_dir,
            since=self._began_at,
            step=step,
            lineage=session.lineage,
        )
        if why is not None:
            remove_checkpoint(ckpt_dir)
        return why

    @contextlib.contextmanager
    def _save_lock(self) -> Any:
        """The flock in status/ that one survivors' save at a time is written under."""
        os.makedirs(self.session.layout.status, exist_ok=True)
        with _locked(os.path.join(self.session.layout.status, LOCK)):
            yield

    def _kept_committed(self, exc: BaseException, step: int) -> bool:
        """A save of `step` of every rank is committed on the volume: kept (one line)."""
        if validity.committed(self.session.layout.checkpoint_dir(step)) is None:
            return False
        self.session.log.warning(
            "a peer is lost (%s): %s is committed, the last step completed",
            _short(exc),
            checkpoint_name(step),
        )
        return True

    def _mark(self, template: str, who: int, value: object) -> None:
        path = self._marker(template, who)
        if path is not None:
            atomic.write_bytes(path, str(value).encode(), durable=False)

    def _read(self, template: str, who: int) -> Optional[str]:
        try:
            with open(self._marker(template, who) or "", encoding="utf-8") as f:
                return f.read().strip()
        except OSError:
            return None

    def _saved(self, node: int) -> Optional[int]:
        """The step node `node`'s survivors' save committed, -1 when refused, None while
        undecided."""
        text = self._read(SAVED, node)
        try:
            return None if text is None else int(text)
        except ValueError:
            return None

    def _save(self, trainer: Any, step: int) -> float:
        """Write and commit `step` from this rank alone; its seconds."""
        from jitckpt_entrypoint.hook.saver import _sync_devices
        from jitckpt_entrypoint.hook.trainer_checkpoint import TrainerCheckpoint
        from jitckpt_entrypoint.hook.writer import WRITERS, write_files

        session, started = self.session, time.time()
        layout, topo = session.layout, session.topo
        ckpt_dir = layout.checkpoint_dir(step)
        if os.path.lexists(ckpt_dir):  # uncommitted, or not whole here (the lost node had part)
            remove_checkpoint(ckpt_dir)
        self._put_back(trainer)
        ckpt = TrainerCheckpoint(trainer, alone=True)
        ckpt.write_small(ckpt_dir)
        tensors = ckpt.tensors()
        _sync_devices(tensors)
        write_files(ckpt.writers(ckpt_dir, tensors, WRITERS, None))
        short = self._short_of_earlier(ckpt_dir, step)
        if short is not None:
            raise SaveShortError(short)
        self._commit(ckpt_dir, step, started, (topo.rank,))
        return time.time() - started

    def _commit(self, ckpt_dir: str, step: int, started: float, writers: tuple[int, ...]) -> None:
        """Commit a survivors' save: a one-node JIT save of the job's world size (a resume at
        any node count loads it whole), `writers` the ranks that wrote it."""
        session = self.session
        lineage = session.lineage if session.lineage is not None else m.new_lineage()
        commit_node(
            session.layout,
            ckpt_dir,
            {0: m.list_files(ckpt_dir)},
            node=0,
            nodes=1,
            world_size=session.topo.world_size,
            step=step,
            kind="jit",
            started_at=started,
            run_id=session.run_id,
            stage_for_upload=bool(session.cfg.storage_uri),
            save_id=m.new_save_id(),
            lineage=lineage,
            writers=writers,
        )


def _short(exc: BaseException) -> str:
    """The error's first line, without gloo's source location."""
    text = re.sub(r"^\[[^\]]*\] ", "", str(exc).strip().split("\n")[0])
    return f"{type(exc).__name__}: {text[:100]}"


def _accelerator(trainer: Any) -> Optional[str]:
    """The device type of the model's state when it is not the host's. A collective there runs
    behind the host (NCCL): the step the host completed may still wait on the lost peer on the
    device, and a communicator aborted by NCCL's error handling ends it with partial data."""
    model = trainer.model  # wrapped or not: the same tensors
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.device.type != "cpu":
            return str(tensor.device.type)
    return None


def persistent_buffers(trainer: Any) -> list[tuple[Any, str, str]]:
    """(module, name, state-dict key) of the model's buffers its state dict holds
    (BatchNorm's statistics: a forward changes them); parameters change only in the update."""
    from jitckpt_entrypoint.hook.trainer_checkpoint import TrainerCheckpoint

    model = TrainerCheckpoint(trainer)._model_to_save()
    out = []
    for module_name, module in model.named_modules():
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in skip:
                out.append((module, name, f"{module_name}.{name}" if module_name else name))
    return out


def _rng_states() -> dict[str, Any]:
    import numpy as np
    import torch

    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    import numpy as np
    import torch

    if "python" in states:
        random.setstate(states["python"])
        np.random.set_state(states["numpy"])
        torch.random.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.random.set_rng_state_all(states["cuda"])


def _local_peer_gone(local_world_size: int) -> bool:
    """Fewer of torchrun's workers on this node (this process's parent's children) live than
    it started: a local rank crashed, not a node lost. A process being killed counts as gone
    from the start of its exit (PF_EXITING): its sockets close, and its peers' collectives
    fail, a moment before it is a zombie."""
    if local_world_size <= 1:
        return False
    return len(_node_mates()) + 1 < local_world_size


def _node_mates() -> list[int]:
    """The live processes of this process's parent (torchrun's workers on this node) but
    this one, none exiting."""
    parent, own, out = os.getppid(), os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == own:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        exiting = int(fields[6]) & PF_EXITING
        if int(fields[1]) == parent and fields[0] not in (b"Z", b"X") and not exiting:
            out.append(int(entry))
    return out


@contextlib.contextmanager
def _locked(path: str) -> Any:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _held(path: str) -> bool:
    """Another process holds the flock on `path`."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def _stop_in_flight(manager: Any) -> bool:
    """Cancel the background save in flight (its step is saved here); True once it ended."""
    inflight = manager.saver.inflight
    save = inflight.save
    if save is None or save.job is None:
        return True
    save.ready.set()
    save.job.cancel()
    if not save.job.wait(IN_FLIGHT_WAIT):
        return False
    inflight.save = None
    return True
