"""Hugging Face Trainer integration, applied the moment `transformers.trainer` is imported.

Every Trainer (TRL's trainers subclass it) gets, with no change to the training script:

- checkpoints (`checkpoint-<step>/`) in JITCKPT_DIR/checkpoints, while `args.output_dir` stays
  the script's for everything else (save_model, model card, metrics, logs): transformers derives
  every checkpoint path (save, rotation, best model, end-of-training clean-up) from
  `Trainer._get_output_dir`, the one method patched for it;
- the JITCKPT_SAVE_* overrides (logged once), and time-based periodic saves
  (JITCKPT_SAVE_INTERVAL, JITCKPT_SAVE_OVERHEAD: the callback sets `should_save` at the step
  every rank agreed on);
- resume from the newest checkpoint committed on every node, unless the script passed
  resume_from_checkpoint itself (HF's get_last_checkpoint ignores commit markers);
- a callback that hands the Trainer's events to the checkpoint manager (manager.py), which
  commits every save, agrees across ranks after each optimizer step whether any rank got
  SIGTERM, and on agreement has that step saved, commits it and exits with JITCKPT_EXIT_CODE;
  the callback only sets the Trainer's controls (save now, stop training);
- when training ends normally, world rank 0 records its output_dir: after the command exits 0
  the entrypoint stages what the script saved there as the final model (final/ in S3).

This module is an adapter: what happens to a checkpoint is decided in manager.py.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Iterator
from types import ModuleType
from typing import Any, Callable, Optional

from transformers.trainer_callback import TrainerCallback

from jitckpt_entrypoint.errors import JitckptError
from jitckpt_entrypoint.hook import output_dir_view, resume, save_extras, stages
from jitckpt_entrypoint.hook.manager import CheckpointManager, current
from jitckpt_entrypoint.hook.saves import SaveParts, SaveRequest, Staged
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.hook.topology import Topology
from jitckpt_entrypoint.protocol.layout import step_of

_logged_overrides = False
LOOPS = "_jitckpt_loops"
"""In a Trainer's __dict__ during jitckpt's train(): the training loops begun (on_train_begin)."""
RETRYING = "_jitckpt_retrying"
"""In a Trainer's __dict__ while a retry leaves the failed attempt behind: a save of it that
commits then runs no rotation (it would delete older checkpoints for one about to go)."""
_overridden: dict[int, tuple[Any, dict[str, Any]]] = {}
"""TrainingArguments the JITCKPT_SAVE_* overrides changed (by id), and the script's values."""


def patch(module: ModuleType) -> None:
    """Wrap Trainer.__init__, train, _get_output_dir, _save_checkpoint, _load_best_model and
    _determine_best_metric, and CallbackHandler.on_save."""
    trainer_cls = module.Trainer
    if getattr(trainer_cls, "_jitckpt_patched", False):
        return
    manager = current()
    session = manager.session
    original_init, original_train = trainer_cls.__init__, trainer_cls.train
    original_save, original_output_dir = trainer_cls._save_checkpoint, trainer_cls._get_output_dir

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - it is __init__
        if stages.began():  # a later stage's Trainer: its own (stages.py)
            stages.mark(self)
            original_init(self, *args, **kwargs)
            return
        args, kwargs = _with_training_args(session, module, args, kwargs)
        original_init(self, *args, **kwargs)
        self.add_callback(JitckptCallback(manager, self))

    @functools.wraps(original_train)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        if stages.decide(self, session):
            return _train_aside(manager, self, original_train, args, kwargs)
        args, kwargs = _with_resume(manager, args, kwargs, self)
        result = _train(manager, self, functools.partial(original_train, self, *args, **kwargs))
        # Not after an error: a node-mate's callback may still use one (a resume skips it).
        output_dir_view.close_views()
        return result

    @functools.wraps(original_output_dir)
    def _get_output_dir(self: Any, trial: Any) -> str:
        if stages.aside(self):  # a later stage's, a hyperparameter search's trial: not ours
            return str(original_output_dir(self, trial))
        return str(vars(self).get(save_extras.CHECKPOINTS_INTO, session.layout.checkpoints))

    @functools.wraps(original_save)
    def _save_checkpoint(self: Any, model: Any, trial: Any, *args: Any, **kwargs: Any) -> Any:
        if stages.aside(self):
            return original_save(self, model, trial, *args, **kwargs)
        nothing = save_extras.instead()  # save_extras.probe runs a subclass's override
        if nothing is not None:
            return nothing()
        own = functools.partial(original_save, self, model, trial, *args, **kwargs)
        manager.save_step(_save_request(self, self.state.global_step, own))
        return None

    _patch_best_model(trainer_cls, manager)
    session.before_exit.append(output_dir_view.close_views)  # a JIT or survivors' exit
    _commit_after_on_save(session)
    trainer_cls.__init__ = __init__
    trainer_cls.train = train
    trainer_cls._save_checkpoint = _save_checkpoint
    trainer_cls._jitckpt_original_save = original_save
    trainer_cls._get_output_dir = _get_output_dir
    trainer_cls._jitckpt_patched = True


def _train(manager: CheckpointManager, trainer: Any, train: Callable[[], Any]) -> Any:
    """jitckpt's `train()`: the Trainer's own, and what must follow it however it ends."""
    whole = _whole_state(manager.session, trainer.args, trainer)
    vars(trainer)[LOOPS] = 0
    failed: Optional[BaseException] = None
    try:
        return train()
    except BaseException as exc:
        failed = exc
        if isinstance(exc, Exception):
            manager.survivors.after_error(trainer, exc, manager)  # a peer lost: saves, exits
        raise
    finally:
        manager.survivors.ended()  # also after a BaseException (no on_train_end)
        trainer.args.save_only_model = whole
        vars(trainer).pop(LOOPS, None)
        if _left_nothing(trainer):
            del trainer.get_batch_samples
        manager.training_failed(failed)  # no on_train_end ran: the flag goes


def _patch_best_model(trainer_cls: type, manager: CheckpointManager) -> None:
    """Wrap Trainer._determine_best_metric and _load_best_model, where transformers has them."""
    original_load_best = getattr(trainer_cls, "_load_best_model", None)
    original_best_metric = getattr(trainer_cls, "_determine_best_metric", None)
    if original_best_metric is not None:

        @functools.wraps(original_best_metric)
        def _determine_best_metric(self: Any, *args: Any, **kwargs: Any) -> Any:
            # Right after the step's whole evaluation (every eval dataset, the plateau
            # scheduler's step): from here the state is the step's again (survivors.py).
            result = original_best_metric(self, *args, **kwargs)
            if not stages.aside(self):
                manager.survivors.same_step(self, evaluated=True)
            return result

        trainer_cls._determine_best_metric = _determine_best_metric  # type: ignore[attr-defined]
    if original_load_best is not None:

        @functools.wraps(original_load_best)
        def _load_best_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            # After the training loop, before on_train_end: the last step is saved and
            # committed (if it is not yet: save_strategy="best" and no new best at the last
            # evaluation) while the live weights are still its own; then the best model's
            # replace them.
            if not stages.aside(self):
                _end_training(manager, self)
            return original_load_best(self, *args, **kwargs)

        trainer_cls._load_best_model = _load_best_model  # type: ignore[attr-defined]


def _train_aside(
    manager: CheckpointManager, trainer: Any, train: Any, args: tuple[Any, ...], kwargs: Any
) -> Any:
    """A later stage's train(), or a trial's: the Trainer's own (stages.py). A later stage's
    settings are the script's again (the JITCKPT_SAVE_* overrides undone on the
    TrainingArguments they were made on); its `resume_from_checkpoint=True` finds the earlier
    stage's checkpoints, where HF would have put them, when its output_dir has none (one node:
    each rank decides alone)."""
    trial = trainer.hp_search_backend is not None
    if not trial:
        _undo_overrides(trainer.args)
        if manager.session.topo.nodes == 1:  # one volume: every rank finds the same
            layout = manager.session.layout
            args, kwargs = stages.resume_true(trainer, args, kwargs, layout.checkpoints)
    result = stages.run(trainer, train, args, kwargs, JitckptCallback)
    if not trial and trainer.is_world_process_zero():
        manager.record_output(trainer.args.output_dir, trainer.state.global_step)
    return result


def _whole_state(session: Session, training_args: Any, trainer: Any) -> bool:
    """save_only_model=True leaves the optimizer, scheduler and RNG states out of checkpoints:
    HF cannot resume from them, and a resume by jitckpt would be wrong (a fresh optimizer, the
    learning-rate schedule from its start). While jitckpt's train() runs, its checkpoints hold
    them (one line); the script's value is returned, to put back. Not for a model sharded when
    it was loaded: HF saves its model only."""
    script = bool(training_args.save_only_model)
    if script and not getattr(trainer, "is_distributed_loading_by_transformers", False):
        training_args.save_only_model = False
        if session.topo.rank == 0:
            session.log.info(
                "save_only_model=True: checkpoints hold the optimizer, scheduler and RNG "
                "states too, for an exact resume (HF cannot resume from the model alone)"
            )
    return script


def _commit_after_on_save(session: Session) -> None:
    """Each save is committed (JitckptCallback.after_save) once every callback's `on_save`
    ran, those added after jitckpt's too, so what they add to the checkpoint is in it; when one
    may act on the checkpoint, they find it in `args.output_dir` (output_dir_view.py). On the
    class: a Trainer may replace its handler (TRL's BEMA DPOTrainer), which keeps the
    callbacks."""
    from transformers.trainer_callback import CallbackHandler

    original = CallbackHandler.on_save
    if getattr(original, "_jitckpt", False):
        return

    @functools.wraps(original)
    def on_save(self: Any, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        ours = next((cb for cb in self.callbacks if isinstance(cb, JitckptCallback)), None)
        trainer = ours._trainer() if ours is not None else None
        try:
            if trainer is not None and output_dir_view.readers(trainer):
                checkpoints = session.layout.checkpoints
                output_dir_view.open_view(args.output_dir, checkpoints, state.global_step)
        except Exception as exc:  # noqa: BLE001 - the callbacks run as they would without it
            session.log.debug("no checkpoint in output_dir for on_save: %r", exc)
        control = original(self, args, state, control, **kwargs)
        return control if ours is None else ours.after_save(state, control)

    on_save._jitckpt = True  # type: ignore[attr-defined]
    CallbackHandler.on_save = on_save


def _save_request(trainer: Any, step: int, own: Callable[[], object]) -> SaveRequest:
    """One save of the Trainer as the manager takes it: the Trainer's own save `own`, and the
    fast path's parts of it: the Trainer's checkpoint in its own files and format
    (trainer_checkpoint.py), written by the save pipeline (saver.py, inflight.py); with FSDP
    (sharded), the Trainer's own save with its DCP writes staged and written by the
    background writer (fsdp_checkpoint.py). HF's
    rotation runs after the commit (HF rotates right after writing): the newest checkpoint,
    this one, is never among those it deletes."""
    run_dir = trainer._get_output_dir(trial=None)

    def after_commit() -> None:
        if trainer.args.should_save and not vars(trainer).get(RETRYING):
            rotate_checkpoints(trainer, run_dir)

    def parts() -> tuple[SaveParts, Optional[str]]:
        from jitckpt_entrypoint.hook import gates
        from jitckpt_entrypoint.hook.trainer_checkpoint import TrainerCheckpoint

        ckpt = TrainerCheckpoint(trainer)
        tensors = ckpt.tensors()
        parts = SaveParts(ckpt.write_small, tensors, ckpt.deferrable, ckpt.writers, after_commit)
        return parts, gates.state_problem(tensors)

    if getattr(trainer, "is_fsdp_enabled", False):
        return SaveRequest(step, own, stage=functools.partial(_stage, trainer, after_commit))
    return SaveRequest(step, own, parts=parts)


def rotate_checkpoints(trainer: Any, run_dir: str) -> None:
    """HF's own rotation (save_total_limit, the best checkpoint kept), ordered by step."""
    from transformers import trainer_utils

    rotate = getattr(trainer_utils, "rotate_checkpoints", None)
    if rotate is None:  # transformers < 5: a Trainer method
        trainer._rotate_checkpoints(use_mtime=False, output_dir=run_dir)
        return
    rotate(
        output_dir=run_dir,
        save_total_limit=trainer.args.save_total_limit,
        best_model_checkpoint=trainer.state.best_model_checkpoint,
        use_mtime=False,
    )


def _start_async(manager: CheckpointManager, trainer: Any, own_files: Optional[str]) -> None:
    """Decide (collectively) whether this Trainer's saves take the fast paths, and snapshots
    (not when `own_files`, what its class's own save adds, says so)."""
    from jitckpt_entrypoint.hook import trainer_checkpoint

    not_whole = _not_whole_nodes(manager, trainer)
    several = manager.session.topo.nodes > 1
    try:
        reason = trainer_checkpoint.unsupported(trainer)
        nbytes = trainer_checkpoint.snapshot_bytes(trainer)
        growth = trainer_checkpoint.growth_bytes(trainer)
        in_ram = trainer_checkpoint.snapshot_bytes(trainer, whole_node=True) if several else nbytes
    except Exception as exc:  # noqa: BLE001 - the Trainer's own save needs none of this
        reason, nbytes, growth = f"cannot size the training state ({exc!r:.80})", 0, 0
        in_ram = 0
    on = manager.enable_async(nbytes, reason, growth)
    # FSDP's sharded saves: HF's own, staged by DCP (_snapshot_staged); not written out by the
    # RAM writer (it takes the fast path's parts).
    sharded = getattr(trainer, "is_fsdp_enabled", False)
    manager.enable_snapshots(in_ram, on, not_whole, staged=sharded, lacking=own_files)


def _own_files(manager: CheckpointManager, trainer: Any) -> Optional[str]:
    """Collective when the Trainer's class has its own `_save_checkpoint` (alike on every
    rank): what it writes into its checkpoints besides the Trainer's save, as every rank's run
    of it into a scratch directory shows (save_extras.py), which snapshots in RAM and
    survivors' saves (the Trainer's save alone) would lack; None when nothing."""
    if not save_extras.overrides(trainer):
        return None
    session = manager.session
    wanted = session.control.all_gather((bool(session.cfg.memory_dir), session.cfg.jit))
    snapshots, jit = any(m for m, _ in wanted), any(j for _, j in wanted)
    if not snapshots and not (jit and session.topo.nodes > 1):
        return None  # no snapshot and no survivors' save to refuse: its save runs as it is
    try:
        written = save_extras.probe(trainer, session.layout.root)
    except Exception as exc:  # noqa: BLE001 - its save cannot be told apart: say so
        written = [f"(it failed when tried alone: {exc!r:.80})"]
    names = sorted({name for rank in session.control.all_gather(written) for name in rank})
    if not names:
        return None
    return (
        f"{type(trainer).__name__}._save_checkpoint also writes {', '.join(names[:5])} into its "
        "checkpoints, which the Trainer's save alone lacks"
    )


def _not_whole_nodes(manager: CheckpointManager, trainer: Any) -> Optional[str]:
    """With several nodes, why a node's snapshot in RAM cannot hold all its ranks load (each
    node's local rank 0 writes the shared files, TrainerCheckpoint's `whole_node`), or None."""
    if manager.session.topo.nodes <= 1:
        return None
    from jitckpt_entrypoint.hook.survivors import persistent_buffers

    if getattr(trainer, "is_fsdp_enabled", False):
        from jitckpt_entrypoint.hook import fsdp_checkpoint

        if fsdp_checkpoint.sharded(trainer):
            return None  # each node's snapshot: its own shards and what it reads (_spread)
        return (
            "FSDP's full state dict is gathered on process 0 alone: with several nodes a "
            "node's snapshot would not hold the model"
        )
    try:
        buffers = persistent_buffers(trainer)
    except Exception as exc:  # noqa: BLE001 - snapshots only; the Trainer's saves need none
        return f"cannot list the model's buffers ({exc!r:.80})"
    if buffers:
        return (
            f"the model has persistent buffers ({buffers[0][2]}, ...) that DDP ranks hold "
            "apart: with several nodes a node's snapshot would hold its own rank's, not "
            "process 0's"
        )
    return None


def _snapshot_parts(trainer: Any, whole_node: bool) -> tuple[SaveParts, Optional[str]]:
    """The fast path's parts of this step for a snapshot in RAM: the Trainer's checkpoint in
    its own files, without HF's rotation (memory_tier.py keeps its own); `whole_node` (several
    nodes): on each node, every file its ranks load."""
    from jitckpt_entrypoint.hook import gates
    from jitckpt_entrypoint.hook.trainer_checkpoint import TrainerCheckpoint

    ckpt = TrainerCheckpoint(trainer, whole_node=whole_node)
    tensors = ckpt.tensors()
    parts = SaveParts(ckpt.write_small, tensors, ckpt.deferrable, ckpt.writers, lambda: None)
    return parts, gates.state_problem(tensors)


def _snapshot_staged(
    trainer: Any, root: str, topo: Topology
) -> tuple[Callable[[Callable[[], object]], Staged], Callable[[], object]]:
    """A snapshot in RAM of an FSDP Trainer (sharded state): (stage, own), HF's own save of
    this step into `root` (its `_get_output_dir` points there meanwhile) with its DCP saves
    staged (fsdp_checkpoint.DeferredSaves) and written there by the background writer; HF's
    rotation held (memory_tier.py keeps its own). With several nodes each node's snapshot
    holds what its ranks load: its local rank 0 writes the Trainer's shared files
    (`save_on_each_node`, HF's own way), and the DCP files it reads that node 0 wrote are
    spread to it (dcp_reads.spread)."""
    several = topo.nodes > 1

    def own() -> None:
        state, args = trainer.state, trainer.args
        best = state.best_model_checkpoint  # HF's save may point it at a snapshot's directory
        vars(trainer)[save_extras.CHECKPOINTS_INTO] = root
        try:
            if trainer._get_output_dir(None) != root:
                raise OSError(f"{type(trainer).__name__} overrides _get_output_dir")
            with _on_each_node(args, several):
                # The Trainer's own save, not a subclass's (TRL's write a model card there):
                # what HF's resume reads, as the fast path's snapshots write.
                type(trainer)._jitckpt_original_save(trainer, trainer.model_wrapped, None)
        finally:
            vars(trainer).pop(save_extras.CHECKPOINTS_INTO, None)
            state.best_model_checkpoint = best

    spread = functools.partial(_spread, topo) if several else None
    return functools.partial(_stage, trainer, lambda: None, spread=spread), own


@contextlib.contextmanager
def _on_each_node(args: Any, several: bool) -> Iterator[None]:
    """HF's `save_on_each_node` inside `with` (several nodes: each node's local rank 0 writes
    the shared files); OSError (the snapshot is off, not training) when the arguments refuse
    it."""
    if not several or args.save_on_each_node:
        yield
        return
    try:
        args.save_on_each_node = True
    except Exception as exc:  # a frozen TrainingArguments: no snapshot
        raise OSError(f"{type(args).__name__} refuses save_on_each_node ({exc!r:.80})") from exc
    try:
        yield
    finally:
        args.save_on_each_node = False


def _spread(topo: Topology, directories: list[str], group: Any) -> None:
    from jitckpt_entrypoint.hook import dcp_reads

    dcp_reads.spread(directories, group, topo)


def _stage(
    trainer: Any,
    after_commit: Callable[[], None],
    write_own: Callable[[], object],
    spread: Optional[Callable[[list[str], Any], None]] = None,
) -> Staged:
    """The Trainer's own save `write_own` with its DCP saves staged (FSDP's sharded state:
    fsdp_checkpoint.DeferredSaves), HF's rotation held; `after_commit` runs after the commit;
    `spread(directories, group)` after the writes (a snapshot of several nodes)."""
    from jitckpt_entrypoint.hook.fsdp_checkpoint import DeferredSaves

    with DeferredSaves(trainer) as deferred:
        write_own()
    if spread is None:
        return Staged(deferred.staged, deferred.write, deferred.write_now, after_commit)

    def write(group: Any, check: Callable[[], None]) -> None:
        deferred.write(group, check)
        spread(deferred.directories, group)

    return Staged(deferred.staged, write, deferred.write_now, after_commit)


def _end_training(manager: CheckpointManager, trainer: Any) -> None:
    """Training's loop is over (collective): its last step is saved now unless committed (an
    early stop, a save_strategy or a callback that overrode ours), as JIT if that is why it
    stopped. In `_load_best_model`, before the best model is loaded, or else at on_train_end
    (`training_ending` runs once per train() on each rank)."""
    state = trainer.state

    def save_last() -> None:
        trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        manager.retention(best_step=_step_of(state.best_model_checkpoint))

    manager.training_ending(state.global_step, save_last)
    manager.survivors.updating()  # the best model's weights may replace the step's own next


def _warm_save_path() -> None:
    """Pay transformers' one-off save set-up now rather than between SIGTERM and the commit.

    transformers 5 compiles ~900 regexes (its weight-conversion table) on a process's first
    save_pretrained when the model was not loaded with from_pretrained: ~0.15 s on a CPU core.
    Best effort: the table is a private detail and may move.
    """
    try:
        from transformers import conversion_mapping

        conversion_mapping.get_checkpoint_conversion_mapping("llama")
    except Exception:  # noqa: BLE001 - an optimisation only; never fail training over it
        return


def _with_training_args(
    session: Session, module: ModuleType, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Apply the JITCKPT_SAVE_* overrides to the TrainingArguments (HF's default ones if none)."""
    # Trainer(model=None, args=None, ...): args is the second positional or a keyword.
    if "args" in kwargs:
        training_args = kwargs["args"]
    elif len(args) >= 2:
        training_args = args[1]
    else:
        training_args = None
    if training_args is None:
        training_args = module.TrainingArguments(output_dir="tmp_trainer")  # HF's own default
        if len(args) >= 2:
            args = (args[0], training_args, *args[2:])
        else:
            kwargs["args"] = training_args
    apply_overrides(session, training_args)
    return args, kwargs


def apply_overrides(session: Session, training_args: Any) -> list[str]:
    """Set the env's save settings on `training_args`; log the changes once."""
    global _logged_overrides  # noqa: PLW0603 - "logged once" per process, however many Trainers
    from transformers.trainer_utils import SaveStrategy

    cfg, changes = session.cfg, []

    def override(name: str, value: Any) -> None:
        old = getattr(training_args, name)
        if old != value:
            setattr(training_args, name, value)
            changes.append(f"{name}={_plain(value)} (script: {_plain(old)})")
            _overridden.setdefault(id(training_args), (training_args, {}))[1].setdefault(name, old)

    if cfg.effective_save_strategy is not None:
        override("save_strategy", SaveStrategy(cfg.effective_save_strategy))
    if cfg.save_steps is not None:
        override("save_steps", cfg.save_steps)
    if cfg.save_total_limit is not None:
        override("save_total_limit", cfg.save_total_limit)
    if changes and not _logged_overrides and session.topo.rank == 0:
        _logged_overrides = True
        session.log.info("overriding TrainingArguments from JITCKPT_*: %s", "; ".join(changes))
    return changes


def _undo_overrides(training_args: Any) -> None:
    """The script's own save settings back (a later stage's: stages.py)."""
    _args, script = _overridden.pop(id(training_args), (None, {}))
    for name, value in script.items():
        setattr(training_args, name, value)


def _step_of(checkpoint: Optional[str]) -> Optional[int]:
    return step_of(os.path.basename(os.path.normpath(checkpoint))) if checkpoint else None


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)


def _loads_universal(training_args: Any) -> bool:
    """The DeepSpeed config asks to load a universal checkpoint (any world size)."""
    config = getattr(getattr(training_args, "hf_deepspeed_config", None), "config", None)
    checkpoint = config.get("checkpoint") if isinstance(config, dict) else None
    return bool(isinstance(checkpoint, dict) and checkpoint.get("load_universal"))


def _checkpoint_to_resume(manager: CheckpointManager, trainer: Any) -> Optional[str]:
    """The committed checkpoint every rank resumes from, or None; JitckptError for one that
    cannot be resumed here."""
    step = manager.resume(asked=True)
    chosen = None if step is None else manager.resumed_dir
    if chosen is not None and getattr(trainer, "is_deepspeed_enabled", False):
        refusal = resume.zero_refusal(
            chosen,
            manager.session.topo.world_size,
            _loads_universal(getattr(trainer, "args", None)),
        )
        if refusal:
            raise JitckptError(refusal)
    return chosen


def _with_resume(
    manager: CheckpointManager,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    trainer: Any = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Resolve resume_from_checkpoint=None (with JITCKPT_RESUME=1) or True to the newest
    committed checkpoint; True is HF's "the last one in the checkpoint folder", which is ours."""
    session = manager.session
    given = (
        kwargs["resume_from_checkpoint"]
        if "resume_from_checkpoint" in kwargs
        else (args[0] if args else None)
    )
    if isinstance(given, str) and output_dir_view.is_view(given, session.layout.checkpoints):
        given = None  # HF's get_last_checkpoint(output_dir) found a link of ours: ours decides
        if args:
            args = (None, *args[1:])
        else:
            kwargs["resume_from_checkpoint"] = None
    if isinstance(given, str) or given is False:
        if isinstance(given, str):
            manager.resuming_from(given)
        if session.topo.rank == 0:
            session.log.info(
                "resume_from_checkpoint=%r set by the script: not overriding it", given
            )
        return args, kwargs
    if given is None and not session.cfg.resume:
        manager.resume()  # starts over
        return args, kwargs
    try:
        chosen = _checkpoint_to_resume(manager, trainer)
    except JitckptError as exc:
        manager.refused(str(exc))
        raise
    if args:
        return (chosen, *args[1:]), kwargs
    kwargs["resume_from_checkpoint"] = chosen
    return args, kwargs


def _nothing_left(trainer: Any, resumed: str, state: Any, control: Any) -> None:
    """jitckpt resumed from training's end (a restart once train() had returned: in an
    evaluation or save_model after it, in a later stage, stages.py). HF's loop would train one
    more step past max_steps from there, unless the checkpoint ends an epoch: it takes no batch
    and stops instead (no epoch-end evaluation or save either: `_nothing_trained`), so the
    model and state stay the checkpoint's, as the run left them, its RNG states too (HF
    restores them with a batch, or at an epoch's start)."""
    session = current().session
    control.should_training_stop = True
    trainer.get_batch_samples = _NoBatches(trainer, resumed)  # until train() returns
    _load_rng(trainer, resumed)  # no epoch may run (the checkpoint ends one)
    if session.topo.rank == 0:
        session.log.info(
            "nothing left to train: checkpoint-%d reaches max_steps %d",
            state.global_step,
            state.max_steps,
        )


class _NoBatches:
    """`get_batch_samples` of `_nothing_left`: no batch, and the checkpoint's RNG states again
    (transformers 4 draws from the RNG starting the epoch's iterator, after on_train_begin)."""

    def __init__(self, trainer: Any, resumed: str) -> None:
        self.trainer, self.resumed = trainer, resumed

    def __call__(self, *_args: Any, **_kwargs: Any) -> tuple[list[Any], None]:
        _load_rng(self.trainer, self.resumed)
        return [], None


def _left_nothing(trainer: Any) -> bool:
    """This train() resumed with nothing left to train (`_nothing_left`)."""
    return isinstance(vars(trainer).get("get_batch_samples"), _NoBatches)


def _retry(manager: CheckpointManager, trainer: Any, state: Any) -> None:
    """At each training loop's start: a second one in the same train() is the Trainer's retry
    (auto_find_batch_size after an out-of-memory error), from the step it resumed from or 0;
    the failed attempt's later saves are left behind (manager.retried)."""
    loops = vars(trainer).get(LOOPS)
    if loops is None:
        return
    vars(trainer)[LOOPS] = loops + 1
    if loops == 0:
        manager.loop_began()
        return
    vars(trainer)[RETRYING] = True
    try:
        manager.retried(state.global_step, getattr(trainer, "_train_batch_size", "?"))
    finally:
        vars(trainer).pop(RETRYING, None)


def _load_rng(trainer: Any, resumed: str) -> None:
    try:
        trainer._load_rng_state(resumed)
    except Exception as exc:  # noqa: BLE001 - HF's own resume goes on without them
        current().session.log.warning("RNG states of %s not restored: %r", resumed, exc)


def _nothing_trained(trainer: Any, control: Any) -> None:
    """The empty epoch of `_nothing_left` ends without an evaluation, a log or a save."""
    if _left_nothing(trainer):
        control.should_evaluate = control.should_save = control.should_log = False


def _ends_epoch(state: Any) -> bool:
    """This optimizer step is an epoch's last (HF sets `epoch` to a whole number there)."""
    return state.epoch is not None and float(state.epoch).is_integer()


def _ask_save(args: Any, control: Any) -> None:
    """Have the Trainer save this step. With save_strategy="best" an evaluation in this step
    decides instead (HF sets should_save to "is it a new best"): a save it makes answers the
    request (on_save); else the next step without an evaluation is saved, or, at the end,
    `_end_training` saves the last step."""
    best = getattr(args.save_strategy, "value", args.save_strategy) == "best"
    if not (best and control.should_evaluate):
        control.should_save = True


class JitckptCallback(TrainerCallback):  # type: ignore[misc]  # transformers is untyped here
    """The Trainer's events, handed to the checkpoint manager; it sets the Trainer's controls."""

    jitckpt_own = True
    """Not a callback that acts on checkpoints (output_dir_view.readers)."""

    def __init__(self, manager: CheckpointManager, trainer: Any) -> None:
        self.manager = manager
        self._trainer = weakref.ref(trainer)
        self._began_at = 0
        self._save_wanted = False
        """A time-based or final save of this step (or a later one) is still to be made."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        manager, session = self.manager, self.manager.session
        self._began_at = state.global_step  # the resumed checkpoint's step, 0 when fresh
        self._save_wanted = False
        trainer = self._trainer()
        if trainer is not None:
            _retry(manager, trainer, state)
        resumed = manager.resumed_dir
        if trainer is not None and resumed and 0 < state.max_steps <= state.global_step:
            _nothing_left(trainer, resumed, state, control)
        _warm_save_path()
        manager.retention(save_total_limit=args.save_total_limit)
        manager.training_started()
        # Nothing left to train: no step, so no fast path, snapshot or survivors' save to set
        # up (set up and closed unused, the abort at exit after a later DDP stage was seen).
        if trainer is not None and not _left_nothing(trainer):
            output_dir_view.gather(trainer, session.control, session.layout.checkpoints)
            own_files = _own_files(manager, trainer)
            _start_async(manager, trainer, own_files)
            manager.survivors.started(trainer, state.global_step, own_files)
        folder = None if trainer is None else trainer._get_output_dir(None)
        ours = os.path.abspath(session.layout.checkpoints)
        if folder is not None and os.path.abspath(folder) != ours:
            session.log.warning(
                "%s overrides _get_output_dir: its checkpoints go to %s, outside "
                "JITCKPT_DIR/checkpoints, and are not committed or resumed from",
                type(trainer).__name__,
                folder,
            )
        elif session.topo.rank == 0:
            session.log.info(
                "checkpoints go to %s; output_dir %s keeps the rest (the model, logs)",
                session.layout.checkpoints,
                os.path.abspath(args.output_dir),
            )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        manager, step = self.manager, state.global_step
        trainer = self._trainer()
        if trainer is not None:  # before any collective: a lost peer's error comes in those
            manager.survivors.step_ended(trainer, step, evaluating=bool(control.should_evaluate))
        manager.step_finished(step, self._began_at)
        if manager.stop_agreed():
            self._stop(state, control)
            return control
        if manager.save_due():  # JITCKPT_SAVE_INTERVAL: the same step on every rank
            self._save_wanted = True
        last = 0 < state.max_steps <= step and manager.last_step(step)  # its save is final
        self._save_wanted |= last
        # At an epoch's end (training's last step ends one too: HF runs on_epoch_end after
        # it), HF's epoch-end evaluation is still to come in this step: the save waits for it
        # in on_epoch_end, as HF's own epoch saves do, so that the checkpoint and the
        # best-model bookkeeping include it.
        if self._save_wanted and not (last or _ends_epoch(state)):
            _ask_save(args, control)
        if trainer is not None and manager.tier.on:
            saved = bool(control.should_save or self._save_wanted or last)
            later = bool(control.should_evaluate or _ends_epoch(state))
            whole = manager.session.topo.nodes > 1
            staged = None
            if getattr(trainer, "is_fsdp_enabled", False):
                staged = _snapshot_staged(trainer, manager.tier.root, manager.session.topo)
            manager.snapshot(
                step,
                lambda: _snapshot_parts(trainer, whole),
                saved=saved,
                later=later,
                staged=staged,
            )
        return control

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        trainer = self._trainer()
        if trainer is not None:
            _nothing_trained(trainer, control)
        if control.should_evaluate:  # the epoch's evaluation: after the step's end
            self.manager.survivors.evaluation_due()
        if self._save_wanted:
            _ask_save(args, control)
        return control

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.manager.survivors.step_begun()
        return control

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.manager.survivors.updating()
        self.manager.before_update()  # an async save's snapshot is complete before the update
        return control

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self._same_step()
        return control

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        # Not the evaluation's end: another eval dataset may follow, and the plateau scheduler
        # and the best metric come after (`_determine_best_metric`, patched above).
        # Evaluation can take minutes; all ranks are in step here, so ask now. Only inside
        # train(): a script may call trainer.evaluate() afterwards, even on one rank.
        self.manager.cadence.not_compared()  # not a save's cost (the overhead budget)
        if self.manager.stop_now():
            self._stop(state, control)
        return control

    def after_save(self, state: Any, control: Any) -> Any:
        """After every callback's `on_save` (CallbackHandler.on_save, _commit_after_on_save):
        commit the save."""
        self._same_step()
        self._save_wanted = False
        self.manager.retention(best_step=_step_of(state.best_model_checkpoint))
        self.manager.saved(state.global_step)
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        manager, trainer = self.manager, self._trainer()
        if trainer is not None:
            _end_training(manager, trainer)
        else:
            manager.training_ending(state.global_step, None)
        if state.is_world_process_zero:
            manager.record_output(args.output_dir, state.global_step)
        manager.survivors.ended()
        manager.training_ended()
        return control

    def _same_step(self) -> None:
        """Later in a step (a log, a save): the survivors' save of this step takes the RNG
        states from here, as HF's own save of it would."""
        trainer = self._trainer()
        if trainer is not None:
            self.manager.survivors.same_step(trainer)

    def _stop(self, state: Any, control: Any) -> None:
        """Every rank agreed to stop at this step: the Trainer saves it next (unless committed:
        then the manager leaves at once)."""
        control.should_training_stop = True
        control.should_evaluate = False
        self.manager.survivors.evaluation_cancelled(state.global_step)
        self.manager.stop_at(state.global_step)
        control.should_save = True
