"""FSDP Trainer checkpoints (SHARDED_STATE_DICT) written in the background.

Under FSDP the Trainer has accelerate write the model and the optimizer through DCP: one
`dcp.save` each, of this rank's shards, with collectives on the training group. An async save
runs the Trainer's own `_save_checkpoint` with those saves deferred (`DeferredSaves`): each
`dcp.save` stages its state dict into host memory with DCP's own stager (every rank copies its
shards) and returns at once; the Trainer writes its small files (scheduler, RNG, trainer state)
as usual; HF's rotation is held until the commit. The background writer then runs DCP's own
`save` of each staged copy, in order, with its collectives on the writer's group, and the
manager votes and commits as for every async save. The files, names and formats are exactly
the Trainer's, so HF's resume (accelerate's `load_fsdp_model`) reads them unchanged.

FSDP FULL_STATE_DICT stays synchronous: it gathers the whole model on rank 0 (collectives on
the training group) and rank 0 writes it with torch.save.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger("jitckpt.hook")
_warned = False


def sharded(trainer: Any) -> bool:
    """FSDP with a sharded state dict (each rank saves its own shards through DCP)."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return False
    return "SHARDED_STATE_DICT" in str(trainer.accelerator.state.fsdp_plugin.state_dict_type)


def snapshot_bytes(trainer: Any) -> int:
    """Host memory this rank's staged copy takes: its shards of the parameters and buffers,
    and of the optimizer state (before the first step, Adam's two moments per trainable
    parameter)."""
    model = trainer.model
    total = sum(_nbytes(t) for t in [*model.parameters(), *model.buffers()])
    if trainer.args.save_only_model or trainer.optimizer is None:
        return total
    state = trainer.optimizer.state
    if state:
        total += sum(
            _nbytes(v) for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)
        )
    else:
        total += 2 * sum(_nbytes(p) for p in model.parameters() if p.requires_grad)
    return total


def _nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor (FSDP2): this rank's shard
    return int(local.numel() * local.element_size())


class DeferredSaves:
    """Inside `with`: `torch.distributed.checkpoint.save` stages and returns, and HF's rotation
    does nothing; `write(group)` then runs the deferred saves (see the module doc). A state
    DCP's stager cannot copy is not saved by one rank alone (its collectives would meet no
    one): `staged` is False, and once every rank knows (the adapter asks them all),
    `write_now()` saves everything as it would have been, on every rank."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._saves: list[tuple[Any, Any, dict[str, Any]]] = []
        """(live state dict, its staged copy or None, dcp.save's other arguments), in order."""
        self._patches = contextlib.ExitStack()
        self._original: Any = None
        self.directories: list[str] = []
        """Where the deferred saves write (their FileSystemWriter's path), in order."""

    @property
    def staged(self) -> bool:
        return all(copy is not None for _, copy, _ in self._saves)

    def __enter__(self) -> DeferredSaves:
        import torch.distributed.checkpoint as dcp
        from transformers import trainer as hf

        self._original = dcp.save
        self._patches.enter_context(_patched(dcp, "save", self._stage))
        if hasattr(hf, "rotate_checkpoints"):  # the manager rotates after the commit
            self._patches.enter_context(_patched(hf, "rotate_checkpoints", _no_rotation))
        else:  # transformers < 5: a Trainer method
            self._patches.enter_context(_patched(self.trainer, "_rotate_checkpoints", _no_rotation))
        return self

    def __exit__(self, *exc: object) -> None:
        self._patches.close()

    def _stage(self, state_dict: Any = None, **kwargs: Any) -> None:
        """`dcp.save` while deferred: DCP's own staging (as `dcp.async_save` does it)."""
        from concurrent.futures import Future

        from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager

        writer = kwargs.get("storage_writer")
        stager = writer if isinstance(writer, AsyncStager) else BlockingAsyncStager()
        staged = None
        if self.staged:  # after one failure the rest is saved synchronously too
            try:
                staged = stager.stage(state_dict)
                if isinstance(staged, Future):
                    staged = staged.result()
            except Exception as exc:  # noqa: BLE001 - the synchronous save is always right
                global _warned  # noqa: PLW0603 - one warning per process
                if not _warned:
                    _warned = True
                    log.warning(
                        "an FSDP state DCP cannot stage is saved synchronously (no snapshot of "
                        "it is taken): %s",
                        exc,
                    )
                staged = None
        self._saves.append((state_dict, staged, kwargs))
        writer_path = getattr(writer, "path", None) or kwargs.get("checkpoint_id")
        self.directories.append(str(writer_path))

    def write(self, group: Any, check: Any = None) -> None:
        """Background (collective on `group`): DCP's own save of each staged copy, in order;
        `check` between them (a cancelled save stops before the next one)."""
        from torch.distributed.checkpoint import state_dict_saver

        # Every rank staged (write_now is not needed): the live state dicts (accelerate's
        # offloaded host copies) go, and each staged copy once it is written.
        saves, self._saves = [(staged, kwargs) for _, staged, kwargs in self._saves], []
        while saves:
            staged, kwargs = saves.pop(0)
            if check is not None:
                check()
            state_dict_saver.save(staged, **{**kwargs, "process_group": group})
            del staged

    def write_now(self) -> None:
        """Training thread, on every rank (some rank could not stage): every deferred save,
        synchronously, as the Trainer would have made it."""
        for state_dict, _, kwargs in self._saves:
            self._original(state_dict, **kwargs)


def _no_rotation(*_args: Any, **_kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """`owner.name = value` inside `with` (a module attribute, or an instance's own one)."""
    had = name in vars(owner)
    old = vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)
