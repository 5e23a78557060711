"""A save's checkpoint at `args.output_dir/checkpoint-<step>`, where HF lays it out, while the
Trainer's `on_save` callbacks run.

jitckpt writes checkpoints into JITCKPT_DIR/checkpoints (trainer.py's `_get_output_dir`), and
`args.output_dir` keeps the rest. A callback that acts on the checkpoint in `on_save` finds it
through `args.output_dir`, as HF's own integrations do: W&B with `WANDB_LOG_MODEL=checkpoint`,
MLflow with `HF_MLFLOW_LOG_ARTIFACTS`, Neptune, ClearML (by default) and Flyte upload it; a
user's callback may read it, or add a file to it (an EMA state). Such callbacks (`readers`) get,
for the duration of the save's `on_save` and until the next save or the end of training, a
symbolic link there to the checkpoint (`open_view`); trainer_checkpoint.unsupported then has
the Trainer's own save write it, so it is whole when they run, and the commit (jitckpt's own
`on_save`, after theirs) holds what they added. A `resume_from_checkpoint` the script takes from
such a link (HF's `get_last_checkpoint(output_dir)` after a crash) counts as none (`is_view`):
the resume is jitckpt's.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Callable

from jitckpt_entrypoint.protocol.layout import checkpoint_name

INTEGRATIONS = "transformers.integrations.integration_utils"
"""HF's reporting callbacks' module."""
QUIET: dict[str, Callable[[Any], bool]] = {
    "WandbCallback": lambda cb: getattr(cb, "_log_model", "checkpoint") != "checkpoint",
    "MLflowCallback": lambda cb: not getattr(cb, "_log_artifacts", True),
    "DagsHubCallback": lambda cb: not getattr(cb, "_log_artifacts", True),
    "NeptuneCallback": lambda cb: getattr(cb, "_log_checkpoints", "") is None,
    "ClearMLCallback": lambda cb: not getattr(cb, "_log_model", True),
    "FlyteCallback": lambda cb: not getattr(cb, "sync_checkpoints", True),
    "TrackioCallback": lambda _cb: True,  # its on_save returns
    "SwanLabCallback": lambda _cb: True,  # its on_save warns that it saves nothing
    "DVCLiveCallback": lambda _cb: True,  # logs output_dir itself, never a checkpoint in it
}
"""HF's callbacks with an `on_save` of their own, and when it leaves the checkpoint alone (as
they are set up: their flags are read in their `setup`, before jitckpt's `on_train_begin`)."""

_views: list[str] = []
"""This process's links, oldest first."""


def readers(trainer: Any) -> list[str]:
    """The names of the Trainer's callbacks whose `on_save` may act on the checkpoint: any with
    an `on_save` of its own but jitckpt's and HF's quiet ones (QUIET)."""
    from transformers import TrainerCallback

    found = []
    for callback in trainer.callback_handler.callbacks:
        cls = type(callback)
        if getattr(cls, "on_save", None) is TrainerCallback.on_save:
            continue
        if getattr(callback, "jitckpt_own", False):
            continue
        quiet = QUIET.get(cls.__name__) if cls.__module__ == INTEGRATIONS else None
        if quiet is not None and quiet(callback):
            continue
        found.append(cls.__name__)
    return found


def open_view(output_dir: str, checkpoints: str, step: int) -> None:
    """Link `output_dir/checkpoint-<step>` to the checkpoint in `checkpoints`, unless something
    is there already; this process's earlier links go (every rank is past their `on_save`:
    steps' collectives came since). Never raises."""
    close_views()
    link = os.path.join(output_dir, checkpoint_name(step))
    target = os.path.join(os.path.abspath(checkpoints), checkpoint_name(step))
    with contextlib.suppress(OSError):
        if not os.path.lexists(link) and os.path.isdir(target):
            os.makedirs(output_dir, exist_ok=True)
            os.symlink(target, link, target_is_directory=True)
            _views.append(link)


def close_views() -> None:
    """Remove this process's links (still links). Never raises."""
    while _views:
        link = _views.pop()
        with contextlib.suppress(OSError):
            if os.path.islink(link):
                os.unlink(link)


def is_view(path: str, checkpoints: str) -> bool:
    """`path` is such a link, here or left by a process that died (a checkpoint name, linked
    into `checkpoints`)."""
    if not re.fullmatch(r"checkpoint-\d+", os.path.basename(os.path.normpath(path))):
        return False
    try:
        target = os.readlink(path)
    except OSError:
        return False
    return os.path.realpath(os.path.dirname(target)) == os.path.realpath(checkpoints)
