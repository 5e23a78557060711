"""The commit protocol: local layout, manifest format, and what counts as committed.

Both sides use this module (the sidecar imports it), so there is one definition of a valid
checkpoint:

- `JITCKPT_DIR/checkpoints/checkpoint-<step>/` is written by the Trainer (or `hook.save`).
- It is *committed* when it holds `jitckpt-manifest.node-<K>.json` for every node K of the job
  and the files listed for this node are present with their listed sizes. Each manifest is
  written last, atomically, after every local rank finished saving.
- Each entry names the node that uploads it (`owner`: the lowest node holding that path), so
  nodes that hold the same file (save_on_each_node) do not upload it twice. The uploader adds a
  `checksum` to each entry it uploads; the S3 copy of a manifest is written last.
- Anything else (no manifest, a missing or short file) is ignored and never loaded.

The final model is not a checkpoint: what the training script saved into its own output_dir is
staged as `staging/final/` and uploaded to `s3://bucket/prefix/final/` with one manifest of kind
`output` (written last, like a checkpoint's). Its directory name matches no `checkpoint-<step>`,
and checkpoint code accepts only checkpoint kinds, so resume and restore never take it for one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import shutil
import time
from typing import Any, Optional

from jitckpt_entrypoint import atomic
from jitckpt_entrypoint.errors import JitckptError

FORMAT_VERSION = 1
KINDS = ("periodic", "jit", "final")
"""Checkpoint kinds; `final` is the checkpoint of the last training step."""
OUTPUT_KIND = "output"
"""The kind of the manifest in final/: the script's output_dir after training (not a checkpoint)."""
FINAL_NAME = "final"
"""The final model's directory under staging/ and under the S3 prefix."""
MANIFEST_PREFIX = "jitckpt-manifest.node-"
MANIFEST_SUFFIX = ".json"
CHECKPOINT_PREFIX = "checkpoint-"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_MANIFEST_RE = re.compile(r"^jitckpt-manifest\.node-(\d+)\.json$")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Paths under JITCKPT_DIR."""

    root: str

    @property
    def checkpoints(self) -> str:
        """The Trainer's output_dir; one `checkpoint-<step>/` per save."""
        return os.path.join(self.root, "checkpoints")

    @property
    def staging(self) -> str:
        """Committed checkpoints hard-linked for the sidecar to upload."""
        return os.path.join(self.root, "staging")

    @property
    def status(self) -> str:
        """Small JSON files the trainer side writes for the sidecar and the entrypoint."""
        return os.path.join(self.root, "status")

    @property
    def final(self) -> str:
        """The final model (the script's output_dir) staged for upload to final/ in S3."""
        return os.path.join(self.staging, FINAL_NAME)

    def checkpoint_dir(self, step: int) -> str:
        return os.path.join(self.checkpoints, checkpoint_name(step))

    def ensure(self) -> None:
        for path in (self.checkpoints, self.staging, self.status):
            os.makedirs(path, exist_ok=True)

    def prepare(self) -> None:
        """ensure(), then prove this process can write there (a one-line error naming the fix)."""
        try:
            self.ensure()
            probe = os.path.join(self.status, f".write-probe.{atomic.unique_suffix()}.tmp")
            with open(probe, "w") as f:
                f.write("ok")
            os.unlink(probe)
        except OSError as exc:
            reason = exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))
            raise JitckptError(
                f"JITCKPT_DIR={self.root!r} is not writable by uid {os.getuid()} ({reason}); "
                "mount the shared emptyDir there (writable for the pod's UID) or set JITCKPT_DIR"
            ) from None


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step}"


def step_of(name: str) -> Optional[int]:
    """The step of a `checkpoint-<step>` directory name, else None."""
    match = _CHECKPOINT_RE.match(name)
    return int(match.group(1)) if match else None


def manifest_name(node: int) -> str:
    return f"{MANIFEST_PREFIX}{node}{MANIFEST_SUFFIX}"


def is_manifest_name(name: str) -> bool:
    return _MANIFEST_RE.match(name) is not None


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
            "files": [f.to_json() for f in self.files],
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


def list_files(ckpt_dir: str) -> dict[str, int]:
    """Every regular file under `ckpt_dir` (relative path -> size) but manifests and temp files."""
    found: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(ckpt_dir):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, ckpt_dir)
        for name in sorted(filenames):
            if is_manifest_name(name) or atomic.is_temp_name(name):
                continue
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            if not _is_regular(st.st_mode):
                continue
            rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
            found[rel] = st.st_size
    return found


def _is_regular(mode: int) -> bool:
    import stat

    return stat.S_ISREG(mode)


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


def write_manifest(ckpt_dir: str, manifest: Manifest) -> str:
    """Write `manifest` into `ckpt_dir` atomically and durably (this is the commit)."""
    path = os.path.join(ckpt_dir, manifest_name(manifest.node))
    atomic.write_bytes(path, manifest.to_bytes(), durable=True)
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
        match = _MANIFEST_RE.match(name)
        if match:
            manifest = read_manifest(os.path.join(ckpt_dir, name))
            if manifest is not None and manifest.node == int(match.group(1)):
                manifests[manifest.node] = manifest
    return manifests


def complete_set(
    manifests: dict[int, Manifest], step: Optional[int] = None, kinds: tuple[str, ...] = KINDS
) -> bool:
    """Whether `manifests` holds one consistent manifest for every node of the job.

    A checkpoint's manifests have checkpoint kinds; the final model's pass kinds=(OUTPUT_KIND,).
    """
    if not manifests:
        return False
    first = next(iter(manifests.values()))
    if set(manifests) != set(range(first.nodes)):
        return False
    return all(
        m.nodes == first.nodes
        and m.step == first.step
        and (step is None or m.step == step)
        and m.kind in kinds
        for m in manifests.values()
    )


def committed(ckpt_dir: str, node: Optional[int] = None) -> Optional[dict[int, Manifest]]:
    """The manifests when `ckpt_dir` is committed, else None.

    Committed: every node's manifest is present and consistent, and the files listed for `node`
    (every node's files when `node` is None) exist with their listed sizes.
    """
    step = step_of(os.path.basename(os.path.normpath(ckpt_dir)))
    if step is None:
        return None
    manifests = read_manifests(ckpt_dir)
    if not complete_set(manifests, step):
        return None
    if node is not None and node not in manifests:
        return None
    to_check = manifests.values() if node is None else (manifests[node],)
    for manifest in to_check:
        for entry in manifest.files:
            try:
                if os.stat(os.path.join(ckpt_dir, entry.path)).st_size != entry.size:
                    return None
            except OSError:
                return None
    return manifests


def checkpoint_steps(checkpoints_dir: str) -> list[int]:
    """Steps of every `checkpoint-<step>` directory, committed or not, ascending."""
    try:
        names = os.listdir(checkpoints_dir)
    except FileNotFoundError:
        return []
    steps = [s for s in map(step_of, names) if s is not None]
    return sorted(
        s for s in steps if os.path.isdir(os.path.join(checkpoints_dir, checkpoint_name(s)))
    )


def committed_steps(checkpoints_dir: str, node: Optional[int] = None) -> list[int]:
    """Steps of the committed checkpoints under `checkpoints_dir`, ascending."""
    return [
        s
        for s in checkpoint_steps(checkpoints_dir)
        if committed(os.path.join(checkpoints_dir, checkpoint_name(s)), node) is not None
    ]


def newest_committed(checkpoints_dir: str, node: Optional[int] = None) -> Optional[int]:
    """The highest committed step; checks from the newest down (cheap when the newest is valid)."""
    for step in reversed(checkpoint_steps(checkpoints_dir)):
        if committed(os.path.join(checkpoints_dir, checkpoint_name(step)), node) is not None:
            return step
    return None


def remove_checkpoint(ckpt_dir: str) -> None:
    """Delete a checkpoint directory, manifests first, so a half-deleted one is never committed."""
    removed = False
    for name in _listdir(ckpt_dir):
        if is_manifest_name(name):
            # Another node may remove the same directory of a shared (PVC) volume at once.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(ckpt_dir, name))
            removed = True
    if removed:
        with contextlib.suppress(FileNotFoundError):
            atomic.fsync_dir(ckpt_dir)
    shutil.rmtree(ckpt_dir, ignore_errors=True)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def new_manifest(
    step: int,
    kind: str,
    *,
    node: int,
    nodes: int,
    world_size: int,
    files: tuple[FileEntry, ...],
    save_seconds: float = 0.0,
) -> Manifest:
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
    )
