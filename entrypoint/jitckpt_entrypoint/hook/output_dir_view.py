"""A save's checkpoint at `args.output_dir/checkpoint-<step>`, where HF lays it out, while the
Trainer's `on_save` callbacks run.

jitckpt writes checkpoints into JITCKPT_DIR/checkpoints (trainer.py's `_get_output_dir`), and
`args.output_dir` keeps the rest. A callback that acts on the checkpoint in `on_save` finds it
through `args.output_dir`, as HF's own integrations do: W&B with `WANDB_LOG_MODEL=checkpoint`,
MLflow with `HF_MLFLOW_LOG_ARTIFACTS`, Neptune, ClearML (by default) and Flyte upload it; a
user's callback may read it, or add a file to it (an EMA state). When any rank has such a
callback (`gather`, when training starts), the save's `on_save` callbacks get a symbolic link
there to the checkpoint (`open_view`; it goes at the next save, when training ends and before
a JIT or survivors' exit, not after an error; one a killed process left goes when training
starts), trainer_checkpoint.unsupported has the
Trainer's own save write it, so it is whole when they run, and trainer.py commits it after
every callback's `on_save`, so the commit holds what they added. A `resume_from_checkpoint`
the script takes from such a link (HF's `get_last_checkpoint(output_dir)` after a crash)
counts as none (`is_view`): the resume is jitckpt's.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Callable

from jitckpt_entrypoint.protocol.layout import checkpoint_name

INTEGRATIONS = "transformers.integrations.integration_utils"
"""HF's reporting callbacks' module."""
TRUE = {"1", "ON", "YES", "TRUE"}


def _env_true(name: str, default: str) -> bool:
    return os.environ.get(name, default).upper() in TRUE


QUIET: dict[str, Callable[[Any], bool]] = {
    "WandbCallback": lambda cb: getattr(cb, "_log_model", "checkpoint") != "checkpoint",
    "MLflowCallback": lambda _cb: not _env_true("HF_MLFLOW_LOG_ARTIFACTS", "FALSE"),
    "NeptuneCallback": lambda cb: getattr(cb, "_log_checkpoints", "") is None,
    "ClearMLCallback": lambda _cb: not _env_true("CLEARML_LOG_MODEL", "TRUE"),
    "FlyteCallback": lambda cb: not getattr(cb, "sync_checkpoints", True),
    "TrackioCallback": lambda _cb: True,  # its on_save returns
    "SwanLabCallback": lambda _cb: True,  # its on_save warns that it saves nothing
    "DVCLiveCallback": lambda _cb: True,  # logs output_dir itself, never a checkpoint in it
}
"""HF's callbacks with an `on_save` of their own (the class in a callback's MRO that defines
it), and when it leaves the checkpoint alone: by what they read in `__init__`, or the same
environment variables their `setup` reads (on world rank 0 only, and perhaps after jitckpt
decides)."""
READERS = "_jitckpt_checkpoint_readers"
"""A Trainer's attribute: `gather`'s answer for this training."""

_views: list[str] = []
"""This process's links, oldest first."""


def gather(trainer: Any, control: Any, checkpoints: str) -> list[str]:
    """Collective (every rank, when training starts): the names of the Trainer's callbacks
    whose `on_save` may act on the checkpoint on any rank; kept for `readers`. Links a killed
    process left in `output_dir` go first: no rank has opened one yet, and a script's
    `get_last_checkpoint(output_dir)` after training would find an old checkpoint there."""
    _clear_leftovers(getattr(getattr(trainer, "args", None), "output_dir", None), checkpoints)
    try:
        mine = _here(trainer)
    except Exception as exc:  # noqa: BLE001 - counted as one that may act on checkpoints
        mine = [f"(callbacks not inspected: {exc!r:.60})"]
    found = sorted({name for rank in control.all_gather(mine) for name in rank})
    vars(trainer)[READERS] = found
    return found


def _clear_leftovers(output_dir: Any, checkpoints: str) -> None:
    """Remove the links in `output_dir` (`is_view`, and `open_view`'s dot-named ones a kill
    left before their rename). Never raises."""
    if not isinstance(output_dir, str):
        return
    with contextlib.suppress(OSError):
        for name in os.listdir(output_dir):
            path = os.path.join(output_dir, name)
            made = re.fullmatch(r"\.checkpoint-\d+\.jitckpt-\d+", name) and os.path.islink(path)
            if made or is_view(path, checkpoints):
                with contextlib.suppress(FileNotFoundError):  # a node-mate's removal
                    os.unlink(path)


def readers(trainer: Any) -> list[str]:
    """`gather`'s answer for this training, or this rank's own before it."""
    found = vars(trainer).get(READERS)
    return list(found) if found is not None else _here(trainer)


def _here(trainer: Any) -> list[str]:
    """This rank's callbacks with an `on_save` of their own, but jitckpt's and HF's quiet ones
    (QUIET)."""
    from transformers import TrainerCallback

    found = []
    for callback in trainer.callback_handler.callbacks:
        cls = type(callback)
        if getattr(cls, "on_save", None) is TrainerCallback.on_save:
            continue
        if getattr(callback, "jitckpt_own", False):
            continue
        owner = next((c for c in cls.__mro__ if "on_save" in vars(c)), cls)
        quiet = QUIET.get(owner.__name__) if owner.__module__ == INTEGRATIONS else None
        if quiet is not None and quiet(callback):
            continue
        found.append(cls.__name__)
    return found


def open_view(output_dir: str, checkpoints: str, step: int) -> None:
    """Link `output_dir/checkpoint-<step>` to the checkpoint in `checkpoints`, unless something
    else is there; this process's earlier links go (every rank is past their `on_save`: steps'
    collectives came since, or the commit's barrier), but one of this step's. The ranks of a
    node share the path, and one's callback may be using it while another opens it: a link
    there to this checkpoint (another rank's, a killed process's, however its path is spelt)
    stays and is this process's to remove later too, and one to another checkpoint (a killed
    process's) is replaced in one rename, so the path is never missing. Never raises."""
    link = os.path.join(output_dir, checkpoint_name(step))
    target = os.path.join(os.path.abspath(checkpoints), checkpoint_name(step))
    close_views(keep=link)
    with contextlib.suppress(OSError):
        if os.path.lexists(link) and not is_view(link, checkpoints):
            return  # the script's own, an earlier run's: left alone
        if os.path.realpath(link) != os.path.realpath(target):
            if not os.path.isdir(target):
                return
            os.makedirs(output_dir, exist_ok=True)
            made = os.path.join(output_dir, f".{checkpoint_name(step)}.jitckpt-{os.getpid()}")
            os.symlink(target, made, target_is_directory=True)
            try:
                os.replace(made, link)  # a real directory made there meanwhile: EISDIR
            except OSError:
                os.unlink(made)
                raise
        if link not in _views:
            _views.append(link)


def close_views(keep: str = "") -> None:
    """Remove this process's links (still links), all but `keep`. Never raises."""
    kept = [link for link in _views if link == keep]
    while _views:
        link = _views.pop()
        with contextlib.suppress(OSError):
            if link != keep and os.path.islink(link):
                os.unlink(link)
    _views.extend(kept[:1])


def is_view(path: str, checkpoints: str) -> bool:
    """`path` is such a link, here or left by a process that died (a checkpoint name, linked
    into `checkpoints`)."""
    if not re.fullmatch(r"checkpoint-\d+", os.path.basename(os.path.normpath(path))):
        return False
    link = os.path.normpath(path)
    try:
        target = os.path.join(os.path.dirname(link), os.readlink(link))  # a relative one: there
    except OSError:
        return False
    return os.path.realpath(os.path.dirname(target)) == os.path.realpath(checkpoints)
