"""Installed by sitecustomize at interpreter start, in processes running under the entrypoint.

Cheap on purpose: it only registers post-import hooks. Nothing happens in a process that never
imports transformers' Trainer (the Trainer patch), torchrun's launcher (the agent patch) or DCP
(where a save under JITCKPT_DIR or JITCKPT_MEMORY_DIR puts its bytes: hook/dcp_reads.py); a
SIGTERM handler is installed only once training starts.
"""

from __future__ import annotations

from jitckpt_entrypoint.postimport import when_imported

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import ModuleType


def _patch_trainer(module: ModuleType) -> None:
    from jitckpt_entrypoint.hook import trainer

    trainer.patch(module)


def _patch_torchrun(module: ModuleType) -> None:
    from jitckpt_entrypoint.hook import torchrun

    torchrun.patch(module)


def _patch_dcp_filesystem(module: ModuleType) -> None:
    from jitckpt_entrypoint.hook import dcp_reads

    dcp_reads.patch_filesystem(module)


def _patch_dcp_planner(module: ModuleType) -> None:
    from jitckpt_entrypoint.hook import dcp_reads

    dcp_reads.patch_planner(module)


def install() -> None:
    when_imported("transformers.trainer", _patch_trainer)
    when_imported("torch.distributed.run", _patch_torchrun)
    when_imported("torch.distributed.checkpoint.filesystem", _patch_dcp_filesystem)
    when_imported("torch.distributed.checkpoint.default_planner", _patch_dcp_planner)
