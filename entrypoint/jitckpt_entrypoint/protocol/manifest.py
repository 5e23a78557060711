"""The manifest: what a node's part of a checkpoint holds, written last as its commit record.

`jitckpt-manifest.node-<K>.json` in a checkpoint directory lists every file node K holds
(relative path, size), the step, kind, node count, world size and a format version. Each entry
names the node that uploads it (`owner`: the lowest node holding that path), so nodes that hold
the same file (save_on_each_node) do not upload it twice. The uploader adds a `checksum` to each
entry it uploads ('<algorithm>:<hex>'); the S3 copy of a manifest is written after the files.
What counts as committed is validity.py's; how a node commits is commit.py's.

Every manifest of one save carries the same `save_id` (drawn once per save, shared by the
nodes): a checkpoint directory whose manifests name several save ids holds parts of several
saves (an attempt re-saved the step) and is committed only for the save whose manifests are
all there. `lineage` names the run the save belongs to: a run that starts without resuming
begins a new lineage (`new_lineage`: its birth time, then random hex, so a later-born lineage
sorts higher); a run that resumes from a checkpoint carries that checkpoint's lineage on.

A node of a sharded (DCP) save also records which shard files its ranks read back at the
save's world size and node count (`shard_dirs`, `shard_reads`: its own, plus the few listed of
other nodes), so a restore at that size fetches only those (validity.node_files); a manifest
without them means every node reads every file (DDP, DeepSpeed, anything not mapped).

The final model is not a checkpoint: what the training script saved into its own output_dir is
staged as `staging/final/` and uploaded to `s3://bucket/prefix/final/` with one manifest of kind
`output` (written last, like a checkpoint's). Its directory name matches no `checkpoint-<step>`,
and checkpoint code accepts only checkpoint kinds, so resume and restore never take it for one.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import stat
import time
from typing import Any, Callable, Optional

from jitckpt_entrypoint.protocol import atomic, durable

FORMAT_VERSION = 1
"""`save_id`, `lineage`, `reads` and `writers` are optional fields of version 1: manifests
written before them read as save id "" and lineage "" (one legacy save and run), no shard map
(every node reads every file) and no writers (every rank wrote), and readers that predate them
ignore them (a rolled-back sidecar still reads every checkpoint, whole)."""
KINDS = ("periodic", "jit", "final")
"""Checkpoint kinds; `final` is the checkpoint of the last training step."""
OUTPUT_KIND = "output"
"""The kind of the manifest in final/: the script's output_dir after training (not a checkpoint)."""
CHECKSUM_ALGORITHMS = ("xxh128", "sha256")
"""The algorithms of entries' checksums that the sidecar writes (xxh128) and verifies (both)."""
MANIFEST_PREFIX = "jitckpt-manifest.node-"
MANIFEST_SUFFIX = ".json"
_MANIFEST_RE = re.compile(r"^jitckpt-manifest\.node-(\d+)\.json$")


def manifest_name(node: int) -> str:
    return f"{MANIFEST_PREFIX}{node}{MANIFEST_SUFFIX}"


def is_manifest_name(name: str) -> bool:
    return _MANIFEST_RE.match(name) is not None


def node_of(name: str) -> Optional[int]:
    """The node of a manifest file name, else None."""
    match = _MANIFEST_RE.match(name)
    return int(match.group(1)) if match else None


def checksum_supported(checksum: str) -> bool:
    """Whether `checksum` is '<one of CHECKSUM_ALGORITHMS>:<hex digest>'."""
    algorithm, sep, digest = checksum.partition(":")
    return bool(sep and digest) and algorithm in CHECKSUM_ALGORITHMS


@dataclasses.dataclass(frozen=True)
class FileEntry:
    path: str
    """Relative to the checkpoint directory, '/'-separated."""
    size: int
    owner: int = 0
    """The node that uploads this file."""
    checksum: Optional[str] = None
    """'<algorithm>:<hex>', added by the uploader; None in local manifests."""

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"path": self.path, "size": self.size, "owner": self.owner}
        if self.checksum is not None:
            entry["checksum"] = self.checksum
        return entry


@dataclasses.dataclass(frozen=True)
class Manifest:
    step: int
    kind: str
    node: int
    nodes: int
    world_size: int
    files: tuple[FileEntry, ...]
    created_at: float = 0.0
    save_seconds: float = 0.0
    """How long the save took on this node (for the entrypoint's grace-period estimate)."""
    save_id: str = ""
    """One per save, the same in every node's manifest ("" in manifests written before it)."""
    lineage: str = ""
    """The run this save belongs to (new_lineage); "" in manifests written before it."""
    shard_dirs: tuple[str, ...] = ()
    """DCP directories of the checkpoint whose shard files (`*.distcp`) this node's ranks do not
    all read at the save's own world size and node count ("" for the checkpoint directory
    itself); empty when unknown: the node reads every file."""
    shard_reads: tuple[str, ...] = ()
    """The shard files under `shard_dirs` that other nodes hold and this node's ranks read."""
    writers: tuple[int, ...] = ()
    """The ranks that wrote a survivors' save (hook/survivors.py: peers were lost, the ranks
    left saved alone); empty for a save every rank took part in."""
    version: int = FORMAT_VERSION

    @property
    def owned(self) -> tuple[FileEntry, ...]:
        """The entries this node uploads."""
        return tuple(f for f in self.files if f.owner == self.node)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def with_files(self, files: tuple[FileEntry, ...]) -> Manifest:
        return dataclasses.replace(self, files=files)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "step": self.step,
            "kind": self.kind,
            "node": self.node,
            "nodes": self.nodes,
            "world_size": self.world_size,
            "created_at": self.created_at,
            "save_seconds": self.save_seconds,
            "save_id": self.save_id,
            "lineage": self.lineage,
            "files": [f.to_json() for f in self.files],
            **(
                {"reads": {"dirs": list(self.shard_dirs), "shards": list(self.shard_reads)}}
                if self.shard_dirs
                else {}
            ),
            **({"writers": list(self.writers)} if self.writers else {}),
        }

    def to_bytes(self) -> bytes:
        import json

        return (json.dumps(self.to_json(), sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, obj: Any) -> Optional[Manifest]:
        """Parse a manifest; None when it is not one we can trust (wrong shape or version)."""
        try:
            if obj["version"] != FORMAT_VERSION or obj["kind"] not in (*KINDS, OUTPUT_KIND):
                return None
            files = tuple(
                FileEntry(
                    path=_safe_relpath(str(f["path"])),
                    size=int(f["size"]),
                    owner=int(f.get("owner", obj["node"])),
                    checksum=f.get("checksum"),
                )
                for f in obj["files"]
            )
            manifest = cls(
                step=int(obj["step"]),
                kind=str(obj["kind"]),
                node=int(obj["node"]),
                nodes=int(obj["nodes"]),
                world_size=int(obj["world_size"]),
                files=files,
                created_at=float(obj.get("created_at", 0.0)),
                save_seconds=float(obj.get("save_seconds", 0.0)),
                save_id=str(obj.get("save_id", "")),
                lineage=str(obj.get("lineage", "")),
            )
            writers = obj.get("writers")
            if writers is not None:
                manifest = dataclasses.replace(manifest, writers=tuple(int(r) for r in writers))
            reads = obj.get("reads")
            if reads is not None:
                manifest = dataclasses.replace(
                    manifest,
                    shard_dirs=tuple(str(d) and _safe_relpath(str(d)) for d in reads["dirs"]),
                    shard_reads=tuple(_safe_relpath(str(p)) for p in reads["shards"]),
                )
        except (KeyError, TypeError, ValueError):
            return None
        if manifest.nodes < 1 or not 0 <= manifest.node < manifest.nodes or manifest.step < 0:
            return None
        if any(f.size < 0 or not 0 <= f.owner < manifest.nodes for f in files):
            return None
        return manifest


def _safe_relpath(path: str) -> str:
    """Reject absolute paths and '..' so a manifest cannot name files outside its directory."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"unsafe path in manifest: {path!r}")
    return path


def list_files(
    directory: str, prune: Optional[Callable[[str, str], bool]] = None
) -> dict[str, int]:
    """Every regular file under `directory` (relative path -> size) but manifests, temp files and
    a restore's unsynced marker; `prune(parent, name)` leaves out the subdirectory `name` of
    `parent` when it is true."""
    found: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        rel_dir = os.path.relpath(dirpath, directory)
        dirnames[:] = sorted(d for d in dirnames if prune is None or not prune(dirpath, d))
        for name in sorted(filenames):
            if is_manifest_name(name) or atomic.is_temp_name(name):
                continue
            if rel_dir == "." and name == durable.UNSYNCED:
                continue
            st = os.lstat(os.path.join(dirpath, name))
            if not stat.S_ISREG(st.st_mode):
                continue
            rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
            found[rel] = st.st_size
    return found


def assign_owners(holdings: dict[int, dict[str, int]]) -> dict[int, tuple[FileEntry, ...]]:
    """Per node, its file entries; each path is owned (uploaded) by the lowest node holding it."""
    owner: dict[str, int] = {}
    for node in sorted(holdings):
        for path in holdings[node]:
            owner.setdefault(path, node)
    return {
        node: tuple(FileEntry(p, s, owner[p]) for p, s in sorted(files.items()))
        for node, files in holdings.items()
    }


def write_manifest(ckpt_dir: str, manifest: Manifest, *, durable: bool = True) -> str:
    """Write `manifest` into `ckpt_dir` atomically and durably (this is the commit); not durably
    only for a restored checkpoint marked unsynced (protocol/durable.py)."""
    path = os.path.join(ckpt_dir, manifest_name(manifest.node))
    atomic.write_bytes(path, manifest.to_bytes(), durable=durable)
    return path


def read_manifest(path: str) -> Optional[Manifest]:
    return Manifest.from_json(atomic.read_json(path))


def read_manifests(ckpt_dir: str) -> dict[int, Manifest]:
    """Every parsable manifest in `ckpt_dir`, by node."""
    try:
        names = os.listdir(ckpt_dir)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    manifests = {}
    for name in names:
        node = node_of(name)
        if node is not None:
            manifest = read_manifest(os.path.join(ckpt_dir, name))
            if manifest is not None and manifest.node == node:
                manifests[node] = manifest
    return manifests


def new_manifest(
    step: int,
    kind: str,
    *,
    node: int,
    nodes: int,
    world_size: int,
    files: tuple[FileEntry, ...],
    save_seconds: float = 0.0,
    save_id: str = "",
    lineage: str = "",
    shard_dirs: tuple[str, ...] = (),
    shard_reads: tuple[str, ...] = (),
    writers: tuple[int, ...] = (),
) -> Manifest:
    """A manifest created now; `save_id` defaults to a new one (right for a single node only:
    the nodes of one save must share it)."""
    if kind not in (*KINDS, OUTPUT_KIND):
        raise ValueError(f"kind must be one of {(*KINDS, OUTPUT_KIND)}, not {kind!r}")
    return Manifest(
        step,
        kind,
        node,
        nodes,
        world_size,
        files,
        created_at=time.time(),
        save_seconds=save_seconds,
        save_id=save_id or new_save_id(),
        lineage=lineage,
        shard_dirs=shard_dirs,
        shard_reads=shard_reads,
        writers=writers,
    )


def new_save_id() -> str:
    """A fresh save id (128 random bits, hex)."""
    return secrets.token_hex(16)


def new_lineage(now: Optional[float] = None) -> str:
    """A fresh lineage: its birth time (UTC, to the millisecond), then random hex. Lineages
    compare as strings in birth order (the restore prefers the newest-born one)."""
    now = time.time() if now is None else now
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{int(now * 1000) % 1000:03d}Z"
    return f"{stamp}-{secrets.token_hex(4)}"
