"""The trainer-side hook, and its public API for plain PyTorch training loops.

Hugging Face Trainer needs none of this (the hook patches it). A hand-written loop uses:

    from jitckpt_entrypoint import hook as jitckpt

    path = jitckpt.latest_checkpoint()          # newest committed on every rank, or None
    if path:
        jitckpt.load(state, path)               # torch.distributed.checkpoint, in place
    for step in range(start, total):
        train_one_step()
        if jitckpt.should_stop(step):           # True on every rank at the same step
            jitckpt.save(state, step, kind="jit")   # saves, commits, exits JITCKPT_EXIT_CODE
        if step % 100 == 0 or jitckpt.should_save():  # should_save: JITCKPT_SAVE_INTERVAL
            jitckpt.save(state, step)           # async_=True: written in the background
        elif jitckpt.should_snapshot(step):     # JITCKPT_MEMORY_DIR: a snapshot in RAM
            jitckpt.snapshot(state, step)
    jitckpt.save(state, total, kind="final")
    jitckpt.done()

Every function except `checkpoint_dir` and `should_save` is collective (`should_snapshot` on its
first call): call it on every rank.
This module is imported at interpreter start in every process, so it imports nothing until
called.
"""

from __future__ import annotations

TYPE_CHECKING = False  # importing typing here would cost every Python process ~2 ms
if TYPE_CHECKING:
    from typing import Any, Optional


def should_stop(step: Optional[int] = None) -> bool:
    """Call once per optimizer step on every rank, after the step; `step` (optional) feeds the
    sidecar's work-at-risk metrics.

    The first call starts the SIGTERM flag. Returns True on all ranks at the same step once any
    rank got SIGTERM (an async all-reduce read one step later: no blocking collective per step).
    """
    from jitckpt_entrypoint.hook.manager import current

    manager = current()
    manager.training_started()
    if step is not None:
        manager.step_finished(step)
    return manager.stop_agreed()


def should_save() -> bool:
    """After `should_stop()` in the same step: True on every rank at the same step when a
    time-based periodic save is due (JITCKPT_SAVE_INTERVAL, or the interval the
    JITCKPT_SAVE_OVERHEAD budget picked) or a save was asked for now (the sidecar, on the
    cluster's notice before SIGTERM: save_asks.py). Not collective.
    """
    from jitckpt_entrypoint.hook.manager import current

    return current().save_due()


def should_snapshot(step: int) -> bool:
    """After `should_stop()` in the same step: True on every rank at the same step when a
    snapshot to JITCKPT_MEMORY_DIR is due (JITCKPT_SNAPSHOT_INTERVAL); always False without
    JITCKPT_MEMORY_DIR. Collective on its first call (snapshots are decided then): call it on
    every rank, every step."""
    from jitckpt_entrypoint.hook.manager import current

    return current().snapshot_wanted(step)


def snapshot(state_dict: dict[str, Any], step: int) -> None:
    """Save `state_dict` with torch.distributed.checkpoint into JITCKPT_MEMORY_DIR as the
    snapshot of `step`, and commit it there (collective; after `should_snapshot(step)` said
    so). `latest_checkpoint()` returns it after a crash when it is newer than the newest
    checkpoint. A write DCP reports failed on every rank (a full tmpfs) turns snapshots off in
    one line; what the state dict itself raises (your `state_dict()`) propagates, as in
    `save`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from jitckpt_entrypoint.hook.manager import current

    current().saver.write_snapshot(
        step,
        lambda path: dcp.save(state_dict, checkpoint_id=path),
        (CheckpointException, OSError),
    )


def checkpoint_dir(step: int) -> str:
    """Where the checkpoint of `step` lives (JITCKPT_DIR/checkpoints/checkpoint-<step>)."""
    from jitckpt_entrypoint.hook.manager import current

    return current().checkpoint_dir(step)


def latest_checkpoint() -> Optional[str]:
    """The newest checkpoint committed on every node, or None (JITCKPT_RESUME=0 gives None)."""
    from jitckpt_entrypoint.hook.manager import current

    manager = current()
    step = manager.resume()
    return None if step is None else manager.resumed_dir


def load(state_dict: dict[str, Any], path: str) -> None:
    """Load a checkpoint written by `save` into `state_dict` in place."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state_dict, checkpoint_id=path)


def save(
    state_dict: dict[str, Any], step: int, kind: str = "periodic", async_: bool = False
) -> str:
    """Save `state_dict` with torch.distributed.checkpoint as `step`, then commit it.

    kind is periodic, jit or final. With kind="jit" the process then exits with
    JITCKPT_EXIT_CODE. A step that is already committed is not written again. With
    JITCKPT_MEMORY_DIR (one node), a periodic save goes to RAM and the entrypoint's RAM writer
    writes it to the volume and commits it there after this returns (what you write into the
    returned directory meanwhile is kept); the next save and `done()` wait for it.
    async_=True (a periodic save only): DCP's own `async_save` stages the state to host memory
    and writes it on a thread; jitckpt commits it once every rank's write is done. The next
    save (and `done()`) waits for it; a SIGTERM stop abandons it uncommitted when it is older.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from jitckpt_entrypoint.hook.manager import current

    manager = current()
    if async_ and kind == "periodic":
        return manager.save_dcp_async(
            step,
            lambda path, group: dcp.async_save(state_dict, checkpoint_id=path, process_group=group),
        )
    write = lambda path: dcp.save(state_dict, checkpoint_id=path)  # noqa: E731
    return manager.save(step, write, kind, (CheckpointException, OSError))


def commit(path: str, step: int, kind: str = "periodic") -> None:
    """Commit a checkpoint you wrote into `checkpoint_dir(step)` (call after every rank wrote)."""
    from jitckpt_entrypoint.hook.manager import current

    current().commit_written(path, step, kind)


def done() -> None:
    """Training is over: put back the SIGTERM handler that was there before. After
    `should_stop()` started training, its final save (`save` or `commit` with kind="final":
    training's last checkpoint only) does it too; `done()` after one does nothing."""
    from jitckpt_entrypoint.hook.manager import current

    current().training_ended()
