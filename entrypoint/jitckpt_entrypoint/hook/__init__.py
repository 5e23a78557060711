"""The trainer-side hook, and its public API for plain PyTorch training loops.

Hugging Face Trainer needs none of this (the hook patches it). A hand-written loop uses:

    from jitckpt_entrypoint import hook as jitckpt

    path = jitckpt.latest_checkpoint()          # newest committed on every rank, or None
    if path:
        jitckpt.load(state, path)               # torch.distributed.checkpoint, in place
    for step in range(start, total):
        train_one_step()
        if jitckpt.should_stop():               # True on every rank at the same step
            jitckpt.save(state, step, kind="jit")   # saves, commits, exits JITCKPT_EXIT_CODE
        if step % 100 == 0:
            jitckpt.save(state, step)
    jitckpt.save(state, total, kind="final")
    jitckpt.done()

Every function except `checkpoint_dir` is collective: call it on every rank. This module is
imported at interpreter start in every process, so it imports nothing until called.
"""

from __future__ import annotations

TYPE_CHECKING = False  # importing typing here would cost every Python process ~2 ms
if TYPE_CHECKING:
    from typing import Any, Optional


def should_stop() -> bool:
    """Call once per optimizer step on every rank.

    The first call starts the SIGTERM flag. Returns True on all ranks at the same step once any
    rank got SIGTERM (an async all-reduce read one step later: no blocking collective per step).
    """
    from jitckpt_entrypoint.hook.session import current

    session = current()
    session.training_started()
    return bool(session.cfg.jit and session.control.stop_requested(session.flag.is_set))


def checkpoint_dir(step: int) -> str:
    """Where the checkpoint of `step` lives (JITCKPT_DIR/checkpoints/checkpoint-<step>)."""
    from jitckpt_entrypoint.hook.session import current

    return current().layout.checkpoint_dir(step)


def latest_checkpoint() -> Optional[str]:
    """The newest checkpoint committed on every node, or None (JITCKPT_RESUME=0 gives None)."""
    from jitckpt_entrypoint.hook import resume
    from jitckpt_entrypoint.hook.session import current

    session = current()
    if not session.cfg.resume:
        return None
    step = resume.agreed_step(session)
    resume.remove_newer(session, step)
    if step is None:
        return None
    session.committed_steps.add(step)
    return session.layout.checkpoint_dir(step)


def load(state_dict: dict[str, Any], path: str) -> None:
    """Load a checkpoint written by `save` into `state_dict` in place."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state_dict, checkpoint_id=path)


def save(state_dict: dict[str, Any], step: int, kind: str = "periodic") -> str:
    """Save `state_dict` with torch.distributed.checkpoint as `step`, then commit it.

    kind is periodic, jit or final. With kind="jit" the process then exits with
    JITCKPT_EXIT_CODE. A step that is already committed is not written again.
    """
    import time

    import torch.distributed.checkpoint as dcp

    from jitckpt_entrypoint.hook.commit import commit as commit_dir
    from jitckpt_entrypoint.hook.session import current

    session = current()
    path = session.layout.checkpoint_dir(step)
    seconds = 0.0
    if step not in session.committed_steps:
        started = time.time()
        session.save_started(step, started)
        dcp.save(state_dict, checkpoint_id=path)
        commit_dir(session, path, step, kind, started)
        seconds = time.time() - started
    _after_save(session, step, kind, seconds)
    return path


def commit(path: str, step: int, kind: str = "periodic") -> None:
    """Commit a checkpoint you wrote into `checkpoint_dir(step)` (call after every rank wrote)."""
    import time

    from jitckpt_entrypoint.hook.commit import commit as commit_dir
    from jitckpt_entrypoint.hook.session import current

    session = current()
    if step not in session.committed_steps:
        commit_dir(session, path, step, kind, time.time())
    _after_save(session, step, kind, 0.0)


def done() -> None:
    """Training is over: put back the SIGTERM handler that was there before."""
    from jitckpt_entrypoint.hook.session import current

    current().training_ended()


def _after_save(session: Any, step: int, kind: str, seconds: float) -> None:
    """Leave after a JIT save, or after a save during which SIGTERM arrived on some rank."""
    from jitckpt_entrypoint.hook.commit import finish_jit

    if kind == "jit" or (
        session.cfg.jit and session.training and session.control.any_now(session.flag.is_set)
    ):
        finish_jit(session, step, seconds)
