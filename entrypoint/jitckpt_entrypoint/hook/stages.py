"""A process's later training stages run as they would without jitckpt.

jitckpt's checkpoints, resume, JIT save and fast paths are the first `train()`'s in a process.
A later one (a second Trainer: SFT then DPO, a curriculum's next part; or `train()` again)
would share JITCKPT_DIR/checkpoints with it: it would resume from the first stage's newest
checkpoint (its own training would not happen: the old step count, the old optimizer), and
after a restart the first stage would resume from a later stage's. So a later stage is the
Trainer's own, with one line: checkpoints in its output_dir, no resume of jitckpt's, SIGTERM as
without jitckpt. After a restart the first stage resumes from its own checkpoints (its last
one: nothing left to train, trainer.py's `_nothing_left`) and the later stages run again.

A hyperparameter search's trials (`hp_search_backend` set while it runs) are the Trainer's own
too: each trial trains afresh into its own `run-N` directory. They do not count as a stage.
"""

from __future__ import annotations

import os
from typing import Any

from jitckpt_entrypoint.hook.session import Session

ASIDE = "_jitckpt_later_stage"
"""Set in a Trainer's __dict__: its train() is a later stage's."""

_began = False
"""A train() of jitckpt's began in this process."""
_told_trials = False


def began() -> bool:
    return _began


def mark(trainer: Any) -> None:
    """A Trainer built once a stage began: it gets no callback and no JITCKPT_SAVE_* overrides
    (trainer.py undoes those of one built before, when its train() is a later stage's)."""
    vars(trainer)[ASIDE] = True


def aside(trainer: Any) -> bool:
    """The Trainer's saves and output_dir are its own now (a later stage's, or a trial's)."""
    return bool(vars(trainer).get(ASIDE)) or getattr(trainer, "hp_search_backend", None) is not None


def decide(trainer: Any, session: Session) -> bool:
    """At train(): True when this train() is the Trainer's own (logged on rank 0); False when
    it is jitckpt's, the process's first."""
    global _began, _told_trials  # noqa: PLW0603 - one process, one first stage
    if getattr(trainer, "hp_search_backend", None) is not None:
        if not _told_trials and session.topo.rank == 0:
            _told_trials = True
            session.log.info(
                "hyperparameter search: its trials run as without jitckpt (checkpoints in "
                "output_dir's run-N, no resume, no JIT checkpoint on SIGTERM)"
            )
        return True
    if not _began and not vars(trainer).get(ASIDE):
        _began = True
        return False
    mark(trainer)
    if session.topo.rank == 0:
        session.log.warning(
            "a second train() in this process (a later training stage): it runs as without "
            "jitckpt (checkpoints in its output_dir %s, no resume, no JIT checkpoint on "
            "SIGTERM); jitckpt protects the first one. To protect each stage, run them as "
            "separate jobs",
            trainer.args.output_dir,
        )
    return True


def resume_true(
    trainer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], checkpoints: str
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A later stage's `resume_from_checkpoint=True` (train longer: max_steps raised, train()
    again): HF's newest checkpoint in output_dir, or, when it has none, the newest committed
    in `checkpoints`, where the earlier stage's went."""
    given = kwargs.get("resume_from_checkpoint", args[0] if args else None)
    if given is not True:
        return args, kwargs
    from transformers.trainer_utils import get_last_checkpoint

    from jitckpt_entrypoint.protocol import validity
    from jitckpt_entrypoint.protocol.layout import checkpoint_name, checkpoint_steps

    output_dir = trainer.args.output_dir
    if os.path.isdir(output_dir) and get_last_checkpoint(output_dir) is not None:
        return args, kwargs
    paths = (os.path.join(checkpoints, checkpoint_name(s)) for s in checkpoint_steps(checkpoints))
    newest = next((p for p in reversed(list(paths)) if validity.committed(p)), None)
    if newest is None:
        return args, kwargs
    if args:
        return (newest, *args[1:]), kwargs
    return args, {**kwargs, "resume_from_checkpoint": newest}


def run(trainer: Any, train: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ours: type) -> Any:
    """The Trainer's own train(), without jitckpt's callback (class `ours`), which a Trainer
    built before the first stage began has; a trial's Trainer gets it back afterwards."""
    handler = trainer.callback_handler
    index = next((i for i, cb in enumerate(handler.callbacks) if isinstance(cb, ours)), None)
    callback = handler.callbacks.pop(index) if index is not None else None
    try:
        return train(trainer, *args, **kwargs)
    finally:
        if callback is not None and not vars(trainer).get(ASIDE):
            handler.callbacks.insert(index, callback)
