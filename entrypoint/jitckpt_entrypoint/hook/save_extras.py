"""Files a Trainer's checkpoints hold beyond what the Trainer's own save writes, which a
snapshot in RAM (the Trainer's save alone: trainer.py turns snapshots off) and a survivors' save
(survivors.py: the Trainer's files, written from the state kept at the last step's end) cannot
write.

Two sources (the first checked when training starts with JITCKPT_MEMORY_DIR, both when a peer is
lost):

- a subclass's `_save_checkpoint` that writes into the checkpoint around the Trainer's (TRL's
  GRPOTrainer with `use_adaptive_entropy`: `entropy_ctrl_state.json`, read back on resume).
  What it writes comes from the trainer's attributes, which the step in progress may already
  have changed: such a save is refused. `probe` runs the override once into a scratch
  directory, the Trainer's own part of it replaced by nothing (`instead`), as if this rank
  were the one that saves, and lists what it wrote. TRL's other trainers only write a model
  card into `output_dir`, which is not the checkpoint: nothing to refuse.
- anything else that wrote into this training's committed checkpoints (a callback's `on_save`,
  an override that writes only on world rank 0 when another rank saves): `held_before` lists
  the files of this node's newest such checkpoint that a save in `ckpt_dir` lacks.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Iterator
from typing import Any, Callable, Optional

from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import validity
from jitckpt_entrypoint.protocol.layout import checkpoint_name

_local = threading.local()
CHECKPOINTS_INTO = "_jitckpt_snapshot_into"
"""A Trainer's attribute while its own save writes elsewhere (a snapshot, JITCKPT_MEMORY_DIR's;
`probe`'s scratch directory): the directory its checkpoints go to then, in place of
JITCKPT_DIR's (trainer.py's `_get_output_dir`)."""


def instead() -> Optional[Callable[[], None]]:
    """What the Trainer's `_save_checkpoint` (trainer.py) runs in place of its save on this
    thread while `probe` runs a subclass's override around it; None otherwise."""
    return getattr(_local, "instead", None)


def probe(trainer: Any) -> list[str]:
    """The files (relative paths) the Trainer subclass's own `_save_checkpoint` writes into a
    checkpoint besides the Trainer's; [] when the class has none. Runs the override into a
    scratch directory, with `should_save` and the process indexes of world rank 0. Raises what
    the override raises."""
    from transformers import Trainer

    if getattr(type(trainer), "_save_checkpoint", Trainer._save_checkpoint) is (
        Trainer._save_checkpoint
    ):
        return []
    state = trainer.state
    with tempfile.TemporaryDirectory(prefix="jitckpt-probe-") as scratch:
        ckpt_dir = os.path.join(scratch, checkpoint_name(state.global_step))
        called: list[bool] = []

        def nothing() -> None:  # the Trainer's part: only the directory it would create
            os.makedirs(ckpt_dir, exist_ok=True)
            called.append(True)

        best = state.best_model_checkpoint
        vars(trainer)[CHECKPOINTS_INTO] = scratch
        _local.instead = nothing
        try:
            if trainer._get_output_dir(None) != scratch:
                return ["(anything: the class also overrides _get_output_dir)"]
            with _as_rank_zero(trainer.args):
                trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        finally:
            _local.instead = None
            vars(trainer).pop(CHECKPOINTS_INTO, None)
            state.best_model_checkpoint = best
        written = sorted(m.list_files(ckpt_dir)) if os.path.isdir(ckpt_dir) else []
        if not called:
            written.append("(its whole save: it does not call the Trainer's)")
        return written


@contextlib.contextmanager
def _as_rank_zero(args: Any) -> Iterator[None]:
    """Inside, `args.should_save` is True and its process indexes are 0 (its class swapped for
    a subclass; the only thread that reads `args` now is this one)."""
    cls = type(args)
    zero = type(
        cls.__name__,
        (cls,),
        {
            "__module__": cls.__module__,
            "should_save": property(lambda _: True),
            "process_index": property(lambda _: 0),
            "local_process_index": property(lambda _: 0),
        },
    )
    args.__class__ = zero
    try:
        yield
    finally:
        args.__class__ = cls


def held_before(checkpoints: str, node: int, since: int, ckpt_dir: str, step: int) -> Optional[str]:
    """Why `ckpt_dir` (a survivors' save of `step`) falls short: the files of this node's newest
    committed checkpoint of steps `since` to `step` - 1 that it lacks (DCP's data files aside:
    their names are the writing ranks'); None when it has them all or there is no such
    checkpoint."""
    for earlier in reversed(validity.committed_steps(checkpoints, node)):
        if not since <= earlier < step:
            continue
        save = validity.committed(os.path.join(checkpoints, checkpoint_name(earlier)), node)
        have = m.list_files(ckpt_dir)
        lacking = sorted(
            path
            for path in validity.local_union(save or {})
            if path not in have and not path.endswith(validity.SHARD_SUFFIX)
        )
        if not lacking:
            return None
        return (
            f"{checkpoint_name(earlier)} of this training holds {', '.join(lacking[:5])}, which "
            "the Trainer's save does not write (a callback's or a subclass's own file)"
        )
    return None
