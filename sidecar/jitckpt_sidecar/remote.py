"""The commit protocol on the S3 side: which checkpoints under the prefix are committed.

`s3://bucket/prefix/checkpoint-<step>/` is committed when it holds the manifest of every node
0..nodes-1 (one consistent set), every manifest's owned entries carry a checksum we can verify,
and every owned entry's object is present with the listed size. Each node's uploader writes
its manifest after its files, so a missing manifest means "not (yet) committed"; retention
deletes manifests first, so a half-deleted checkpoint is never committed either.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from typing import Any, Optional

from jitckpt_entrypoint import manifest as m
from jitckpt_entrypoint.config import S3Uri
from jitckpt_sidecar import checksum
from jitckpt_sidecar.errors import SidecarError
from jitckpt_sidecar.s3 import error_code

log = logging.getLogger("jitckpt.jitckpt-sidecar.remote")
_DELETE_BATCH = 1000  # DeleteObjects' limit


@dataclasses.dataclass(frozen=True)
class RemoteCheckpoint:
    step: int
    objects: dict[str, int]
    """Relative path -> size of every object under checkpoint-<step>/ (manifests included)."""
    manifests: dict[int, m.Manifest]
    """The parsable manifests present, by node."""

    @property
    def committed(self) -> bool:
        return problems(self) == []

    def owner_entry(self, path: str, owner: int) -> Optional[m.FileEntry]:
        manifest = self.manifests.get(owner)
        if manifest is None:
            return None
        return next((e for e in manifest.owned if e.path == path), None)

    def files(self) -> dict[str, m.FileEntry]:
        """Every file named by any manifest (the union), as its owner's entry."""
        union: dict[str, m.FileEntry] = {}
        for manifest in self.manifests.values():
            for entry in manifest.files:
                owned = self.owner_entry(entry.path, entry.owner)
                if owned is not None:
                    union[entry.path] = owned
        return union


def problems(ckpt: RemoteCheckpoint, kinds: tuple[str, ...] = m.KINDS) -> list[str]:
    """Why `ckpt` is not committed in S3 (empty when it is); the final model passes
    kinds=(OUTPUT_KIND,) and its manifest's step."""
    manifests = ckpt.manifests
    if not manifests:
        return ["no manifest"]
    nodes = next(iter(manifests.values())).nodes
    missing = sorted(set(range(nodes)) - set(manifests))
    if missing:
        return [f"manifest of node {', '.join(map(str, missing))} missing"]
    if not m.complete_set(manifests, ckpt.step, kinds):
        return ["manifests disagree on the step, the node count or the kind"]
    found = []
    for manifest in manifests.values():
        for entry in manifest.files:
            owned = ckpt.owner_entry(entry.path, entry.owner)
            if owned is None or owned.size != entry.size:
                found.append(f"{entry.path}: not listed by its owner node {entry.owner}")
            elif ckpt.objects.get(owned.path) != owned.size:
                size = ckpt.objects.get(owned.path)
                found.append(
                    f"{owned.path}: object "
                    + ("missing" if size is None else f"has {size} bytes, not {owned.size}")
                )
            elif owned.checksum is None or not checksum.supported(owned.checksum):
                found.append(f"{owned.path}: no checksum we can verify")
    return found


class Remote:
    """Lists, reads and deletes checkpoints under one S3 prefix."""

    def __init__(self, client: Any, uri: S3Uri) -> None:
        self.client = client
        self.uri = uri
        self._committed: dict[int, RemoteCheckpoint] = {}
        self._lock = threading.Lock()

    def key(self, step: int, relpath: str = "") -> str:
        return self.dir_key(m.checkpoint_name(step), relpath)

    def dir_key(self, name: str, relpath: str = "") -> str:
        """The key of `relpath` in directory `name` (checkpoint-<step>, final) of the prefix."""
        return self.uri.key(name, relpath)

    def _prefix(self, name: Optional[str] = None) -> str:
        base = self.uri.key(name) if name is not None else self.uri.prefix
        return f"{base}/" if base else ""

    def steps(self) -> list[int]:
        """Steps of every checkpoint-<step>/ under the prefix, committed or not, ascending."""
        found = []
        prefix = self._prefix()
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.uri.bucket, Prefix=prefix, Delimiter="/"):
            for entry in page.get("CommonPrefixes", []):
                step = m.step_of(entry["Prefix"][len(prefix) :].rstrip("/"))
                if step is not None:
                    found.append(step)
        return sorted(found)

    def objects(self, step: int) -> dict[str, int]:
        return self.objects_in(m.checkpoint_name(step))

    def objects_in(self, name: str) -> dict[str, int]:
        """Relative path -> size of every object in directory `name`."""
        prefix = self._prefix(name)
        found: dict[str, int] = {}
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.uri.bucket, Prefix=prefix):
            for entry in page.get("Contents", []):
                found[entry["Key"][len(prefix) :]] = int(entry["Size"])
        return found

    def load(self, step: int) -> RemoteCheckpoint:
        """The objects and parsable manifests of checkpoint-<step> as S3 has them now."""
        return self.load_dir(m.checkpoint_name(step), step)

    def load_dir(self, name: str, step: Optional[int] = None) -> RemoteCheckpoint:
        """Directory `name` as S3 has it now; without `step`, the step its manifests name."""
        objects = self.objects_in(name)
        manifests = {}
        for rel in objects:
            if "/" in rel or not m.is_manifest_name(rel):
                continue
            parsed = self.read_manifest(self.dir_key(name, rel))
            if parsed is not None and m.manifest_name(parsed.node) == rel:
                manifests[parsed.node] = parsed
        if step is None:
            step = min((man.step for man in manifests.values()), default=0)
        return RemoteCheckpoint(step, objects, manifests)

    def read_manifest(self, key: str) -> Optional[m.Manifest]:
        try:
            body = self.client.get_object(Bucket=self.uri.bucket, Key=key)["Body"].read()
            return m.Manifest.from_json(json.loads(body))
        except ValueError:
            return None
        except Exception as exc:
            if error_code(exc) in ("NoSuchKey", "404"):  # deleted since the listing
                return None
            raise

    def committed(self, step: int, *, refresh: bool = False) -> Optional[RemoteCheckpoint]:
        """checkpoint-<step> when it is committed in S3, else None (positive answers cached)."""
        with self._lock:
            cached = self._committed.get(step)
        if cached is not None and not refresh:
            return cached
        ckpt = self.load(step)
        if not ckpt.committed:
            with self._lock:
                self._committed.pop(step, None)
            return None
        with self._lock:
            self._committed[step] = ckpt
        return ckpt

    def committed_steps(self) -> list[int]:
        """Steps committed in S3 now, ascending (one listing plus one look per checkpoint)."""
        return [s for s in self.steps() if self.committed(s) is not None]

    def remember(self, ckpt: RemoteCheckpoint) -> None:
        """Record a checkpoint known to be committed (e.g. just verified by a restore)."""
        with self._lock:
            self._committed[ckpt.step] = ckpt

    def delete(self, step: int) -> int:
        """Delete checkpoint-<step>, manifests first (so it stops being committed before any
        file goes); returns the number of objects deleted."""
        with self._lock:
            self._committed.pop(step, None)
        return self.delete_dir(m.checkpoint_name(step))

    def delete_dir(self, name: str, only: Optional[set[str]] = None) -> int:
        """Delete directory `name` (or just the relative paths in `only`), manifests first;
        returns the number of objects deleted."""
        objects = sorted(self.objects_in(name))
        if only is not None:
            objects = [n for n in objects if n in only]
        manifests = [n for n in objects if "/" not in n and m.is_manifest_name(n)]
        files = [n for n in objects if n not in manifests]
        deleted = 0
        for batch in (manifests, files):
            for i in range(0, len(batch), _DELETE_BATCH):
                keys = [{"Key": self.dir_key(name, n)} for n in batch[i : i + _DELETE_BATCH]]
                response = self.client.delete_objects(
                    Bucket=self.uri.bucket, Delete={"Objects": keys, "Quiet": True}
                )
                errors = response.get("Errors", [])
                if errors:
                    first = errors[0]
                    raise SidecarError(
                        f"could not delete {len(errors)} object(s) of {name}, "
                        f"e.g. {first.get('Key')}: {first.get('Code')}"
                    )
                deleted += len(keys)
        return deleted
