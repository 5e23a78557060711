"""The survivors' save of an HSDP job: a node left holds one whole replica, in shards.

Under HSDP (FSDP2 on a 2-D mesh, accelerate's ParallelismConfig with dp_replicate and
dp_shard) with one replica per node, each node's ranks together hold the whole model and
optimizer state, each rank its shards. When a node is lost, the ranks of a node left write
the last step they all completed with no collective (survivors.py decides when):

- `replica_per_node` says whether the Trainer is such a job;
- each rank runs the Trainer's own FSDP save (`_save_optimizer_and_scheduler`, whose
  accelerate calls build exactly the state dicts of a checkpoint) with DCP's `save` writing
  this rank's state dict alone (`no_dist`: its own shards and the replicated items, no plan
  gathered) into a part directory of its own (`write_part`);
- the node's local rank 0 merges the parts into the Trainer's DCP directories (`merge`): each
  rank's data file renamed after its rank, one `.metadata` that lists every rank's chunks. It
  checks that the chunks of every tensor cover it whole, once each: a replica split over
  nodes, or a part missing, is never committed.

The merged directories hold what the Trainer's collective save of that step holds, chunk for
chunk, so HF's resume (accelerate's `load_fsdp_model`) reads them at any world size DCP can
reshard to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pickle
import shutil
import warnings
from collections.abc import Iterator
from typing import Any, Optional

PART = "rank{rank}"
"""A rank's part directory, under the node's parts directory."""
MODEL_DIR, OPTIMIZER_DIR = "pytorch_model_fsdp_0", "optimizer_0"
"""The DCP directories of the Trainer's FSDP checkpoint (accelerate's names)."""


def replica_per_node(
    trainer: Any, rank: int, local_rank: int, local_world_size: int
) -> Optional[str]:
    """None when the Trainer is FSDP2 sharded within each node and replicated across nodes
    (the ranks of this rank's replica are exactly its node's); else why no node holds a whole
    replica."""
    from jitckpt_entrypoint.hook import fsdp_checkpoint

    if not fsdp_checkpoint.sharded(trainer):
        return "FSDP FULL_STATE_DICT: no rank holds a whole replica"
    plugin = trainer.accelerator.state.fsdp_plugin
    if getattr(plugin, "fsdp_version", 1) != 2:
        return "FSDP1 shards the state over every rank: no node holds a whole replica"
    from torch.distributed.tensor import DTensor, Replicate, Shard

    first = rank - local_rank
    node_ranks = list(range(first, first + local_world_size))
    meshes: set[int] = set()
    for param in trainer.model.parameters():
        if not isinstance(param, DTensor):
            return "a parameter FSDP does not shard: not HSDP"
        mesh, placements = param.device_mesh, param.placements
        if mesh.ndim != 2 or not (
            isinstance(placements[0], Replicate) and isinstance(placements[1], Shard)
        ):
            return "FSDP shards the state over every rank: no node holds a whole replica"
        if id(mesh) not in meshes:
            meshes.add(id(mesh))
            coordinate = mesh.get_coordinate()
            group = [] if coordinate is None else mesh.mesh[coordinate[0]].flatten().tolist()
            if sorted(int(r) for r in group) != node_ranks:
                return "HSDP's replica groups are not the job's nodes: no node holds a replica"
    return None if meshes else "no parameters"


SAVE_METHODS = ("save_model", "_save")
"""Trainer methods a survivors' save under HSDP does not run (it runs the Trainer's FSDP save,
`_save_optimizer_and_scheduler`, and the shared files): a subclass's own is refused (its own
`_save_checkpoint` only when it writes files of its own: save_extras.py, when training starts)."""


def overridden(trainer: Any) -> Optional[str]:
    """The first of SAVE_METHODS the Trainer's class overrides, or None."""
    from transformers import Trainer

    for name in SAVE_METHODS:
        if getattr(type(trainer), name, None) is not getattr(Trainer, name, None):
            return name
    return None


@contextlib.contextmanager
def dcp_alone() -> Iterator[None]:
    """Inside, on this thread: `torch.distributed.checkpoint.save` writes this rank's state
    dict alone, with no collective (its writer's directory must be this rank's own). Other
    threads' saves (a background save) run as they would."""
    import threading

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import default_planner, state_dict_saver

    own = threading.get_ident()
    original = dcp.save
    validate = getattr(default_planner, "_validate_global_plan", None)
    # torch < 2.8 checks that one plan covers every tensor whole (a rank alone holds shards):
    # merge() checks the parts together instead. "Valid" as this torch says it: True (bool),
    # or no error messages (>= 2.8).
    returns = str(getattr(validate, "__annotations__", {}).get("return"))
    valid: Any = True if "bool" in returns else []

    def alone(state_dict: Any = None, **kwargs: Any) -> Any:
        if threading.get_ident() != own:
            return original(state_dict, **kwargs)
        kwargs.pop("process_group", None)
        kwargs["no_dist"] = True
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore")
            return state_dict_saver.save(state_dict, **kwargs)

    def check(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != own:
            return validate(*args, **kwargs)  # type: ignore[misc]
        return valid

    dcp.save = alone
    if validate is not None:
        default_planner._validate_global_plan = check
    try:
        yield
    finally:
        dcp.save = original
        if validate is not None:
            default_planner._validate_global_plan = validate


def write_part(trainer: Any, part: str) -> list[str]:
    """This rank's shards (and the replicated items) of the Trainer's FSDP save, in `part`:
    the DCP directories written there (relative names)."""
    os.makedirs(part, exist_ok=True)
    with dcp_alone():
        trainer._save_optimizer_and_scheduler(part)
    return sorted(
        name for name in os.listdir(part) if os.path.isfile(os.path.join(part, name, ".metadata"))
    )


def merge(parts: dict[int, str], target: str) -> None:
    """DCP directories `parts` (rank -> one rank's save alone) into one in `target`: each data
    file moved and named after its rank, one `.metadata` of all chunks. Raises ValueError when
    a tensor's chunks do not cover it exactly once."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    os.makedirs(target, exist_ok=True)
    first: Optional[Metadata] = None
    tensors: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for rank, part in sorted(parts.items()):
        metadata = FileSystemReader(part).read_metadata()
        first = first or metadata
        renamed: dict[str, str] = {}
        for index, info in (metadata.storage_data or {}).items():
            name = renamed.setdefault(info.relative_path, _ranked(info.relative_path, rank))
            storage.setdefault(index, dataclasses.replace(info, relative_path=name))
        for old, new in renamed.items():
            os.replace(os.path.join(part, old), os.path.join(target, new))
        for fqn, meta in metadata.state_dict_metadata.items():
            have = tensors.setdefault(fqn, meta)
            if have is not meta and isinstance(meta, TensorStorageMetadata):
                offsets = {tuple(c.offsets) for c in have.chunks}
                have.chunks.extend(c for c in meta.chunks if tuple(c.offsets) not in offsets)
    if first is None:
        raise ValueError("no parts to merge")
    for fqn, meta in tensors.items():
        if isinstance(meta, TensorStorageMetadata):
            _covered_once(fqn, list(meta.size), [(c.offsets, c.sizes) for c in meta.chunks])
    merged = Metadata(
        state_dict_metadata=tensors,
        planner_data=first.planner_data,
        storage_data=storage,
        storage_meta=first.storage_meta,
        **({"version": first.version} if hasattr(first, "version") else {}),
    )
    path = os.path.join(target, ".metadata")
    with open(f"{path}.tmp", "wb") as f:
        pickle.dump(merged, f)
    os.replace(f"{path}.tmp", path)


def _covered_once(fqn: str, size: list[int], chunks: list[tuple[Any, Any]]) -> None:
    """Raises ValueError unless `chunks` ((offsets, sizes)) lie inside `size` and cover it
    exactly once (inside, no two overlapping, their volumes summing to the whole)."""
    for offsets, sizes in chunks:
        if any(o < 0 or o + n > d for o, n, d in zip(offsets, sizes, size)):
            raise ValueError(f"{fqn}: a chunk lies outside the tensor")
    for i, (a_off, a_size) in enumerate(chunks):
        for b_off, b_size in chunks[i + 1 :]:
            if all(a < b + bn and b < a + an for a, an, b, bn in zip(a_off, a_size, b_off, b_size)):
                raise ValueError(f"{fqn}: two parts hold the same elements")
    covered, whole = sum(math.prod(n) for _, n in chunks), math.prod(size)
    if covered != whole:
        raise ValueError(f"{fqn}: the parts hold {covered} of its {whole} elements")


def _ranked(name: str, rank: int) -> str:
    """A save alone's data file (`__0_<n>.distcp`) named as rank `rank` writes it."""
    if not name.startswith("__0_"):
        raise ValueError(f"unexpected DCP data file {name!r}")
    return f"__{rank}_{name[len('__0_') :]}"


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
