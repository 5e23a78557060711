"""Hugging Face Trainer integration, applied the moment `transformers.trainer` is imported.

Every Trainer (TRL's trainers subclass it) gets, with no change to the training script:

- checkpoints (`checkpoint-<step>/`) in JITCKPT_DIR/checkpoints, while `args.output_dir` stays
  the script's for everything else (save_model, model card, metrics, logs): transformers derives
  every checkpoint path (save, rotation, best model, end-of-training clean-up) from
  `Trainer._get_output_dir`, the one method patched for it;
- the JITCKPT_SAVE_* overrides (logged once);
- resume from the newest checkpoint committed on every node, unless the script passed
  resume_from_checkpoint itself (HF's get_last_checkpoint ignores commit markers);
- a callback that commits every save, agrees across ranks after each optimizer step whether any
  rank got SIGTERM (async, read one step later), and on agreement saves that step, commits it
  and exits with JITCKPT_EXIT_CODE;
- when training ends normally, world rank 0 records its output_dir: after the command exits 0
  the entrypoint stages what the script saved there as the final model (final/ in S3).
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from types import ModuleType
from typing import Any, NoReturn, Optional

from transformers.trainer_callback import TrainerCallback

from jitckpt_entrypoint.hook import resume
from jitckpt_entrypoint.hook.commit import commit, finish_jit
from jitckpt_entrypoint.hook.session import Session, current
from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.layout import step_of

_logged_overrides = False


def patch(module: ModuleType) -> None:
    """Wrap Trainer.__init__, train, _get_output_dir and _save_checkpoint."""
    trainer_cls = module.Trainer
    if getattr(trainer_cls, "_jitckpt_patched", False):
        return
    session = current()
    original_init = trainer_cls.__init__
    original_train = trainer_cls.train
    original_save = trainer_cls._save_checkpoint
    original_output_dir = trainer_cls._get_output_dir

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - it is __init__
        args, kwargs = _with_training_args(session, module, args, kwargs)
        original_init(self, *args, **kwargs)
        self.add_callback(JitckptCallback(session, self))

    @functools.wraps(original_train)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _with_resume(session, args, kwargs)
        return original_train(self, *args, **kwargs)

    @functools.wraps(original_output_dir)
    def _get_output_dir(self: Any, trial: Any) -> str:
        if trial is not None and self.hp_search_backend is not None:
            return str(original_output_dir(self, trial))  # hyperparameter search: not ours
        return session.layout.checkpoints

    @functools.wraps(original_save)
    def _save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        step = self.state.global_step
        if step in session.committed_steps:
            # Never write into a committed directory: a crash mid-overwrite would leave a
            # manifest in front of torn files. (Epoch-end saves repeat the final step.)
            return None
        started = time.time()
        session.save_started(step, started)
        callback = _callback_of(self)
        if callback is not None:
            callback.save_started = started
        return original_save(self, *args, **kwargs)

    trainer_cls.__init__ = __init__
    trainer_cls.train = train
    trainer_cls._save_checkpoint = _save_checkpoint
    trainer_cls._get_output_dir = _get_output_dir
    trainer_cls._jitckpt_patched = True


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


def _callback_of(trainer: Any) -> Optional[JitckptCallback]:
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, JitckptCallback):
            return callback
    return None


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


def _step_of(checkpoint: Optional[str]) -> Optional[int]:
    return step_of(os.path.basename(os.path.normpath(checkpoint))) if checkpoint else None


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)


def _with_resume(
    session: Session, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Resolve resume_from_checkpoint=None (with JITCKPT_RESUME=1) or True to the newest
    committed checkpoint; True is HF's "the last one in the checkpoint folder", which is ours."""
    given = (
        kwargs["resume_from_checkpoint"]
        if "resume_from_checkpoint" in kwargs
        else (args[0] if args else None)
    )
    if isinstance(given, str) or given is False:
        if session.topo.rank == 0:
            session.log.info(
                "resume_from_checkpoint=%r set by the script: not overriding it", given
            )
        return args, kwargs
    if given is None and not session.cfg.resume:
        return args, kwargs
    step = resume.agreed_step(session)
    resume.remove_newer(session, step)
    if step is None:
        chosen = None
        if session.topo.rank == 0:
            session.log.info(
                "no committed checkpoint in %s: training from the start", session.layout.checkpoints
            )
    else:
        session.committed_steps.add(step)
        chosen = session.layout.checkpoint_dir(step)
        if session.topo.rank == 0:
            session.log.info("resuming from %s", chosen)
    if args:
        return (chosen, *args[1:]), kwargs
    kwargs["resume_from_checkpoint"] = chosen
    return args, kwargs


class JitckptCallback(TrainerCallback):  # type: ignore[misc]  # transformers is untyped here
    """Commits every save; stops all ranks at the same step after SIGTERM and JIT-saves it."""

    def __init__(self, session: Session, trainer: Any) -> None:
        self.session = session
        self._trainer = weakref.ref(trainer)
        self.save_started: Optional[float] = None
        self.pending_kind: Optional[str] = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        session = self.session
        session.control  # noqa: B018 - collective: create the group while every rank is here
        _warm_save_path()
        session.save_total_limit = args.save_total_limit
        session.announce()
        session.training_started()
        trainer = self._trainer()
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
        session = self.session
        if session.cfg.jit and session.control.stop_requested(session.flag.is_set):
            self._stop(state, control)
        elif (
            0 < state.max_steps <= state.global_step
            and state.global_step not in session.committed_steps
        ):
            control.should_save = True
            self.pending_kind = "final"
        return control

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        # Evaluation can take minutes; all ranks are in step here, so ask now. Only inside
        # train(): a script may call trainer.evaluate() afterwards, even on one rank.
        session = self.session
        if session.training and session.cfg.jit and session.control.any_now(session.flag.is_set):
            self._stop(state, control)
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        session, step = self.session, state.global_step
        save_seconds = 0.0
        session.best_step = _step_of(state.best_model_checkpoint)
        if step not in session.committed_steps:
            started = self.save_started or time.time()
            kind = self.pending_kind or "periodic"
            commit(session, session.layout.checkpoint_dir(step), step, kind, started)
            save_seconds = time.time() - started
        if self.pending_kind == "jit":
            self._finish_jit(step, save_seconds)
        self.pending_kind = None
        # A SIGTERM that arrived during the save: this step is committed, stop right here.
        if session.cfg.jit and session.control.any_now(session.flag.is_set):
            self._finish_jit(step, 0.0)
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        session, step = self.session, state.global_step
        trainer = self._trainer()
        stopping = self.pending_kind == "jit"
        if step not in session.committed_steps and trainer is not None:
            # Training ended without saving its last step (an early stop, a save_strategy that
            # overrode ours): save it now, as JIT if that is why we stopped, else as final.
            self.pending_kind = "jit" if stopping else "final"
            trainer._save_checkpoint(trainer.model_wrapped, trial=None)
            self.on_save(args, state, control)
        elif stopping:
            self._finish_jit(step, 0.0)
        # SIGTERM during the end of training (best-model loading, a last evaluation): the
        # final step is committed, so leave now rather than wait for the pod's SIGKILL.
        if session.cfg.jit and session.control.any_now(session.flag.is_set):
            self._finish_jit(step, 0.0)
        if state.is_world_process_zero and session.run_id:
            output = status.OutputRecord(
                session.run_id, os.path.abspath(args.output_dir), step, time.time()
            )
            try:
                status.write_output(session.layout.status, output)
            except OSError as exc:  # the model is still saved; only its upload is lost
                session.log.warning("cannot record output_dir for the final model: %s", exc)
        session.training_ended()
        return control

    def _stop(self, state: Any, control: Any) -> None:
        """Every rank agreed to stop at this step: save it (unless committed) and leave."""
        session = self.session
        control.should_training_stop = True
        control.should_evaluate = False
        self.pending_kind = "jit"
        if session.topo.rank == 0:
            session.log.info("all ranks stop at step %d for a JIT checkpoint", state.global_step)
        if state.global_step in session.committed_steps:
            self._finish_jit(state.global_step, 0.0)  # does not return
        control.should_save = True

    def _finish_jit(self, step: int, save_seconds: float) -> NoReturn:
        finish_jit(self.session, step, save_seconds)
