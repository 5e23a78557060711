"""Files a Trainer's checkpoints hold beyond what the Trainer's own save writes, which a
snapshot in RAM (the Trainer's save alone) and a survivors' save (survivors.py: the Trainer's
files, written from the state kept at the last step's end) cannot write.

Two sources:

- a subclass's `_save_checkpoint` that writes into the checkpoint around the Trainer's (TRL's
  GRPOTrainer with `use_adaptive_entropy`: `entropy_ctrl_state.json`, read back on resume;
  TRL's async GRPO: `rollout_state.json`). What it writes comes from the trainer's attributes,
  which the step in progress may already have changed when a peer is lost. When training
  starts, where snapshots or survivors' saves could be made, every rank runs the override once
  (`probe`: as a save runs it, collectives and all)
  into a scratch directory, the Trainer's own part of it replaced by nothing (`instead`), and
  lists what it wrote; trainer.py gathers the lists, and snapshots and survivors' saves are
  off when any rank wrote something (TRL's SFT, DPO and most others only write a model card
  into `output_dir`, which is not the checkpoint: nothing to refuse).
- anything else that wrote into this training's committed checkpoints: `held_before` lists the
  files of this node's newest such checkpoint that a survivors' save lacks (a callback's
  `on_save` already turns survivors' saves off: output_dir_view.py).
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
from typing import Any, Callable, Optional

from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import validity
from jitckpt_entrypoint.protocol.layout import checkpoint_name, checkpoint_steps

_local = threading.local()
CHECKPOINTS_INTO = "_jitckpt_snapshot_into"
"""A Trainer's attribute while its own save writes elsewhere (a snapshot, JITCKPT_MEMORY_DIR's;
`probe`'s scratch directory): the directory its checkpoints go to then, in place of
JITCKPT_DIR's (trainer.py's `_get_output_dir`)."""
OTHER_RANKS = re.compile(r"rng_state_\d+\.pth")
"""Files of a save whose names depend on its world size."""


def instead() -> Optional[Callable[[], None]]:
    """What the Trainer's `_save_checkpoint` (trainer.py) runs in place of its save on this
    thread while `probe` runs a subclass's override around it; None otherwise."""
    return getattr(_local, "instead", None)


def overrides(trainer: Any) -> bool:
    """The Trainer's class has a `_save_checkpoint` of its own."""
    from transformers import Trainer

    own = getattr(type(trainer), "_save_checkpoint", Trainer._save_checkpoint)
    return own is not Trainer._save_checkpoint


def probe(trainer: Any, scratch_root: str) -> list[str]:
    """The files (relative paths) the Trainer subclass's own `_save_checkpoint` writes on this
    rank into a checkpoint besides the Trainer's: the override run once into a scratch
    directory under `scratch_root` (the volume: an override that never calls the Trainer's
    writes a whole save there). Call it on every rank, as a save runs it. Raises what the
    override raises."""
    state = trainer.state
    os.makedirs(scratch_root, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".jitckpt-probe-", dir=scratch_root) as scratch:
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
            trainer._save_checkpoint(trainer.model_wrapped, None)
        finally:
            _local.instead = None
            vars(trainer).pop(CHECKPOINTS_INTO, None)
            state.best_model_checkpoint = best
        written = sorted(m.list_files(ckpt_dir)) if os.path.isdir(ckpt_dir) else []
        if not called:
            written.append("(its whole save: it does not call the Trainer's)")
        return written


def held_before(
    checkpoints: str, node: int, ckpt_dir: str, *, since: int, step: int, lineage: Optional[str]
) -> Optional[str]:
    """Why `ckpt_dir` (a survivors' save of `step`) falls short: the files it lacks of this
    node's newest committed checkpoint of this training (`lineage`, steps `since` to `step` - 1;
    DCP's data files and the ranks' RNG files aside: their names are the writing ranks'); None
    when it has them all or there is no such checkpoint."""
    for earlier in sorted(checkpoint_steps(checkpoints), reverse=True):
        if not since <= earlier < step:
            continue
        save = validity.committed(os.path.join(checkpoints, checkpoint_name(earlier)), node)
        if save is None or save[0].lineage != lineage:
            continue
        have = m.list_files(ckpt_dir)
        lacking = sorted(
            path
            for path in validity.local_union(save)
            if path not in have
            and not path.endswith(validity.SHARD_SUFFIX)
            and not OTHER_RANKS.fullmatch(os.path.basename(path))
        )
        if not lacking:
            return None
        return (
            f"{checkpoint_name(earlier)} of this training holds {', '.join(lacking[:5])}, which "
            "the Trainer's save does not write (a callback's own file)"
        )
    return None
