"""Lists, reads and deletes the checkpoint directories under the S3 prefix.

What counts as committed there is the protocol's (validity.s3_problems); this module reads what
it needs for that from S3: one listing per directory and its manifests.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Optional

from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.layout import S3Uri, checkpoint_name, step_of
from jitckpt_entrypoint.protocol.validity import RemoteCheckpoint, s3_part_problems
from jitckpt_sidecar.errors import SidecarError
from jitckpt_sidecar.s3 import error_code

log = logging.getLogger("jitckpt.jitckpt-sidecar.remote")
_DELETE_BATCH = 1000  # DeleteObjects' limit


class Remote:
    """Lists, reads and deletes checkpoints under one S3 prefix."""

    def __init__(self, client: Any, uri: S3Uri) -> None:
        self.client = client
        self.uri = uri
        self._committed: dict[int, RemoteCheckpoint] = {}
        self._lock = threading.Lock()

    def key(self, step: int, relpath: str = "") -> str:
        return self.dir_key(checkpoint_name(step), relpath)

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
                step = step_of(entry["Prefix"][len(prefix) :].rstrip("/"))
                if step is not None:
                    found.append(step)
        return sorted(found)

    def objects(self, step: int) -> dict[str, int]:
        return self.objects_in(checkpoint_name(step))

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
        return self.load_dir(checkpoint_name(step), step)

    def load_dir(self, name: str, step: Optional[int] = None) -> RemoteCheckpoint:
        """Directory `name` as S3 has it now; without `step`, the step its manifests name."""
        objects = self.objects_in(name)
        manifests = {}
        for rel in objects:
            node = None if "/" in rel else m.node_of(rel)
            if node is None:
                continue
            parsed = self.read_manifest(self.dir_key(name, rel))
            if parsed is not None and parsed.node == node:
                manifests[node] = parsed
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

    def holds(self, step: int, node: Optional[int]) -> bool:
        """Whether S3 holds node `node`'s part of checkpoint-<step> (or all of it), as it is now:
        asked before a local copy is deleted, so never from the cache (another node's retention
        may have deleted it since)."""
        ckpt = self.load(step)
        if ckpt.committed:
            with self._lock:
                self._committed[step] = ckpt
            return True
        return node is not None and s3_part_problems(ckpt, node) == []

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
        return self.delete_dir(checkpoint_name(step))

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
