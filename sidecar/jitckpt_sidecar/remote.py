"""Lists, reads and deletes the checkpoint directories under the S3 prefix.

What counts as committed there is the protocol's (validity.s3_problems); this module reads what
it needs for that from S3: one listing per directory and its manifests (read in parallel), and
`heads`: node 0's manifest of every checkpoint (its save, lineage and save time).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.layout import S3Uri, checkpoint_name, step_of
from jitckpt_entrypoint.protocol.validity import RemoteCheckpoint, s3_part_problems
from jitckpt_sidecar.errors import SidecarError
from jitckpt_sidecar.s3 import error_code

log = logging.getLogger("jitckpt.jitckpt-sidecar.remote")
_DELETE_BATCH = 1000  # DeleteObjects' limit
_READERS = 16
"""Manifests read at once (small GETs: latency-bound)."""
CHECKSUM_META = "jitckpt-checksum"
"""User metadata key (x-amz-meta-jitckpt-checksum) of each uploaded object: its checksum,
'<algorithm>:<hex>'."""
SAVE_META = "jitckpt-save"
"""User metadata key (x-amz-meta-jitckpt-save) of each uploaded object: '<save id> <created_at>'
of the save that wrote it."""
PIN_NAME = "jitckpt-restore-pin.json"
"""The restore's pin, at the top of the prefix (restore.py says what it means)."""
PIN_HOLD = 1800.0
"""Seconds a pin binds the restores of other nodes (and holds off retention)."""


@dataclasses.dataclass(frozen=True)
class Pin:
    """The checkpoint the first restore of a round chose: every node restores this one."""

    step: int
    save_id: str
    lineage: str
    pinned_at: float
    """Wall time it was written."""

    def to_bytes(self) -> bytes:
        return (json.dumps(dataclasses.asdict(self), sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, body: bytes) -> Optional[Pin]:
        try:
            obj = json.loads(body)
            return cls(
                int(obj["step"]), str(obj["save_id"]), str(obj["lineage"]), float(obj["pinned_at"])
            )
        except (ValueError, KeyError, TypeError):
            return None


class Remote:
    """Lists, reads and deletes checkpoints under one S3 prefix."""

    def __init__(self, client: Any, uri: S3Uri) -> None:
        self.client = client
        self.uri = uri
        self._committed: dict[int, RemoteCheckpoint] = {}
        self._lock = threading.Lock()

    def through(self, client: Any) -> Remote:
        """This prefix through another client (other timeouts), sharing what is cached."""
        view = copy.copy(self)
        view.client = client
        return view

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
        return {rel: size for rel, (size, _) in self.listing(name).items()}

    def listing(self, name: str) -> dict[str, tuple[int, str]]:
        """Relative path -> (size, ETag) of every object in directory `name`."""
        prefix = self._prefix(name)
        found: dict[str, tuple[int, str]] = {}
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.uri.bucket, Prefix=prefix):
            for entry in page.get("Contents", []):
                found[entry["Key"][len(prefix) :]] = (int(entry["Size"]), entry.get("ETag", ""))
        return found

    def last_written(self, name: str) -> Optional[float]:
        """When the newest object in directory `name` was written (Unix time), None if empty."""
        newest = None
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.uri.bucket, Prefix=self._prefix(name)):
            for entry in page.get("Contents", []):
                when = entry["LastModified"].timestamp()
                newest = when if newest is None else max(newest, when)
        return newest

    def heads(self, steps: list[int]) -> dict[int, m.Manifest]:
        """Node 0's manifest of each of `steps` that has one (its save id, lineage, node count
        and save time), read in parallel: one GET per checkpoint, not one per node."""

        read = self._read_all([self.key(step, m.manifest_name(0)) for step in steps])
        return {
            step: man
            for step, man in zip(steps, read)
            if man is not None and man.node == 0 and man.step == step
        }

    def _read_all(self, keys: list[str]) -> list[Optional[m.Manifest]]:
        """The manifests at `keys`, read in parallel (None where absent or unparsable)."""
        if len(keys) <= 1:
            return [self.read_manifest(key) for key in keys]
        with ThreadPoolExecutor(min(_READERS, len(keys))) as pool:
            return list(pool.map(self.read_manifest, keys))

    def load(self, step: int) -> RemoteCheckpoint:
        """The objects and parsable manifests of checkpoint-<step> as S3 has them now."""
        return self.load_dir(checkpoint_name(step), step)

    def load_dir(self, name: str, step: Optional[int] = None) -> RemoteCheckpoint:
        """Directory `name` as S3 has it now; without `step`, the step its manifests name."""
        listed = self.listing(name)
        objects = {rel: size for rel, (size, _) in listed.items()}
        nodes = {n: rel for rel in objects if "/" not in rel and (n := m.node_of(rel)) is not None}
        read = self._read_all([self.dir_key(name, rel) for rel in nodes.values()])
        manifests = {
            node: parsed
            for node, parsed in zip(nodes, read)
            if parsed is not None and parsed.node == node
        }
        if step is None:
            step = min((man.step for man in manifests.values()), default=0)
        return RemoteCheckpoint(
            step, objects, manifests, etags={rel: etag for rel, (_, etag) in listed.items()}
        )

    def read_manifest(self, key: str) -> Optional[m.Manifest]:
        body = self._get(key)
        try:
            return None if body is None else m.Manifest.from_json(json.loads(body))
        except ValueError:
            return None

    def _get(self, key: str) -> Optional[bytes]:
        """The object's body; None when it is not there (deleted since the listing)."""
        try:
            body: bytes = self.client.get_object(Bucket=self.uri.bucket, Key=key)["Body"].read()
        except Exception as exc:
            if error_code(exc) in ("NoSuchKey", "404"):
                return None
            raise
        return body

    def pinned(self, now: Optional[float] = None) -> Optional[Pin]:
        """The restore's pin when one was written in the last PIN_HOLD seconds, else None."""
        body = self._get(self.uri.key(PIN_NAME))
        pin = None if body is None else Pin.from_bytes(body)
        now = time.time() if now is None else now
        return pin if pin is not None and now - pin.pinned_at < PIN_HOLD else None

    def pin(self, ckpt: RemoteCheckpoint, now: Optional[float] = None) -> Pin:
        """Pin `ckpt` (committed) for the restores of the other nodes."""
        pin = Pin(
            ckpt.step,
            ckpt.save_id or "",
            ckpt.lineage or "",
            time.time() if now is None else now,
        )
        self.client.put_object(
            Bucket=self.uri.bucket,
            Key=self.uri.key(PIN_NAME),
            Body=pin.to_bytes(),
            ContentType="application/json",
        )
        return pin

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

    def holds(self, step: int, node: Optional[int], save_id: Optional[str] = None) -> bool:
        """Whether S3 holds node `node`'s part of checkpoint-<step> (or all of it) of save
        `save_id` (of any save when None), as it is now: asked before a local copy is deleted,
        so never from the cache (another node's retention may have deleted it since). Every
        object of that part must carry the checksum its manifest lists (one HEAD each): a late
        upload of another save of the step, killed after its files, leaves the right sizes with
        the wrong bytes."""
        ckpt = self.load(step)
        if ckpt.committed:
            with self._lock:
                self._committed[step] = ckpt
        if ckpt.committed and (save_id is None or ckpt.save_id == save_id):
            save = ckpt.save or {}
            parts = save.values() if node is None else [save[node]] if node in save else []
        elif node is not None and s3_part_problems(ckpt, node, save_id) == []:
            parts = [ckpt.manifests[node]]
        else:
            return False
        return bool(parts) and self._checksums_match(
            checkpoint_name(step), [e for part in parts for e in part.owned]
        )

    def _checksums_match(self, name: str, entries: list[m.FileEntry]) -> bool:
        """Whether every entry's object in directory `name` carries the entry's checksum."""

        def carries(entry: m.FileEntry) -> bool:
            try:
                head = self.client.head_object(
                    Bucket=self.uri.bucket, Key=self.dir_key(name, entry.path)
                )
            except Exception as exc:
                if error_code(exc) in ("NoSuchKey", "404"):
                    return False
                raise
            return entry.checksum is not None and (
                head.get("Metadata", {}).get(CHECKSUM_META) == entry.checksum
            )

        if len(entries) <= 1:
            return all(carries(e) for e in entries)
        with ThreadPoolExecutor(min(_READERS, len(entries))) as pool:
            return all(pool.map(carries, entries))

    def committed_steps(self, lineage: Optional[str] = None) -> list[int]:
        """Steps committed in S3 now (of `lineage` only, when given), ascending (one listing
        plus one look per checkpoint)."""
        found = []
        for step in self.steps():
            ckpt = self.committed(step)
            if ckpt is not None and (lineage is None or ckpt.lineage == lineage):
                found.append(step)
        return found

    def forget(self, step: int) -> None:
        """Drop what is cached of checkpoint-<step> (its manifests are being replaced)."""
        with self._lock:
            self._committed.pop(step, None)

    def remember(self, ckpt: RemoteCheckpoint) -> None:
        """Record a checkpoint known to be committed (e.g. just verified by a restore)."""
        with self._lock:
            self._committed[ckpt.step] = ckpt

    def delete(self, step: int) -> int:
        """Delete checkpoint-<step>, manifests first (so it stops being committed before any
        file goes); returns the number of objects deleted."""
        self.forget(step)
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
