"""Which files of a DCP checkpoint each rank reads back, so a node restores only those.

A sharded (FSDP) checkpoint is one `dcp.save` per state dict (the model, the optimizer): each
rank writes its shards into its own `__<rank>_<n>.distcp`, and rank 0 writes `.metadata`, which
maps every item to the file and byte range holding it. Items every rank holds alike (plain
tensors such as the optimizer's `step` scalars, and non-tensor values) are written once:
DCP's `dedup_save_plans` gives each to the rank with the least planned bytes so far, which
spreads them over every rank's file, and then every rank reads a few bytes of every other
rank's file. So, for checkpoints under JITCKPT_DIR/checkpoints and snapshots under
JITCKPT_MEMORY_DIR/checkpoints only, three small changes to where DCP puts bytes (never to what
it saves; the checkpoint loads the same everywhere):

- replicated items of at most SMALL bytes go to the lowest rank holding them (big ones stay
  balanced: a DDP model saved through DCP is still written by every rank, 1/N each);
- a rank's file of shards and its file of non-shard items are separate files
  (`__0_0.distcp` and `__0_1.distcp`), so the shared bytes are a file of their own;
- the coordinator maps every rank's own plan (before deduplication: what the rank will load
  at the same world size and sharding) to files through the metadata it writes, and keeps that
  map (`take`) for the commit, which records per node which other nodes' shard files it reads
  (an empty chunk is read by no one), and which files hold shards.

A snapshot in RAM of several nodes (each node's memory volume its own) gets from rank 0 what
its ranks read that no rank of its node wrote (`spread`: `.metadata`, replicated items).

Whatever this cannot see (a save in another process, a planner it does not know) simply has
no map: that checkpoint is restored whole on every node, as before. Every patch falls back
to DCP's own behaviour on any error of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import threading
from typing import Any, Callable, Optional

from jitckpt_entrypoint.protocol.layout import step_of
from jitckpt_entrypoint.protocol.validity import SHARD_SUFFIX, local_save

log = logging.getLogger("jitckpt.hook")

READ_PATIENCE = 540.0
"""Seconds a DCP load waits for the sidecar's fetch: every other rank waits in DCP's read
collective on the training's group meanwhile, and NCCL's default timeout is 10 minutes."""
SMALL = 1 << 20
"""Replicated items up to this size (bytes) are written by the lowest rank holding them."""

_local = threading.local()
_maps: dict[str, list[frozenset[str]]] = {}
"""DCP directory (absolute) -> per rank of the save's group, the files of it that rank reads."""
_sharded: dict[str, frozenset[str]] = {}
"""DCP directory (absolute) -> its files that hold shards (`spread` sends none of them)."""
_lock = threading.Lock()
_root: Optional[str] = None
"""JITCKPT_DIR/checkpoints/ (absolute): its loads ask the sidecar for the files a node lacks."""
_memory: Optional[str] = None
"""JITCKPT_MEMORY_DIR/checkpoints/ ("" without): snapshots in RAM are mapped too (`spread`)."""


def patch_filesystem(module: Any) -> None:
    """torch.distributed.checkpoint.filesystem: the writer notes its directory, the files are
    split by kind, and the coordinator's `finish` maps plans to files."""
    writer = getattr(module, "_FileSystemWriter", None)
    split = getattr(module, "_split_by_size_and_type", None)
    if writer is None or split is None or getattr(writer, "_jitckpt_reads", False):
        return
    writer._jitckpt_reads = True
    prepare, finish = writer.prepare_local_plan, writer.finish

    @functools.wraps(prepare)
    def prepare_local_plan(self: Any, plan: Any) -> Any:
        _local.directory = _ours(getattr(self, "path", None))
        _local.plans = None
        return prepare(self, plan)

    @functools.wraps(finish)
    def finish_(self: Any, metadata: Any, results: Any) -> Any:
        out = finish(self, metadata, results)
        _guarded(_record, metadata)
        return out

    writer.prepare_local_plan = prepare_local_plan
    writer.finish = finish_
    module._split_by_size_and_type = _wrap(split, _split)
    reader = getattr(module, "FileSystemReader", None)
    if reader is not None and hasattr(reader, "read_data"):
        read_data = reader.read_data

        @functools.wraps(read_data)
        def read_data_(self: Any, plan: Any, planner: Any) -> Any:
            _guarded(_fetch_missing, self, plan, what="cannot ask for the missing files")
            return read_data(self, plan, planner)

        reader.read_data = read_data_


def patch_planner(module: Any) -> None:
    """torch.distributed.checkpoint.default_planner: small replicated items go to the lowest
    rank, and the coordinator keeps every rank's plan before deduplication."""
    dedup = getattr(module, "dedup_save_plans", None)
    if dedup is None or getattr(dedup, "_jitckpt_reads", False):
        return
    wrapped = _wrap(dedup, _dedup)
    wrapped._jitckpt_reads = True  # type: ignore[attr-defined]
    module.dedup_save_plans = wrapped


def take(ckpt_dir: str) -> dict[str, list[frozenset[str]]]:
    """The maps of the DCP saves under `ckpt_dir`, by directory relative to it ('/'-separated),
    removed from the store (a checkpoint is committed once)."""
    base = os.path.abspath(ckpt_dir)
    with _lock:
        mine = {
            d: _maps.pop(d) for d in [d for d in _maps if (d + os.sep).startswith(base + os.sep)]
        }
        for d in [d for d in _maps if not os.path.isdir(d)]:  # abandoned saves' maps
            del _maps[d]
        for d in [d for d in _sharded if d not in _maps]:
            del _sharded[d]
    return {_rel(d, base): files for d, files in mine.items()}


def _rel(directory: str, base: str) -> str:
    rel = os.path.relpath(directory, base).replace(os.sep, "/")
    return "" if rel == "." else rel


def node_reads(
    maps: dict[str, list[frozenset[str]]], local_world_size: int
) -> Optional[tuple[tuple[str, ...], dict[tuple[str, ...], tuple[int, ...]]]]:
    """From the maps of one checkpoint's DCP saves (`take`), what each node's manifest
    records: (the directories mapped, {the other nodes' shard files a node reads: the nodes
    that read exactly those}), grouped so it stays small at any node count. Rank r is on node
    r // local_world_size (torchrun's numbering; the commit checks it). None without maps."""
    if not maps or local_world_size < 1:
        return None
    per_node: dict[int, set[str]] = {}
    for directory, per_rank in maps.items():
        for rank, files in enumerate(per_rank):
            node = rank // local_world_size
            reads = per_node.setdefault(node, set())
            for name in files:
                writer = _writer(name)
                if name.endswith(SHARD_SUFFIX) and writer // local_world_size != node:
                    reads.add(f"{directory}/{name}" if directory else name)
    grouped: dict[tuple[str, ...], list[int]] = {}
    for node in sorted(per_node):
        grouped.setdefault(tuple(sorted(per_node[node])), []).append(node)
    return tuple(sorted(maps)), {reads: tuple(nodes) for reads, nodes in grouped.items()}


SPREAD_MAX = 64 << 20
"""Bytes `spread` sends at most per snapshot: metadata and small replicated items, never
shards."""


class NotSpreadError(Exception):
    """A snapshot of several nodes that `spread` cannot make whole on every node."""


def spread(directories: list[str], group: Any, topo: Any) -> None:
    """Background writer, collective on `group` (every rank of the save's), once the DCP saves
    into `directories` of a snapshot in RAM of several nodes are written (each node has a
    memory volume of its own): each other node's local rank 0 writes, from rank 0, the files
    of them that its ranks read at the save's size and no rank of its node wrote: `.metadata`
    and node 0's files of replicated items (`_split` keeps them apart from the shards). Then
    each node's snapshot loads from its own files (validity.whole_here). When that cannot be
    (no read map, a node reads another node's shards, more than SPREAD_MAX), rank 0 raises
    NotSpreadError with the reason: the snapshot is abandoned and snapshots turn off (one line).
    OSError when a file cannot be written (the snapshot is abandoned)."""
    import torch.distributed as dist

    box: list[Any] = [None]
    if topo.rank == 0:
        try:
            box[0] = _to_spread(directories, topo.local_world_size)
        except Exception as exc:  # noqa: BLE001 - reported as the snapshot's failure
            box[0] = f"cannot read what to spread ({exc!r:.100})"
    dist.broadcast_object_list(box, src=0, group=group)
    files = box[0]
    if isinstance(files, str):
        if topo.rank == 0:
            raise NotSpreadError(f"a node's snapshot would not hold what its ranks load: {files}")
        return
    if topo.node == 0 or topo.local_rank != 0:
        return
    for index, name, data, nodes in files:
        if topo.node in nodes:
            with open(os.path.join(directories[index], name), "wb") as f:
                f.write(data)


def _to_spread(
    directories: list[str], local_world_size: int
) -> list[tuple[int, str, bytes, tuple[int, ...]]] | str:
    """Rank 0: (directory's index, file name, bytes, the nodes that read it) of each file
    `spread` writes on other nodes, or why some node cannot be made whole."""
    files, total = [], 0
    for index, directory in enumerate(directories):
        key = os.path.abspath(directory)
        with _lock:
            per_rank, sharded = _maps.get(key), _sharded.get(key, frozenset())
        if per_rank is None:
            return f"its DCP save into {os.path.basename(directory)} has no read map"
        count = len(per_rank) // local_world_size
        readers: dict[str, set[int]] = {".metadata": set(range(1, count))}
        for reader, names in enumerate(per_rank):
            node = reader // local_world_size
            for name in names:
                writer = _writer(name) // local_world_size
                if writer == node:
                    continue
                if writer != 0 or name in sharded:
                    return f"node {node}'s ranks read {name}, shards node {writer} wrote"
                readers.setdefault(name, set()).add(node)
        for name, read_by in sorted(readers.items()):
            with open(os.path.join(directory, name), "rb") as f:
                data = f.read(SPREAD_MAX + 1 - total)
            total += len(data)
            if total > SPREAD_MAX:
                return f"its metadata and replicated items are over {SPREAD_MAX >> 20} MiB"
            files.append((index, name, data, tuple(sorted(read_by))))
    return files


def _writer(name: str) -> int:
    """The rank of the save's group that wrote shard file `name` (`__<rank>_<n>.distcp`); -1
    when the name is not DCP's (so every node reads it)."""
    match = re.match(r"__(\d+)_\d+\.distcp$", name)
    return int(match.group(1)) if match else -1


# -- the patches' bodies --


def _wrap(original: Callable[..., Any], ours: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "directory", None) is None:
            return original(*args, **kwargs)
        try:
            return ours(original, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - DCP's own behaviour, never an error of ours
            _local.directory = None
            log.info("a DCP save is left as DCP lays it out (%s: %s)", type(exc).__name__, exc)
            return original(*args, **kwargs)

    return wrapper


def _dedup(original: Callable[..., Any], all_plans: list[Any], *args: Any, **kwargs: Any) -> Any:
    """Small replicated items to the lowest rank; the rest as DCP dedups them. Keeps the plans
    before deduplication (what each rank loads) for `_record`, when the save's group is the
    whole world (a subgroup's ranks are not the world's: its save gets no map)."""
    import torch.distributed as dist

    whole = dist.is_initialized() and len(all_plans) == dist.get_world_size()
    # An empty chunk (FSDP2's shard of a dimension smaller than the world) is read by no one:
    # a load reads only chunks that overlap its own.
    _local.plans = (
        [
            [item.index for item in plan.items if item.tensor_storage_size() != 0]
            for plan in all_plans
        ]
        if whole
        else None
    )
    _local.shards = {item.index for plan in all_plans for item in plan.items if _shard(item)}
    holders: dict[Any, list[int]] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            holders.setdefault(item.index, []).append(rank)
    drop: list[set[Any]] = [set() for _ in all_plans]
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            ranks = holders[item.index]
            if len(ranks) > 1 and rank != ranks[0] and (item.tensor_storage_size() or 0) <= SMALL:
                drop[rank].add(item.index)
    plans = [
        dataclasses.replace(plan, items=[i for i in plan.items if i.index not in gone])
        if gone
        else plan
        for plan, gone in zip(all_plans, drop)
    ]
    return original(plans, *args, **kwargs)


def _split(original: Callable[..., Any], bins: int, items: list[Any]) -> list[list[Any]]:
    """A rank's shards and its other items (replicated tensors, values) in separate files."""
    shards = [item for item in items if _shard(item)]
    others = [item for item in items if not _shard(item)]
    if not shards or not others:
        return list(original(bins, items))
    return [*original(bins, shards), others]


def _shard(item: Any) -> bool:
    return bool(item.type.name == "SHARD")


def _record(metadata: Any) -> None:
    """On the coordinator, after it wrote `.metadata`: per rank, the files its plan reads."""
    directory, plans = getattr(_local, "directory", None), getattr(_local, "plans", None)
    shards = getattr(_local, "shards", None) or ()
    _local.directory = _local.plans = _local.shards = None
    if directory is None or plans is None:
        return
    where = {index: info.relative_path for index, info in metadata.storage_data.items()}
    files = [frozenset(where[index] for index in plan) for plan in plans]  # KeyError: no map
    sharded = frozenset(where[index] for index in shards if index in where)
    with _lock:
        for gone in [d for d in _maps if not os.path.isdir(d)]:  # rotated or abandoned saves
            del _maps[gone]
            _sharded.pop(gone, None)
        _maps[directory] = files
        _sharded[directory] = sharded


def _fetch_missing(reader: Any, plan: Any) -> None:
    """Before a DCP load under JITCKPT_DIR/checkpoints reads its files: the ones this node does
    not hold (its restore fetched what its ranks load at the checkpoint's own size and layout,
    and this load reshards or is another node's) are asked of the sidecar (hook/fetch.py)."""
    directory = _ours(getattr(reader, "path", None))
    storage = getattr(reader, "storage_data", None)
    if directory is None or not storage or _root is None or not directory.startswith(_root):
        return  # a snapshot in RAM holds what its node loads (`spread`): no sidecar to ask
    rel = os.path.relpath(directory, _root).split(os.sep)
    ckpt_dir = os.path.join(_root, rel[0])
    step = step_of(rel[0])
    paths = {storage[item.storage_index].relative_path for item in plan.items}
    missing = sorted(p for p in paths if not os.path.exists(os.path.join(directory, p)))
    if not missing or step is None:
        return
    save = local_save(ckpt_dir)
    if not save:
        return
    log.info(
        "loading %s needs %d file(s) this node does not hold (e.g. %s); asking the sidecar for "
        "them",
        rel[0],
        len(missing),
        missing[0],
    )
    from jitckpt_entrypoint.hook import fetch
    from jitckpt_entrypoint.protocol.layout import Layout

    fetch.ask_sidecar(
        Layout(os.path.dirname(_root.rstrip(os.sep))),
        step,
        save[0].save_id,
        ready=lambda: all(os.path.exists(os.path.join(directory, p)) for p in missing),
        patience=READ_PATIENCE,  # the other nodes' ranks wait in DCP's collective meanwhile
    )


def _guarded(
    fn: Callable[..., None], *args: Any, what: str = "no per-node read map for a DCP save"
) -> None:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - DCP goes on as without jitckpt, never an error
        log.info("%s (%s: %s)", what, type(exc).__name__, exc)


def _ours(path: Any) -> Optional[str]:
    """`path` (absolute) when it is under JITCKPT_DIR/checkpoints or JITCKPT_MEMORY_DIR/
    checkpoints, else None."""
    global _root, _memory  # noqa: PLW0603 - read once per process
    try:
        if _root is None:
            from jitckpt_entrypoint.config import Config
            from jitckpt_entrypoint.protocol.layout import Layout

            cfg = Config.from_env(os.environ)
            memory = os.path.join(os.path.abspath(cfg.memory_dir), "checkpoints", "")
            _memory = memory if cfg.memory_dir else ""
            _root = os.path.abspath(Layout(cfg.dir).checkpoints) + os.sep
        directory = os.path.abspath(os.fspath(path))
    except Exception:  # noqa: BLE001 - not ours to lay out
        return None
    ours = directory.startswith(_root) or bool(_memory and directory.startswith(_memory))
    return directory if ours else None
